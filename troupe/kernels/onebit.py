"""The element-wise steps of 1-bit compression with error feedback, each in place.

    scale = accumulate_(e, x)           e[:n] += x; scale = ||e|| / sqrt(N)
    packed = pack_update_(e, scale)      packed signs of e; e -= scale * sign(e)
    unpack_(packed, out, scale, acc)     out (+)= scale * sign

and two steps of the 1-bit optimizers that read a packed momentum without unpacking it:

    momentum_(e, packed, x, coef, c)     e += (sign * coef) + x * c
    adam_apply_(p, v, packed, step, ...)  p = p * decay - (sign * step) / (sqrt(v * inv_bc2) + eps)

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
        f32 = ctypes.c_float
        lib.onebit_momentum.argtypes = [p, p, p, i64, f32, f32]
        lib.onebit_adam_apply.argtypes = [p, p, p, i64, f32, f32, f32, f32]
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


def momentum_(e_n: torch.Tensor, packed: torch.Tensor, x_n: torch.Tensor, coef: float,
              c: float) -> torch.Tensor:
    """e += (sign * coef) + x * c over the n elements of e and x, the signs the first n of
    ``packed``: a momentum step b1 * m + (1 - b1) * g folded into the error buffer that it is
    compressed from, the last momentum m = sign * coef / b1 read packed. Returns e."""
    packed = packed.contiguous()
    lib = _lib(e_n, packed, x_n)
    if lib is not None:
        lib.onebit_momentum(e_n.data_ptr(), packed.data_ptr(), x_n.data_ptr(), e_n.numel(),
                            coef, c)
        return e_n
    step = unpack_signs(packed, e_n.numel(), scale=coef)
    return e_n.add_(step.add_(x_n * c))


def adam_apply_(p_n: torch.Tensor, v_n: torch.Tensor, packed: torch.Tensor, step: float,
                decay: float, inv_bc2: float, eps: float) -> torch.Tensor:
    """p = p * decay - (sign * step) / (sqrt(v * inv_bc2) + eps) over the n elements of p and
    v, the signs the first n of ``packed``: Adam's update (step = lr / bc1 times the
    momentum's scale, decay = 1 - lr * weight_decay) from a packed momentum. Returns p."""
    packed = packed.contiguous()
    lib = _lib(p_n, v_n, packed)
    if lib is not None:
        lib.onebit_adam_apply(p_n.data_ptr(), v_n.data_ptr(), packed.data_ptr(), p_n.numel(),
                              step, decay, inv_bc2, eps)
        return p_n
    update = unpack_signs(packed, p_n.numel(), scale=step)
    # torch's float32 sqrt is not correctly rounded on every CPU (its vector path); the
    # double's, rounded to float, is: the C loop's sqrtf
    update.div_((v_n * inv_bc2).double().sqrt_().float().add_(eps))
    return p_n.mul_(decay).sub_(update)
