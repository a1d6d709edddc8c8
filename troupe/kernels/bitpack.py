"""Sign bit-packing for 1-bit compression.

``pack_signs`` stores one bit per element, most significant bit first within each byte; a set bit
means +1 and a clear bit -1, and sign(0) counts as +1 (so does -0.0; NaN counts as -1). The last
byte is zero-padded. CPU tensors go through numpy's packbits, CUDA tensors through a cupy
RawKernel when cupy is installed, and through plain torch ops otherwise.
"""

from __future__ import annotations

import numpy as np
import torch

from troupe.kernels._cupy import as_cupy, cupy_or_none, launch_config

_PACK_SRC = r"""
extern "C" __global__ void pack_signs(const float* x, unsigned char* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // one output byte
    long long base = i * 8;
    if (base >= n) return;
    unsigned char byte = 0;
    for (int b = 0; b < 8; ++b) {
        long long j = base + b;
        if (j < n && x[j] >= 0.0f) byte |= (unsigned char)(0x80 >> b);
    }
    out[i] = byte;
}
extern "C" __global__ void unpack_signs(const unsigned char* packed, float* out, long long n) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // one element
    if (j >= n) return;
    out[j] = (packed[j >> 3] & (0x80 >> (j & 7))) ? 1.0f : -1.0f;
}
"""
_kernels: dict[str, object] = {}


def _kernel(name: str):
    if name not in _kernels:
        cupy = cupy_or_none()
        _kernels[name] = cupy.RawModule(code=_PACK_SRC).get_function(name)
    return _kernels[name]


def packed_size(numel: int) -> int:
    """Bytes needed to pack ``numel`` signs."""
    return (numel + 7) // 8


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack the signs of ``x`` (any shape, any float dtype) into a uint8 tensor of ceil(n/8)."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if not flat.is_cuda:
        bits = (flat >= 0).numpy()
        return torch.from_numpy(np.packbits(bits))
    if cupy_or_none() is None:
        return _pack_torch(flat)
    flat = flat.float().contiguous()
    out = torch.empty(packed_size(n), dtype=torch.uint8, device=flat.device)
    if n:
        grid, block = launch_config(out.numel())
        with _stream(flat):
            _kernel("pack_signs")(grid, block, (as_cupy(flat), as_cupy(out), np.int64(n)))
    return out


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The +1/-1 tensor of ``numel`` elements whose signs ``packed`` holds."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.numel() < packed_size(numel):
        raise ValueError(f"packed holds {packed.numel() * 8} signs, fewer than numel={numel}")
    if not packed.is_cuda:
        bits = np.unpackbits(packed.numpy(), count=numel)
        out = torch.from_numpy(bits).to(dtype)
        return out.mul_(2).sub_(1)
    if cupy_or_none() is None:
        return _unpack_torch(packed, numel).to(dtype)
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    if numel:
        grid, block = launch_config(numel)
        with _stream(packed):
            _kernel("unpack_signs")(grid, block, (as_cupy(packed.contiguous()), as_cupy(out),
                                                  np.int64(numel)))
    return out.to(dtype)


_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


def _pack_torch(flat: torch.Tensor) -> torch.Tensor:
    """Device-generic fallback of pack_signs with plain torch ops."""
    n = flat.numel()
    bits = torch.zeros(packed_size(n) * 8, dtype=torch.uint8, device=flat.device)
    bits[:n] = flat >= 0
    shifts = _SHIFTS.to(flat.device)
    return (bits.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack_torch(packed: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = _SHIFTS.to(packed.device)
    bits = (packed.view(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:numel].float().mul_(2).sub_(1)


class _stream:
    """Run cupy kernels on the torch tensor's current CUDA stream."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __enter__(self):
        cupy = cupy_or_none()
        stream = torch.cuda.current_stream(self.t.device)
        self.ctx = cupy.cuda.ExternalStream(stream.cuda_stream)
        self.ctx.__enter__()

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
