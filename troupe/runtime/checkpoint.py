"""Driver side of sharded checkpoints: every rank of the given roles writes its file in
parallel, the driver writes the manifest last, and only a directory with a manifest counts.

In a local directory the ranks write into a staging directory that is renamed to
root/step-NNNNNNNN once its manifest is there. A save interrupted at any point (a rank killed
mid-file, the driver lost) leaves no step-* directory with a manifest, so ``latest`` finds the
previous checkpoint; the staging directory is cleared by the next save of that step. Under an
fsspec URL (s3://..., where nothing renames atomically) the ranks write into step-NNNNNNNN in
place, and the manifest, written last, is what makes it complete."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Collection, Union

from troupe import checkpoint as ckpt
from troupe.checkpoint import storage
from troupe.checkpoint.storage import StorePath
from troupe.errors import WorkerCallError
from troupe.models.record import ModelRecord
from troupe.runtime.handle import Call, RoleGroup

log = logging.getLogger(__name__)

Part = Union[RoleGroup, tuple[RoleGroup, Callable[..., Any], Callable[..., Any]]]
"""A role a checkpoint holds: (group, save method, load method) of its role class, where
save(directory) writes the rank's file and returns its manifest entry and load(directory)
reads it back; a bare RoleGroup stands for its methods named ``save`` and ``load``."""


def _calls(parts: list[Part], what: str, directory: str) -> list[tuple[RoleGroup, Call]]:
    """Start the ``what`` ("save" or "load") method on every rank of every part."""
    started = []
    for part in parts:
        group, save, load = ((part, part.cls.save, part.cls.load) if isinstance(part, RoleGroup)
                             else part)
        started.append((group, group.invoke_async(save if what == "save" else load, directory)))
    return started


def save(parts: list[Part], root: StorePath, step: int, keep: int = 2,
         model: ModelRecord | None = None, **meta: Any) -> StorePath:
    """Checkpoint ``parts`` (see Part; all ranks write at once) as root/step-NNNNNNNN; keeps
    the newest ``keep`` complete checkpoints. ``model`` goes into the manifest as its model
    record (``restore`` checks it), ``meta`` as it is."""
    if model is not None:
        meta["model"] = model.to_json()
    directory = storage.join(root, f"step-{step:08d}")
    in_place = storage.is_url(root)
    staging = directory if in_place else storage.join(root, f".step-{step:08d}.partial")
    storage.remove(staging)  # an earlier, interrupted save of this step (or, in place, a redo)
    started = _calls(parts, "save", str(staging))
    files = [entry for _, call in started for entry in call.result()]
    ckpt.write_manifest(staging, files, step=step,
                        roles={group.name: group.world_size for group, _ in started}, **meta)
    if not in_place:
        _rename_into_place(Path(staging), Path(directory))
    for old in ckpt.steps(root)[:-keep] if keep > 0 else []:
        storage.remove(old)
    return directory


def _rename_into_place(staging: Path, directory: Path) -> None:
    if directory.exists():  # the same step saved before (a run that went back to redo it)
        replaced = directory.with_name(f".{directory.name}.old")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(directory, replaced)
        os.replace(staging, directory)
        shutil.rmtree(replaced)
    else:
        os.replace(staging, directory)


def restore(parts: list[Part], directory: StorePath, model: ModelRecord | None = None,
            expect: dict[str, Any] | None = None, reshard: Collection[str] = ()) -> int:
    """Load a checkpoint into ``parts`` (see Part; all ranks at once, since loading may
    exchange tensors between roles); returns the step. ``model``: the model the graph holds;
    a checkpoint that records another one (or a damaged record) is refused. ``expect``:
    manifest entries that must hold these values (e.g. the optimizer that wrote the state),
    else CheckpointError naming the entry. ``reshard``: roles whose ranks cut the saved
    shards again for their own number (ZeRO-3), so the checkpoint may hold another number."""
    manifest = ckpt.read_manifest(directory)
    if model is not None:
        check_model(manifest, directory, model)
    for key, want in (expect or {}).items():
        if key in manifest and manifest[key] != want:
            raise ckpt.CheckpointError(f"checkpoint {directory} was written with {key}="
                                       f"{manifest[key]!r}, this run has {key}={want!r}: give "
                                       "the run another out_dir, or start over (--no-resume)")
    saved = manifest.get("roles", {})
    for part in parts:
        role = part if isinstance(part, RoleGroup) else part[0]
        if role.name in reshard and saved.get(role.name):
            continue
        if saved.get(role.name) != role.world_size:
            raise ValueError(f"checkpoint {directory} holds {saved.get(role.name, 0)} ranks of "
                             f"role {role.name!r}; the graph has {role.world_size}")
    _check_files(parts, directory, manifest)
    try:
        for _, call in _calls(parts, "load", str(directory)):
            call.result()
    except WorkerCallError as e:  # a rank's file is damaged or does not fit: say which
        if isinstance(e.cause, ValueError):  # CheckpointError among them
            raise ckpt.CheckpointError(f"{e.cause} (role {e.role!r} rank {e.rank})") from None
        raise
    return manifest["step"]


def check_model(manifest: dict, directory: StorePath, model: ModelRecord) -> None:
    """CheckpointError unless the manifest's model record is ``model``'s architecture."""
    saved = ModelRecord.in_manifest(manifest, directory)
    if saved is None:
        return  # written before manifests carried a record: the weights' shapes are checked
    diff = saved.differences(model)
    if diff:
        raise ckpt.CheckpointError(f"checkpoint {directory} holds another model than this run "
                                   f"builds (checkpoint vs run: {', '.join(diff)})")


def _check_files(parts: list[Part], directory: StorePath, manifest: dict) -> None:
    """Every file of the checkpoint checked (size, SHA-256) by the workers, spread over them,
    before any rank loads: a rank that failed its load while its peers wait for it in a
    collective would leave them waiting until the collective's timeout."""
    groups = [part if isinstance(part, RoleGroup) else part[0] for part in parts]
    workers = [(g, r) for g in groups for r in range(g.world_size)]
    calls = []
    for i, entry in enumerate(manifest["files"]):
        group, rank = workers[i % len(workers)]
        path = str(storage.join(directory, entry["file"]))
        ref = group.actors[rank].check_file.remote(path, entry["bytes"], entry["sha256"])
        calls.append((group, rank, ref))
    for group, rank, ref in calls:
        problem = group.gather([ref], [rank], "check_file", group.call_timeout_s)[0]
        if problem is not None:
            raise ckpt.CheckpointError(f"checkpoint {directory}: {problem}")


def restore_latest(parts: list[Part], root: StorePath, model: ModelRecord | None = None,
                   expect: dict[str, Any] | None = None,
                   reshard: Collection[str] = ()) -> tuple[StorePath, int] | None:
    """Load the newest complete checkpoint under ``root`` that loads; a damaged one is
    skipped with a warning naming it and the next older one tried. Returns the directory
    loaded and its step, or None when there is none; raises the newest one's CheckpointError
    when every one is damaged."""
    first: ckpt.CheckpointError | None = None
    for directory in reversed(ckpt.steps(root)):
        try:
            return directory, restore(parts, directory, model, expect, reshard)
        except ckpt.CheckpointError as e:
            log.warning("%s; going back to the previous complete checkpoint", e)
            first = first or e
    if first is not None:
        raise first
    return None


def latest(root: StorePath) -> StorePath | None:
    """The newest complete checkpoint under ``root``, or None."""
    return ckpt.latest(root)
