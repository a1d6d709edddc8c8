"""Sign bit-packing for 1-bit compression.

``pack_signs`` stores one bit per element, most significant bit first within each byte; a set bit
means +1 and a clear bit -1, and sign(0) counts as +1 (so does -0.0; NaN counts as -1). The last
byte is zero-padded. On CPU, packing goes through numpy's packbits and unpacking through one
gather from a 256 x 8 table of signs (pre-multiplied by a scale, so a 1-bit tensor is decoded
straight into its scaled floats). CUDA tensors use cupy RawKernels when cupy is installed and
plain torch ops otherwise.
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
extern "C" __global__ void unpack_signs(const unsigned char* packed, float* out, long long n,
                                        const float* scale) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // one element
    if (j >= n) return;
    out[j] = (packed[j >> 3] & (0x80 >> (j & 7))) ? *scale : -*scale;
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


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32,
                 scale: float | torch.Tensor = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor of ``numel`` elements equal to +scale or -scale as ``packed`` says.

    ``out``, if given, is a float32 tensor of ``numel`` elements written in place.
    """
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.numel() < packed_size(numel):
        raise ValueError(f"packed holds {packed.numel() * 8} signs, fewer than numel={numel}")
    if out is not None and (out.numel() != numel or out.dtype != torch.float32):
        raise ValueError(f"out must be float32 with {numel} elements")
    if packed.is_cuda and cupy_or_none() is not None:
        res = out if out is not None else torch.empty(numel, device=packed.device)
        if numel:
            # the scale is read on the device: a CUDA tensor (1-bit Adam's) needs no host sync
            s = torch.as_tensor(scale, dtype=torch.float32, device=packed.device).reshape(1)
            grid, block = launch_config(numel)
            with _stream(packed):
                _kernel("unpack_signs")(grid, block, (as_cupy(packed.contiguous()), as_cupy(res),
                                                      np.int64(numel), as_cupy(s)))
        return res if dtype == torch.float32 else res.to(dtype)
    # One gather from a 256 x 8 table of +-scale: a single pass that writes the floats.
    table = _table(packed.device) * scale
    nbytes = packed_size(numel)
    idx = packed[:nbytes].long()
    if out is not None and numel % 8 == 0:
        torch.index_select(table, 0, idx, out=out.view(nbytes, 8))
        return out
    res = torch.index_select(table, 0, idx).view(-1)[:numel]
    if out is not None:
        return out.copy_(res)
    return res if dtype == torch.float32 else res.to(dtype)


_tables: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    """Row b holds the 8 signs (+1/-1) of byte b, most significant bit first."""
    if device not in _tables:
        bits = (torch.arange(256, device=device).view(-1, 1)
                >> torch.arange(7, -1, -1, device=device)) & 1
        _tables[device] = (bits.float() * 2 - 1).to(device)
    return _tables[device]


_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)  # host: a constant, moved where used


def _pack_torch(flat: torch.Tensor) -> torch.Tensor:
    """Device-generic fallback of pack_signs with plain torch ops."""
    n = flat.numel()
    bits = torch.zeros(packed_size(n) * 8, dtype=torch.uint8, device=flat.device)
    bits[:n] = flat >= 0
    shifts = _SHIFTS.to(flat.device)
    return (bits.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


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
