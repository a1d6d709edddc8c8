"""Sharded checkpoints: one wire-format file per rank plus a JSON manifest with each file's
size and SHA-256. A checkpoint directory is complete only once its manifest exists; the
manifest is written last, by the driver, after every rank has written its file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from troupe import wire

MANIFEST = "manifest.json"
FORMAT = "troupe-checkpoint/1"


def rank_file(directory: str | Path, rank: int, prefix: str = "rank") -> Path:
    return Path(directory) / f"{prefix}-{rank:05d}.trp"


def write_rank(directory: str | Path, rank: int, state: dict[str, Any],
               prefix: str = "rank") -> dict[str, Any]:
    """Write one rank's state; returns {"file", "bytes", "sha256"} for the manifest."""
    path = rank_file(directory, rank, prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        wire.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}


def read_rank(directory: str | Path, rank: int, manifest: dict[str, Any],
              prefix: str = "rank") -> dict[str, Any]:
    """Read one rank's state, checked against the manifest's size and hash."""
    path = rank_file(directory, rank, prefix)
    entry = next((e for e in manifest["files"] if e["file"] == path.name), None)
    if entry is None:
        raise ValueError(f"checkpoint {directory}: manifest lists no file for rank {rank} "
                         f"(it was written by {len(manifest['files'])} ranks)")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {directory}: {path.name} is missing")
    if path.stat().st_size != entry["bytes"] or _sha256(path) != entry["sha256"]:
        raise ValueError(f"checkpoint {directory}: {path.name} does not match its manifest "
                         "(size or SHA-256 differs): the file is damaged or from another save")
    with open(path, "rb") as f:
        try:
            return wire.load(f)
        except wire.WireFormatError as e:
            raise ValueError(f"checkpoint {path}: {e}") from None


def write_manifest(directory: str | Path, files: list[dict[str, Any]], **meta: Any) -> Path:
    path = Path(directory) / MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **meta, "files": files}, indent=1))
    os.replace(tmp, path)
    return path


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {directory} has no {MANIFEST}: not a complete "
                                "checkpoint (a save interrupted before the manifest?)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def latest(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (``step-*`` directories)."""
    done = [d for d in Path(root).glob("step-*") if (d / MANIFEST).is_file()]
    return max(done, key=lambda d: int(d.name.split("-")[1]), default=None)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
