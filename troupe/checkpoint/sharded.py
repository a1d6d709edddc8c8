"""Sharded checkpoints: one wire-format file per rank plus a JSON manifest with each file's
size and SHA-256. A checkpoint directory is complete only once its manifest exists; the
manifest is written last, by the driver, after every rank has written its file. Directories
are local paths or fsspec URLs (see troupe.checkpoint.storage)."""

from __future__ import annotations

import hashlib
import json
from typing import IO, Any

from troupe import wire
from troupe.checkpoint import storage
from troupe.checkpoint.storage import StorePath

MANIFEST = "manifest.json"
FORMAT = "troupe-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: damaged, incomplete, from another layout or
    lying about what it holds. The message names the directory or file."""


def rank_file(directory: StorePath, rank: int, prefix: str = "rank") -> StorePath:
    return storage.join(directory, f"{prefix}-{rank:05d}.trp")


def write_rank(directory: StorePath, rank: int, state: dict[str, Any],
               prefix: str = "rank") -> dict[str, Any]:
    """Write one rank's state; returns {"file", "bytes", "sha256"} for the manifest, counted
    and hashed as the bytes go out (no second read of the file; ``read_rank`` checks both)."""
    path = rank_file(directory, rank, prefix)
    digest = _Digest()
    storage.write_file(path, lambda f: wire.dump(state, digest.wrap(f)))
    return {"file": storage.name(path), "bytes": digest.bytes, "sha256": digest.sha.hexdigest()}


def read_rank(directory: StorePath, rank: int, manifest: dict[str, Any],
              prefix: str = "rank") -> dict[str, Any]:
    """Read one rank's state, checked against the manifest's size and hash."""
    path = rank_file(directory, rank, prefix)
    file = storage.name(path)
    entry = next((e for e in manifest["files"] if e["file"] == file), None)
    if entry is None:
        raise CheckpointError(f"checkpoint {directory}: manifest lists no file for rank {rank} "
                         f"(it was written by {len(manifest['files'])} ranks)")
    if not storage.is_file(path):
        raise FileNotFoundError(f"checkpoint {directory}: {file} is missing")
    problem = check_file(path, entry["bytes"], entry["sha256"])
    if problem is not None:
        raise CheckpointError(f"checkpoint {directory}: {problem}")
    with storage.open_read(path) as f:
        try:
            return wire.load(f)
        except wire.WireFormatError as e:
            raise CheckpointError(f"checkpoint {path}: {e}") from None


def check_file(path: StorePath, nbytes: int, sha256: str) -> str | None:
    """None when the file at ``path`` has ``nbytes`` bytes and this SHA-256, else what is
    wrong with it (naming the file)."""
    file = storage.name(path)
    if not storage.is_file(path):
        return f"{file} is missing"
    if storage.size(path) != nbytes or _sha256(path) != sha256:
        return (f"{file} does not match its manifest (size or SHA-256 differs): the file is "
                "damaged or from another save")
    return None


def write_manifest(directory: StorePath, files: list[dict[str, Any]], **meta: Any) -> StorePath:
    path = storage.join(directory, MANIFEST)
    text = json.dumps({"format": FORMAT, **meta, "files": files}, indent=1).encode()
    storage.write_file(path, lambda f: f.write(text))
    return path


def read_manifest(directory: StorePath) -> dict[str, Any]:
    path = storage.join(directory, MANIFEST)
    if not storage.is_file(path):
        raise FileNotFoundError(f"checkpoint {directory} has no {MANIFEST}: not a complete "
                                "checkpoint (a save interrupted before the manifest?)")
    with storage.open_read(path) as f:
        text = f.read()
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: format {got!r}, expected {FORMAT!r}")
    files = manifest.get("files")
    if not (isinstance(files, list) and all(
            isinstance(e, dict) and isinstance(e.get("file"), str) and
            isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
            for e in files)):
        raise CheckpointError(f"{path}: 'files' must list {{file, bytes, sha256}} entries")
    if not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("roles", {}),
                                                                    dict):
        raise CheckpointError(f"{path}: 'step' must be an int and 'roles' a mapping")
    for role, ranks in manifest.get("roles", {}).items():
        if type(ranks) is not int or ranks < 1:
            raise CheckpointError(f"{path}: roles.{role} must be a positive number of ranks, "
                                  f"got {ranks!r}")
    return manifest


def steps(root: StorePath) -> list[StorePath]:
    """The complete checkpoints (``step-N`` directories with a manifest) under ``root``,
    oldest first."""
    done = [storage.join(root, n) for n in storage.children(root)
            if n.startswith("step-") and n[5:].isdigit()]
    done = [d for d in done if storage.is_file(storage.join(d, MANIFEST))]
    return sorted(done, key=lambda d: int(storage.name(d)[5:]))


def latest(root: StorePath) -> StorePath | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    done = steps(root)
    return done[-1] if done else None


class _Digest:
    """Counts and hashes the bytes written through the file ``wrap`` returns."""

    def __init__(self):
        self.sha, self.bytes = hashlib.sha256(), 0

    def wrap(self, f: IO[bytes]) -> "_Digest":
        self.f = f
        return self

    def write(self, data) -> int:
        self.sha.update(data)
        self.f.write(data)
        self.bytes += memoryview(data).nbytes
        return memoryview(data).nbytes


def _sha256(path: StorePath) -> str:
    h = hashlib.sha256()
    with storage.open_read(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
