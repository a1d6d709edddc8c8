"""Driver side of sharded checkpoints: every rank of the given roles writes its file in
parallel into a staging directory, the driver writes the manifest there, and only then is the
directory renamed to root/step-NNNNNNNN. A save interrupted at any point (a rank killed mid-file,
the driver lost) leaves no step-* directory with a manifest, so ``latest`` finds the previous
checkpoint; the staging directory is cleared by the next save of that step."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from troupe.runtime.handle import RoleGroup
from troupe.training import checkpoint as ckpt


def save(roles: list[RoleGroup], root: str | Path, step: int, keep: int = 2,
         method: str = "save", **meta: Any) -> Path:
    """Checkpoint ``roles`` (whose workers implement ``method(directory)``, returning their
    manifest entry) as root/step-NNNNNNNN; keeps the newest ``keep`` complete checkpoints."""
    directory = Path(root) / f"step-{step:08d}"
    staging = Path(root) / f".step-{step:08d}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    refs = [(role, role.call_async(method, str(staging))) for role in roles]
    files = [entry for role, r in refs for entry in role.get(r, method)]
    ckpt.write_manifest(staging, files, step=step,
                        roles={role.name: role.world_size for role in roles}, **meta)
    if directory.exists():  # the same step saved before (a run that went back to redo it)
        replaced = directory.with_name(f".{directory.name}.old")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(directory, replaced)
        os.replace(staging, directory)
        shutil.rmtree(replaced)
    else:
        os.replace(staging, directory)
    done = sorted((d for d in Path(root).glob("step-*") if (d / ckpt.MANIFEST).is_file()),
                  key=lambda d: int(d.name.split("-")[1]))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return directory


def restore(roles: list[RoleGroup], directory: str | Path, method: str = "load") -> int:
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


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    return ckpt.latest(root) if Path(root).is_dir() else None
