"""ZeroQuant's quantization primitives: symmetric group-wise weight quantization to INT8 or
INT4 (two values a byte), token-wise dynamic INT8 activations, and the INT8 x INT8 -> INT32
GEMM with its rescale. Torch ops (``torch._int_mm`` for the GEMM), on CPU or GPU tensors; on a
CPU with AVX-512 VNNI, weights are held packed for native kernels that quantize the tokens,
multiply and rescale in one call (``vnni_layout``): W8A8 (csrc/int8_gemm.cpp, INT8 tokens) and
the weight-only W8A16 / W4A16 (csrc/wq_gemm.cpp, INT16 tokens against the widened weights).

Shapes: weights are (O, I) as in nn.Linear; activations (T, I) for T tokens.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from troupe.devices import cpu_info
from troupe.kernels import _native

QMAX = {8: 127, 4: 7}
_INT32_MAX = 2**31 - 1


@dataclass
class QuantizedWeight:
    """Integer weights and their fp32 scales.

    axis 0: groups of ``group_size`` output rows share a scale (scales (O / group_size,)), so
    every output channel has one scale and an INT8 GEMM can be rescaled per column;
    axis 1: groups of ``group_size`` input columns within a row (scales (O, I / group_size)),
    finer, for weight-only use. INT4 values are packed two a byte along the input dimension.
    """

    q: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    axis: int
    shape: tuple[int, int]
    colsum: torch.Tensor | None = None  # (O,) int32: sum of each row of q, with layout "vnni"
    # "rows": q is (O, I) (INT4: (O, I/2)) and scales as above; "vnni": q is
    # (ceil(O/16), I/4, 16, 4), the native W8A8 kernel's packing; "vnni16": the weight-only
    # kernel's packing (csrc/wq_gemm.cpp: q (NB, I/4, 2, 16, 2) INT8 or (NB, I/4, 16, 2)
    # nibble pairs, scales (NB, I/group_size, 16)), NB = ceil(O/16)
    layout: str = "rows"

    @property
    def nbytes(self) -> int:
        extra = 0 if self.colsum is None else self.colsum.numel() * 4
        # the bytes q spans (rows padded for the GEMM count; the rest of a larger buffer it may
        # be a view into does not: DecodeWeights puts a server's on huge pages)
        span = self.q.shape[0] * self.q.stride(0) if self.q.dim() else self.q.numel()
        return span * self.q.element_size() + self.scales.numel() * 4 + extra


def quantize_weight(w_OI: torch.Tensor, bits: int = 8, group_size: int | None = None,
                    axis: int = 0, scale_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """Symmetric quantization: scale = max|w| / qmax per group, q = round(w / scale).
    ``scale_dtype``: the scales rounded to that type first (kept as fp32 values), so that
    storing them in it loses nothing."""
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    O, I = w_OI.shape
    n = O if axis == 0 else I
    g = group_size or n
    if n % g:
        raise ValueError(f"group_size={g} does not divide the {'output' if axis == 0 else 'input'}"
                         f" dimension {n}")
    w = w_OI.float()
    grouped = w.reshape(O // g, g * I) if axis == 0 else w.reshape(O, I // g, g)
    amax = grouped.abs().amax(dim=-1)
    scales = (amax / QMAX[bits]).clamp_min(torch.finfo(scale_dtype).tiny)
    scales = scales.to(scale_dtype).float()
    q = torch.round(grouped / scales.unsqueeze(-1)).clamp_(-QMAX[bits], QMAX[bits])
    q = q.to(torch.int8).reshape(O, I)
    if bits == 4:
        q = pack_int4(q)
    return QuantizedWeight(q, scales, bits, g, axis, (O, I))


def gemm_layout(q_OI: torch.Tensor) -> torch.Tensor:
    """An INT8 (O, I) weight laid out for ``int8_gemm`` on the CPU: rows padded by 16 bytes
    when I is a multiple of 2048. The GEMM reads the weight down its columns (x @ w.T); with a
    row stride that is a multiple of 2 KiB those reads fall into a few cache sets, and at 8
    tokens a 4096 -> 1024 layer took 593 us instead of 172 us padded (benchmarks/RESULTS.md).
    The values and shape are unchanged (a view into the padded rows)."""
    O, I = q_OI.shape
    if q_OI.device.type != "cpu" or I % 2048:
        return q_OI
    rows = torch.empty(O, I + 16, dtype=q_OI.dtype, device=q_OI.device)
    rows[:, :I] = q_OI
    return rows[:, :I]


def _int8_extension():
    return _native.load_extension("int8_gemm")


def _wq_extension():
    return _native.load_extension("wq_gemm")


@functools.lru_cache(maxsize=None)
def vnni_available() -> bool:
    """Whether the native kernels run here (a CPU with AVX-512 VNNI and a compiler). Where
    the CPU's flags say it lacks the instructions, nothing is compiled to find that out."""
    flags = cpu_info()[1]
    if flags is not None and not {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return False
    ext, wq = _int8_extension(), _wq_extension()
    return ext is not None and ext.available() and wq is not None and wq.available()


def vnni_layout(qw: QuantizedWeight) -> QuantizedWeight:
    """A weight packed for its native kernel when that runs here and the weight is on the CPU
    with I a multiple of 4: INT8 per output channel (W8A8) as "vnni"; group-wise along the
    input (weight-only), with groups a multiple of 4 up to 512, as "vnni16". Otherwise the row
    layout, for ``torch._int_mm`` (``gemm_layout``) or the portable weight-only loop. The
    packed weight replaces the rows (no second copy): ``row_layout`` gives them back."""
    O, I = qw.shape
    if qw.layout != "rows":
        return qw
    native = I % 4 == 0 and qw.q.device.type == "cpu" and vnni_available()
    NB, pad = -(-O // 16), -O % 16
    if qw.axis == 1:
        if not (native and qw.group_size % 4 == 0 and qw.group_size <= 512):
            return qw
        q = F.pad(unpack_int4(qw.q, I) if qw.bits == 4 else qw.q, (0, 0, 0, pad))
        if qw.bits == 8:  # [block][quad][pair][output][2]
            packed = q.view(NB, 16, I // 4, 2, 2).permute(0, 2, 3, 1, 4).contiguous()
        else:  # [block][quad][output][2]: pair 0's nibble + 8, then pair 1's in the high half
            u = (q + 8).to(torch.uint8).view(NB, 16, I // 4, 2, 2)
            packed = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).transpose(1, 2).contiguous()
        scales = F.pad(qw.scales, (0, 0, 0, pad)).view(NB, 16, -1).transpose(1, 2).contiguous()
        return dataclasses.replace(qw, q=packed, scales=scales, layout="vnni16")
    if not (native and qw.bits == 8 and qw.group_size == 1):
        return dataclasses.replace(qw, q=gemm_layout(qw.q))
    rows = F.pad(qw.q, (0, 0, 0, pad))
    packed = rows.view(NB, 16, I // 4, 4).transpose(1, 2).contiguous()
    return dataclasses.replace(qw, q=packed, colsum=qw.q.sum(1, dtype=torch.int32),
                               layout="vnni")


def row_layout(qw: QuantizedWeight) -> QuantizedWeight:
    """The (O, I) integer weight of a packed one (the inverse of ``vnni_layout``)."""
    O, I = qw.shape
    if qw.layout == "vnni":
        rows = qw.q.transpose(1, 2).reshape(-1, I)[:O].contiguous()
        return dataclasses.replace(qw, q=rows, colsum=None, layout="rows")
    if qw.layout == "vnni16":
        if qw.bits == 8:
            rows = qw.q.permute(0, 3, 1, 2, 4).reshape(-1, I)[:O].contiguous()
        else:
            halves = torch.stack([qw.q & 15, qw.q >> 4], dim=3)  # [block][quad][output][pair][2]
            rows = pack_int4(halves.permute(0, 2, 1, 3, 4).reshape(-1, I)[:O].to(torch.int8) - 8)
        scales = qw.scales.transpose(1, 2).reshape(-1, qw.scales.shape[1])[:O].contiguous()
        return dataclasses.replace(qw, q=rows, scales=scales, layout="rows")
    return qw


def dequantize_weight(qw: QuantizedWeight) -> torch.Tensor:
    qw = row_layout(qw)
    O, I = qw.shape
    q = unpack_int4(qw.q, I) if qw.bits == 4 else qw.q
    q = q.float()
    if qw.axis == 0:
        return (q.reshape(O // qw.group_size, -1) * qw.scales[:, None]).reshape(O, I)
    return (q.reshape(O, I // qw.group_size, -1) * qw.scales[..., None]).reshape(O, I)


NATIVE_MAX_TOKENS = 16  # above this the fp32 GEMM of the dequantized weight is faster


def weight_only_linear(x_TI: torch.Tensor, qw: QuantizedWeight,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dq(W)^T + b for group-wise (axis 1) INT8/INT4 weights with 16-bit activations.
    With a ``vnni_layout`` weight ("vnni16"), the native kernel: each token to INT16 with its
    own scale (max|x_t| / 32767), exact integer products, group scales on INT32 partial sums
    (csrc/wq_gemm.cpp). Otherwise fp32 activations: for a few tokens on the CPU a portable
    native loop dequantizes one weight row at a time (csrc/quant.c); for more, or without a C
    compiler, or on a GPU, the weight is dequantized whole."""
    if qw.layout == "vnni16":  # any number of tokens: 4x fp32 at 64 and more (RESULTS.md)
        return _wq_extension().linear(_f32(x_TI), qw.q, qw.bits, qw.scales, qw.group_size,
                                      None if bias is None else _f32(bias), qw.shape[0])
    T = x_TI.shape[0]
    O, I = qw.shape
    native = (T <= NATIVE_MAX_TOKENS and qw.axis == 1 and I % 8 == 0 and qw.group_size % 2 == 0
              and x_TI.device.type == qw.q.device.type == "cpu" and qw.q.is_contiguous()
              and qw.scales.dtype == torch.float32 and qw.scales.is_contiguous())
    lib = _quant_lib() if native else None
    if lib is None:  # in the activations' type (a bf16 model's tokens stay bf16)
        return F.linear(x_TI, dequantize_weight(qw).to(x_TI.dtype),
                        None if bias is None else bias.to(x_TI.dtype))
    x = x_TI.float().contiguous()
    y = torch.empty(T, O, dtype=torch.float32, device=x.device)
    b = None if bias is None else bias.detach().float().contiguous()
    rc = lib.wq_linear(x.data_ptr(), T, I, qw.q.data_ptr(), qw.bits, qw.scales.data_ptr(),
                       qw.group_size, O, None if b is None else b.data_ptr(), y.data_ptr())
    if rc != 0:
        raise MemoryError(f"weight_only_linear: no memory for a row of {I} floats")
    return y


def _quant_lib():
    lib = _native.load("quant")
    if lib is not None and not getattr(lib, "_typed", False):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.wq_linear.argtypes = [p, i64, i64, p, ctypes.c_int, p, i64, i64, p, p]
        lib.wq_linear.restype = ctypes.c_int
        lib._typed = True
    return lib


def channel_scales(qw: QuantizedWeight) -> torch.Tensor:
    """One scale per output channel (axis-0 quantization only): (O,)."""
    if qw.axis != 0:
        raise ValueError("per-channel scales need axis-0 (output-row) groups")
    return qw.scales.repeat_interleave(qw.group_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], (..., I) with I even -> uint8 (..., I/2), low nibble first."""
    if q.shape[-1] % 2:
        raise ValueError(f"INT4 packing needs an even input dimension, got {q.shape[-1]}")
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_int4: int8 (..., n)."""
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    out = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], -1)[..., :n]
    return torch.where(out > 7, out - 16, out)


def quantize_tokens(x_TI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-wise dynamic INT8: each row gets scale max|x_t| / 127. Returns (q (T, I), s (T,))."""
    scales = (x_TI.float().abs().amax(dim=-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(x_TI.float() / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def int8_gemm(xq_TI: torch.Tensor, wq_OI: torch.Tensor) -> torch.Tensor:
    """Exact INT8 x INT8 -> INT32 product x @ w.T: (T, O). Raises when the inner dimension
    could overflow int32 (I * 127 * 127 > 2^31 - 1)."""
    T, I = xq_TI.shape
    if I * 127 * 127 > _INT32_MAX:
        raise ValueError(f"inner dimension {I} can overflow int32 accumulation")
    if xq_TI.device.type == "cpu":
        # (on CPUs with AVX-512 VNNI the native kernel runs instead: csrc/int8_gemm.cpp.)
        # Elsewhere torch._int_mm's CPU path took 24x an fp32 GEMM (an AMD EPYC with AVX2:
        # 0.41 s against 0.017 s for 1024 x 576 x 1536); a float GEMM of the integers is exact
        # while every partial sum is an integer the type holds: |sum| <= I * 128^2 < 2^24 in
        # fp32, < 2^53 in fp64.
        dtype = torch.float32 if I * 128 * 128 < 1 << 24 else torch.float64
        with torch.autocast("cpu", enabled=False):  # bf16 autocast would round the product
            return (xq_TI.to(dtype) @ wq_OI.to(dtype).t()).to(torch.int32)
    # w.t() is a view: the GEMM reads the row-major (O, I) weight as a column-major (I, O)
    # matrix; copying it to row-major on every call cost 4-9x the GEMM itself (RESULTS.md)
    if T > 16:
        return torch._int_mm(xq_TI.contiguous(), wq_OI.t())
    # torch._int_mm needs more than 16 rows on CUDA: pad
    pad = torch.zeros(17 - T, I, dtype=torch.int8, device=xq_TI.device)
    return torch._int_mm(torch.cat([xq_TI, pad]), wq_OI.t())[:T]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def int8_linear(x_TI: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                outliers: tuple[torch.Tensor, torch.Tensor] | None = None):
    """W8A8: quantize the tokens, INT8 GEMM, rescale by s_x[:, None] * s_w[None, :]. With a
    ``vnni_layout`` weight, all three in the native kernel (the same numbers, bit for bit).
    ``outliers``: (channels (k,) int64, rows (k, O) fp32): those input channels stay fp32 and
    add x[:, channels] @ rows; the INT8 part sees zeros there (the weight should too); in the
    native kernel's epilogue, else beside the INT8 product."""
    if qw.bits != 8 or qw.axis != 0:
        raise ValueError("int8_linear needs INT8 weights with per-output-channel groups")
    if qw.layout == "vnni":  # (a call costs ~10 us at decoding sizes: no needless copies)
        channels, rows = outliers if outliers is not None else (None, None)
        return _int8_extension().linear(_f32(x_TI), qw.q, qw.colsum, _f32(qw.scales),
                                        None if bias is None else _f32(bias), qw.shape[0],
                                        channels, None if rows is None else _f32(rows))
    if outliers is not None:
        channels, rows = outliers
        rest = x_TI.clone()
        rest[:, channels] = 0
        return int8_linear(rest, qw, bias) + x_TI[:, channels].float() @ rows
    xq, xs = quantize_tokens(x_TI)
    y = int8_gemm(xq, qw.q).float() * xs[:, None] * channel_scales(qw)[None, :]
    return y + bias if bias is not None else y


def group_divisor(n: int, want: int) -> int:
    """The largest divisor of ``n`` not above ``want``: a group size that tiles n values."""
    for g in range(min(want, n), 0, -1):
        if n % g == 0:
            return g
    return 1
