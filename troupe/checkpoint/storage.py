"""Where checkpoints live: a local directory (on a cluster, one that every node reaches, such as
a shared file system), or an fsspec URL such as ``s3://bucket/run`` (fsspec and the filesystem's
package, e.g. s3fs or gcsfs, installed on every node). A path with "://" is a URL.

Local files are written whole or not at all (a temporary name, fsync, rename); on an object store
an object appears only once its upload completes. Directories there are prefixes: nothing needs
creating, and they cannot be renamed atomically (runtime.checkpoint writes in place there and
relies on the manifest, written last, to mark a checkpoint complete)."""

from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path
from typing import IO, Any, Callable

StorePath = str | Path


def is_url(path: StorePath) -> bool:
    return "://" in str(path)


def join(path: StorePath, *names: str) -> StorePath:
    """``path / name / ...``: a Path for a local path, a string for a URL."""
    if is_url(path):
        return "/".join([str(path).rstrip("/"), *names])
    return Path(path).joinpath(*names)


def name(path: StorePath) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def write_file(path: StorePath, write: Callable[[IO[bytes]], Any]) -> None:
    """Create ``path`` with ``write(file)``, whole or not at all."""
    if is_url(path):
        fs, inner = _fs(path)
        fs.makedirs(posixpath.dirname(inner), exist_ok=True)  # a file system under the URL
        with fs.open(inner, "wb") as f:
            write(f)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_read(path: StorePath) -> IO[bytes]:
    if is_url(path):
        fs, inner = _fs(path)
        return fs.open(inner, "rb")
    return open(path, "rb")


def is_file(path: StorePath) -> bool:
    if is_url(path):
        fs, inner = _fs(path)
        return fs.isfile(inner)
    return Path(path).is_file()


def size(path: StorePath) -> int:
    if is_url(path):
        fs, inner = _fs(path)
        return fs.size(inner)
    return Path(path).stat().st_size


def children(path: StorePath) -> list[str]:
    """Names of the entries directly under ``path`` (none if it does not exist)."""
    if is_url(path):
        fs, inner = _fs(path)
        if not fs.exists(inner):
            return []
        return [name(p) for p in fs.ls(inner, detail=False)]
    return [p.name for p in Path(path).iterdir()] if Path(path).is_dir() else []


def remove(path: StorePath) -> None:
    """Delete a directory (prefix) and everything below it; nothing if it is not there."""
    if is_url(path):
        fs, inner = _fs(path)
        if fs.exists(inner):
            fs.rm(inner, recursive=True)
        return
    shutil.rmtree(path, ignore_errors=True)


class StorageError(RuntimeError):
    """A URL whose filesystem cannot be reached from here (fsspec or its package missing)."""


def _fs(url: StorePath):
    try:
        import fsspec
    except ImportError:
        raise StorageError(f"{url}: checkpoint URLs need fsspec (pip install fsspec, plus the "
                           "filesystem's package, e.g. s3fs for s3://)") from None
    try:
        return fsspec.core.url_to_fs(str(url))
    except (ImportError, ValueError) as e:
        raise StorageError(f"{url}: {e}") from None
