"""The element-wise steps of 1-bit compression with error feedback, each in place.

    scale = accumulate_(e, x)           e[:n] += x; scale = ||e|| / sqrt(N)
    packed = pack_update_(e, scale)      packed signs of e; e -= scale * sign(e)
    unpack_(packed, out, scale, acc)     out (+)= scale * sign

On CPU, float32 buffers go through fused C loops (csrc/onebit.c, one pass each) when a C
compiler is present; otherwise, and on CUDA, through torch ops (with the cupy bit-packing
kernels of ``bitpack``). Both paths give the same packed bytes and errors; sign(0) = +1. The
scale is the one reduction: both sum the squares in double, where a float's square is exact,
so the float scale they round it to is the same (NCCL and gloo runs agree bit for bit).
"""

from __future__ import annotations

import ctypes
import math

import torch

from troupe.kernels import _native
from troupe.kernels.bitpack import pack_signs, unpack_signs


def _lib(*tensors: torch.Tensor):
    if any(t.is_cuda or not t.is_contiguous() for t in tensors):
        return None
    if any(t.dtype not in (torch.float32, torch.uint8) for t in tensors):
        return None
    lib = _native.load("onebit")
    if lib is not None and not getattr(lib, "_typed", False):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.onebit_accumulate.argtypes = [p, p, i64, i64]
        lib.onebit_accumulate.restype = ctypes.c_double
        lib.onebit_pack_update.argtypes = [p, p, i64, ctypes.c_float]
        lib.onebit_unpack.argtypes = [p, p, i64, ctypes.c_float, ctypes.c_int]
        lib._typed = True
    return lib


def accumulate_(e_N: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
    """Add ``x`` (any shape, numel n <= N) into e[:n] and return ||e|| / sqrt(N) as a (1,)
    float32 tensor."""
    N = e_N.numel()
    if N == 0:
        return torch.zeros(1, device=e_N.device)
    if x is not None:
        x = x.detach().reshape(-1)
        if x.dtype != torch.float32:
            x = x.float()
    lib = _lib(e_N) if x is None or _lib(x) is not None else None
    if lib is not None:
        n = 0 if x is None else x.numel()
        sumsq = lib.onebit_accumulate(e_N.data_ptr(), 0 if x is None else x.data_ptr(), n, N)
        return torch.tensor([math.sqrt(sumsq) / math.sqrt(N)], dtype=torch.float32,
                            device=e_N.device)
    if x is not None:
        e_N[: x.numel()] += x
    norm = torch.linalg.vector_norm(e_N, dtype=torch.float64)  # as the C loop: exact squares
    return (norm / math.sqrt(N)).reshape(1).float()


def pack_update_(e_N: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Pack the signs of e (N divisible by 8) and subtract scale * sign(e) from e in place."""
    N = e_N.numel()
    if N % 8:
        raise ValueError(f"pack_update_ needs a multiple of 8 elements, got {N}")
    lib = _lib(e_N)
    if lib is not None:
        packed = torch.empty(N // 8, dtype=torch.uint8, device=e_N.device)
        lib.onebit_pack_update(e_N.data_ptr(), packed.data_ptr(), N, float(scale))
        return packed
    packed = pack_signs(e_N)
    e_N.sub_(torch.where(e_N >= 0, scale.to(e_N.device), -scale.to(e_N.device)))
    return packed


def unpack_(packed: torch.Tensor, out_n: torch.Tensor, scale: torch.Tensor | float,
            accumulate: bool = False) -> torch.Tensor:
    """out (+)= scale * sign for the out.numel() signs in ``packed``; returns out."""
    n = out_n.numel()
    packed = packed.contiguous()
    lib = _lib(packed, out_n)
    if lib is not None:
        lib.onebit_unpack(packed.data_ptr(), out_n.data_ptr(), n, float(scale), int(accumulate))
        return out_n
    if accumulate:
        return out_n.add_(unpack_signs(packed, n, scale=scale))
    return unpack_signs(packed, n, scale=scale, out=out_n)
