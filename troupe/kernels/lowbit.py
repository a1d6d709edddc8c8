"""Packed storage for weights of one and two levels' worth of bits, and the torch reference of
their product (XTC's binary and BitNet b1.58's ternary weights; troupe.compression.lowbit
makes them).

Ternary weights {-1, 0, +1} go five to a byte (3^5 = 243 <= 256: 1.6 bits a weight, as
llama.cpp's TQ1_0 stores them). The five trits t_0..t_4 (each + 1, so in {0, 1, 2}) are read
as a base-3 number v = sum_i d_i 3^(4-i) < 243 and stored as ceil(v * 256 / 243): then trit i
comes back as ``((byte * 3^i) mod 256) * 3 >> 8``, a multiply, a wrap and a shift, with no
division, which is what a SIMD kernel wants. Binary weights {-1, +1} go eight to a byte, as
troupe.kernels.bitpack packs the 1-bit optimizers' signs (bit set: +1, most significant first).

Rows are packed along the input dimension; a row of n weights takes ceil(n / 5) (ternary) or
ceil(n / 8) (binary) bytes, the padding decoding to 0 (ternary) or +1 (binary), ignored.

``lowbit_linear`` multiplies without unpacking on CPUs with AVX-512 VNNI (csrc/lowbit_gemm.cpp:
the planes of five trits or eight bits decoded 64 bytes at a time in registers, the rows held
in blocks of 16, ``native_layout``) and equals ``lowbit_linear_reference`` bit for bit;
elsewhere (other CPUs, CUDA) it unpacks the weight for the call and multiplies the integers
exactly in floating point."""

from __future__ import annotations

import dataclasses
import functools

import torch

from troupe.devices import cpu_info
from troupe.kernels import _native, bitpack
from troupe.kernels.quant import quantize_tokens

TRITS_PER_BYTE, BITS_PER_BYTE = 5, 8
_POW3 = torch.tensor([81, 27, 9, 3, 1], dtype=torch.int32)  # 3^(4-i)  # host: moved where used
_SHIFT3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)  # 3^i  # host: moved where used


