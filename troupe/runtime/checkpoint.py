"""Driver side of sharded checkpoints: every rank of a role writes its file in parallel, then
the driver writes the manifest that makes the checkpoint complete."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from troupe.runtime.handle import RoleGroup
from troupe.training import checkpoint as ckpt


def save(role: RoleGroup, root: str | Path, step: int, keep: int = 2, **meta: Any) -> Path:
    """Checkpoint ``role`` (whose workers implement ``save(directory)``) as root/step-NNNNNNNN;
    keeps the newest ``keep`` complete checkpoints."""
    directory = Path(root) / f"step-{step:08d}"
    if directory.exists():
        shutil.rmtree(directory)
    files = role.call("save", str(directory))
    ckpt.write_manifest(directory, files, step=step, world_size=role.world_size, **meta)
    done = sorted((d for d in Path(root).glob("step-*") if (d / ckpt.MANIFEST).is_file()),
                  key=lambda d: int(d.name.split("-")[1]))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return directory


def restore(role: RoleGroup, directory: str | Path) -> int:
    """Load a checkpoint into ``role`` (workers implement ``load(directory)``); returns the step."""
    manifest = ckpt.read_manifest(directory)
    if manifest["world_size"] != role.world_size:
        raise ValueError(f"checkpoint {directory} was written by {manifest['world_size']} ranks; "
                         f"role {role.name!r} has {role.world_size}")
    steps = set(role.call("load", str(directory)))
    if steps != {manifest["step"]}:
        raise ValueError(f"checkpoint {directory}: ranks restored steps {sorted(steps)}, "
                         f"manifest says {manifest['step']}")
    return manifest["step"]


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    return ckpt.latest(root) if Path(root).is_dir() else None
