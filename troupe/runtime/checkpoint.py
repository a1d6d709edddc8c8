"""Driver side of sharded checkpoints: every rank of the given roles writes its file in
parallel, the driver writes the manifest last, and only a directory with a manifest counts.

In a local directory the ranks write into a staging directory that is renamed to
root/step-NNNNNNNN once its manifest is there. A save interrupted at any point (a rank killed
mid-file, the driver lost) leaves no step-* directory with a manifest, so ``latest`` finds the
previous checkpoint; the staging directory is cleared by the next save of that step. Under an
fsspec URL (s3://..., where nothing renames atomically) the ranks write into step-NNNNNNNN in
place, and the manifest, written last, is what makes it complete."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from troupe.runtime.handle import RoleGroup
from troupe.training import checkpoint as ckpt
from troupe.training import storage
from troupe.training.storage import StorePath


def save(roles: list[RoleGroup], root: StorePath, step: int, keep: int = 2,
         method: str = "save", **meta: Any) -> StorePath:
    """Checkpoint ``roles`` (whose workers implement ``method(directory)``, returning their
    manifest entry) as root/step-NNNNNNNN; keeps the newest ``keep`` complete checkpoints."""
    directory = storage.join(root, f"step-{step:08d}")
    in_place = storage.is_url(root)
    staging = directory if in_place else storage.join(root, f".step-{step:08d}.partial")
    storage.remove(staging)  # an earlier, interrupted save of this step (or, in place, a redo)
    refs = [(role, role.call_async(method, str(staging))) for role in roles]
    files = [entry for role, r in refs for entry in role.get(r, method)]
    ckpt.write_manifest(staging, files, step=step,
                        roles={role.name: role.world_size for role in roles}, **meta)
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


def restore(roles: list[RoleGroup], directory: StorePath, method: str = "load") -> int:
    """Load a checkpoint into ``roles`` (workers implement ``method(directory)``, all called at
    once, since loading may exchange tensors between roles); returns the step."""
    manifest = ckpt.read_manifest(directory)
    saved = manifest.get("roles", {})
    for role in roles:
        if saved.get(role.name) != role.world_size:
            raise ValueError(f"checkpoint {directory} holds {saved.get(role.name, 0)} ranks of "
                             f"role {role.name!r}; the graph has {role.world_size}")
    refs = [(role, role.call_async(method, str(directory))) for role in roles]
    for role, r in refs:
        role.get(r, method)
    return manifest["step"]


def latest(root: StorePath) -> StorePath | None:
    """The newest complete checkpoint under ``root``, or None."""
    return ckpt.latest(root)
