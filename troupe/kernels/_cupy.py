"""Optional cupy: imported lazily so CPU-only installs never need it."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def cupy_or_none():
    """The cupy module when it imports and a CUDA device is present, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def as_cupy(t: torch.Tensor):
    """A cupy view of a CUDA tensor (DLPack, no copy)."""
    cupy = cupy_or_none()
    assert cupy is not None and t.is_cuda
    return cupy.from_dlpack(t.detach())


def launch_config(n: int, threads: int = 256) -> tuple[tuple[int], tuple[int]]:
    return ((n + threads - 1) // threads,), (threads,)