def row_bytes(n: int, kind: str) -> int:
    """Bytes a packed row of ``n`` weights takes: ceil(n / 5) ternary, ceil(n / 8) binary."""
    return -(-n // (TRITS_PER_BYTE if kind == "ternary" else BITS_PER_BYTE))


def pack_trits(q: torch.Tensor) -> torch.Tensor:
    """(..., n) int8 in {-1, 0, 1} -> (..., ceil(n / 5)) uint8."""
    if q.numel() and (q.min() < -1 or q.max() > 1):
        raise ValueError("pack_trits takes values in {-1, 0, 1}")
    n = q.shape[-1]
    pad = -n % TRITS_PER_BYTE
    d = torch.nn.functional.pad(q.to(torch.int32) + 1, (0, pad), value=1)  # padding: trit 0
    d = d.reshape(*q.shape[:-1], -1, TRITS_PER_BYTE)
    v = (d * _POW3.to(d.device)).sum(-1)
    return ((v * 256 + 242) // 243).to(torch.uint8)  # ceil(v * 256 / 243)


def unpack_trits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """(..., m) uint8 -> (..., n) int8 in {-1, 0, 1}, n <= 5 m."""
    b = packed.to(torch.int32)[..., None] * _SHIFT3.to(packed.device)  # byte * 3^i
    d = ((b & 0xFF) * 3) >> 8
    return (d - 1).to(torch.int8).reshape(*packed.shape[:-1], -1)[..., :n]


def pack_sign_rows(q: torch.Tensor) -> torch.Tensor:
    """(O, n) int8 in {-1, 1} -> (O, ceil(n / 8)) uint8: each row through troupe.kernels.bitpack
    (most significant bit first, set bit +1), padded to whole bytes."""
    if q.numel() and not torch.all((q == 1) | (q == -1)):
        raise ValueError("pack_sign_rows takes values in {-1, 1}")
    O, n = q.shape
    rows = torch.nn.functional.pad(q.float(), (0, -n % BITS_PER_BYTE), value=1.0)
    return bitpack.pack_signs(rows).to(q.device).reshape(O, rows.shape[1] // BITS_PER_BYTE)


def unpack_sign_rows(packed: torch.Tensor, n: int) -> torch.Tensor:
    """(O, m) uint8 -> (O, n) int8 in {-1, 1}, n <= 8 m."""
    O, m = packed.shape
    signs = bitpack.unpack_signs(packed.reshape(-1), O * m * BITS_PER_BYTE)
    return signs.reshape(O, m * BITS_PER_BYTE)[:, :n].to(torch.int8)


def unpack(packed: torch.Tensor, n: int, kind: str) -> torch.Tensor:
    """The int8 weights of a packed matrix: ``kind`` "ternary" or "binary"."""
    if kind == "ternary":
        return unpack_trits(packed, n)
    if kind == "binary":
        return unpack_sign_rows(packed, n)
    raise ValueError(f"kind must be 'ternary' or 'binary', got {kind!r}")


def lowbit_linear_reference(x_TI: torch.Tensor, packed_OM: torch.Tensor, scales_O: torch.Tensor,
                            kind: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for W = unpack(packed) * scales[:, None], with the activations
    quantized token-wise to INT8 (absmax, as W8A8 does) and the product in integers: the
    result a native kernel must equal exactly. fp32 out."""
    n = x_TI.shape[-1]
    w = unpack(packed_OM, n, kind).to(torch.int32)
    xq, xs = quantize_tokens(x_TI.float())
    acc = xq.to(torch.int32) @ w.t()  # exact: |acc| <= 127 * n
    y = acc.float() * xs[:, None] * scales_O.float()[None, :]
    return y if bias is None else y + bias.float()


KIND_CODES = {"ternary": 0, "binary": 1}


@dataclasses.dataclass
class LowbitWeight:
    """A packed ternary or binary (O, I) weight and one fp32 scale a row (troupe.compression.
    lowbit makes them). ``packed``: with layout "rows", (O, Mb) uint8, Mb = ceil(I / 5) or
    ceil(I / 8); with layout "blocks" (the native kernel's, ``native_layout``), (ceil(O / 16),
    ceil(Mb / 4), 16, 4): four bytes of each of 16 rows side by side, zeros as padding."""

    packed: torch.Tensor
    scales: torch.Tensor
    kind: str
    shape: tuple[int, int]
    layout: str = "rows"

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * 4

    def rows(self) -> torch.Tensor:
        """The (O, Mb) packed rows whatever the layout."""
        if self.layout == "rows":
            return self.packed
        O, I = self.shape
        return self.packed.transpose(1, 2).reshape(-1, self.packed.shape[1] * 4)[
            :O, :row_bytes(I, self.kind)]

    def dequantize(self) -> torch.Tensor:
        """The fp32 (O, I) weight it stands for."""
        return unpack(self.rows(), self.shape[1], self.kind).float() * self.scales[:, None]

    def map(self, fn) -> "LowbitWeight":
        """Moved by ``fn`` (``.to(device)`` and the like), laid out for where it lands; the
        scales stay fp32."""
        moved = dataclasses.replace(self, packed=fn(self.rows().contiguous()),
                                    scales=fn(self.scales).float(), layout="rows")
        return native_layout(moved)


def native_layout(w: LowbitWeight) -> LowbitWeight:
    """``w`` in the native kernel's block layout when that kernel runs here and ``w`` is on the
    CPU; else as it is (rows)."""
    if w.layout != "rows" or w.packed.device.type != "cpu" or not native_available():
        return w
    O, Mb = w.packed.shape
    Q, NB = -(-Mb // 4), -(-O // 16)
    rows = torch.nn.functional.pad(w.packed, (0, 4 * Q - Mb, 0, 16 * NB - O))
    blocks = rows.view(NB, 16, Q, 4).transpose(1, 2).contiguous()
    return dataclasses.replace(w, packed=blocks, layout="blocks")


def pack(q_OI: torch.Tensor, kind: str) -> torch.Tensor:
    """The packed rows of ternary (``pack_trits``) or binary (``pack_sign_rows``) values."""
    if kind == "ternary":
        return pack_trits(q_OI)
    if kind == "binary":
        return pack_sign_rows(q_OI)
    raise ValueError(f"kind must be 'ternary' or 'binary', got {kind!r}")


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    """Whether csrc/lowbit_gemm.cpp runs here (AVX-512 VNNI and a compiler)."""
    flags = cpu_info()[1]
    if flags is not None and not {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return False
    ext = _native.load_extension("lowbit_gemm")
    return ext is not None and ext.available()


def lowbit_linear(x_TI: torch.Tensor, packed_OM: torch.Tensor, scales_O: torch.Tensor,
                  kind: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``lowbit_linear_reference`` computes (fp32 (T, O)), fast: the native kernel on a
    CPU with VNNI; elsewhere the weight unpacked for this call (transient int8 (O, I)) and the
    integer product taken in fp32, exact while every partial sum is below 2^24 (127 I < 2^24:
    I up to 132104), else in fp64."""
    if kind not in KIND_CODES:
        raise ValueError(f"kind must be one of {tuple(KIND_CODES)}, got {kind!r}")
    w = LowbitWeight(packed_OM, scales_O, kind, (packed_OM.shape[0], x_TI.shape[-1]))
    return lowbit_weight_linear(x_TI, native_layout(w), bias)


def lowbit_weight_linear(x_TI: torch.Tensor, w: LowbitWeight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``lowbit_linear`` of a LowbitWeight, whose block layout (``native_layout``) the native
    kernel reads as it is."""
    def f32(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()

    if w.layout == "blocks" and x_TI.device.type == "cpu":
        return _native.load_extension("lowbit_gemm").linear(
            f32(x_TI), w.packed, f32(w.scales), None if bias is None else f32(bias),
            KIND_CODES[w.kind], w.shape[0])
    n = x_TI.shape[-1]
    q = unpack(w.rows(), n, w.kind)
    xq, xs = quantize_tokens(x_TI.float())
    dtype = torch.float32 if 127 * n < 1 << 24 else torch.float64
    with torch.autocast(x_TI.device.type, enabled=False):  # autocast would round the sums
        acc = xq.to(dtype) @ q.to(dtype).t()
    y = acc.float() * xs[:, None] * w.scales.float()[None, :]
    return y if bias is None else y + bias.float()
