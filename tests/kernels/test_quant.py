"""Quantization invariants: the round-trip error is within half a step of each group, the INT8
GEMM is exact, and the rescaled product equals the fp32 product of the dequantized operands."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from troupe.kernels.quant import (dequantize_weight, gemm_layout, int8_gemm, int8_linear,
                                  pack_int4, quantize_tokens, quantize_weight, row_layout,
                                  unpack_int4, vnni_available, vnni_layout)

needs_vnni = pytest.mark.skipif(not vnni_available(), reason="no AVX-512 VNNI on this CPU")


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([8, 4]), axis=st.sampled_from([0, 1]),
       group=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 10_000),
       magnitude=st.sampled_from([1e-3, 1.0, 50.0]))
def test_round_trip_within_half_a_step(bits, axis, group, seed, magnitude):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 16, generator=g) * magnitude
    qw = quantize_weight(w, bits, group, axis)
    err = (w - dequantize_weight(qw)).abs()
    if axis == 0:
        bound = qw.scales.repeat_interleave(group)[:, None].expand(8, 16)
    else:
        bound = qw.scales.repeat_interleave(group, dim=1)
    assert (err <= bound / 2 * (1 + 1e-5) + 1e-12).all()


def test_int4_packing_round_trip():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    assert torch.equal(unpack_int4(packed, 32), q)


def test_int8_gemm_is_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (37, 300), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (50, 300), generator=g, dtype=torch.int8)
    assert torch.equal(int8_gemm(x, w).long(), x.long() @ w.long().t())


@pytest.mark.parametrize("I, padded", [(1024, False), (2048, True), (4096, True)])
def test_gemm_layout_pads_rows_and_keeps_the_product(I, padded):
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-127, 128, (8, I), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (48, I), generator=g, dtype=torch.int8)
    laid = gemm_layout(w)
    assert torch.equal(laid, w) and laid.stride() == ((I + 16, 1) if padded else (I, 1))
    assert torch.equal(int8_gemm(x, laid), int8_gemm(x, w))
    qw = quantize_weight(w.float(), 8, 16)
    padded_qw = dataclasses.replace(qw, q=gemm_layout(qw.q))
    assert torch.equal(dequantize_weight(padded_qw), dequantize_weight(qw))
    assert padded_qw.nbytes == qw.nbytes + (48 * 16 if padded else 0)  # the padding counts


def test_int8_gemm_refuses_overflowing_inner_dimension():
    with pytest.raises(ValueError, match="overflow"):
        int8_gemm(torch.zeros(2, 140_000, dtype=torch.int8),
                  torch.zeros(3, 140_000, dtype=torch.int8))


def test_rescaled_product_equals_dequantized_fp32_product():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 128, generator=g), torch.randn(96, 128, generator=g)
    qw = quantize_weight(w, 8, group_size=8, axis=0)
    xq, xs = quantize_tokens(x)
    want = (xq.double() * xs.double()[:, None]) @ dequantize_weight(qw).double().t()
    got = int8_linear(x, qw)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # and close to the unquantized product
    assert ((got - x @ w.t()).norm() / (x @ w.t()).norm()).item() < 0.02


@needs_vnni
@pytest.mark.parametrize("M", [1, 5, 6, 7, 8, 9, 14, 16, 33])
@pytest.mark.parametrize("K, N", [(64, 16), (96, 33), (576, 1536), (20, 100), (2052, 40)])
def test_vnni_kernel_equals_the_torch_path_bit_for_bit(M, K, N):
    """The native W8A8 kernel (token quantization, VNNI GEMM, rescale in one call) gives
    exactly int8_linear's torch ops' numbers: every tile shape (6 x 4 blocks, 4 + 4 rows, 8 x 2
    blocks past K = 2048), output channels that are not a multiple of 16, with and without a
    bias."""
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    w, x, b = torch.randn(N, K, generator=g), 3 * torch.randn(M, K, generator=g), torch.randn(N)
    x[0, 0] = 40.0  # an outlier that sets row 0's scale
    rows = quantize_weight(w, 8, 1, axis=0)
    packed = vnni_layout(rows)
    assert packed.layout == "vnni" and rows.layout == "rows"
    assert torch.equal(int8_linear(x, packed, b), int8_linear(x, rows, b))
    assert torch.equal(int8_linear(x, packed), int8_linear(x, rows))
    assert torch.equal(row_layout(packed).q, rows.q)
    assert torch.equal(dequantize_weight(packed), dequantize_weight(rows))


@needs_vnni
def test_vnni_layout_holds_the_weight_once():
    rows = quantize_weight(torch.randn(100, 64), 8, 1, axis=0)
    packed = vnni_layout(rows)
    # 7 blocks of 16 output channels (12 rows of zeros) and the column sums
    assert packed.nbytes == 112 * 64 + 100 * 4 + 100 * 4
    assert vnni_layout(quantize_weight(torch.randn(8, 6), 8, 1, axis=0)).layout == "rows"  # I % 4


def test_weight_memory():
    w = torch.randn(256, 512)
    assert quantize_weight(w, 8, 64).nbytes / (w.numel() * 4) < 0.3
    assert quantize_weight(w, 4, 64, axis=1).nbytes / (w.numel() * 4) < 0.17


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 17, 64])
def test_int8_gemm_on_cuda_is_exact(T):
    """torch._int_mm on CUDA (padded to 17 rows below that) against an int64 reference."""
    g = torch.Generator().manual_seed(T)
    x = torch.randint(-127, 128, (T, 256), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (96, 256), dtype=torch.int8, generator=g)
    got = int8_gemm(x.cuda(), w.cuda()).cpu().long()
    assert torch.equal(got, x.long() @ w.long().t())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w8a8", "w8a16", "w4a16"])
def test_quantized_linear_on_cuda_matches_cpu(mode):
    from troupe.compression import QuantizedLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128)
    q = QuantizedLinear(lin, mode)
    x = torch.randn(33, 256)
    cpu = q(x)
    q.cuda()
    assert q.qw.q.is_cuda and q.qw.scales.is_cuda
    assert torch.allclose(q(x.cuda()).cpu(), cpu, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("T", [1, 3, 4, 8, 16, 17])
def test_weight_only_linear_matches_the_dequantized_product(bits, T):
    """The native row-at-a-time loop (T <= 16) and the whole-weight path (T > 16) both equal
    x @ dq(W)^T + b."""
    import shutil

    import torch.nn.functional as F

    from troupe.kernels.quant import _quant_lib, weight_only_linear

    if shutil.which("cc") or shutil.which("gcc"):
        assert _quant_lib() is not None  # the native path is really the one tested
    g = torch.Generator().manual_seed(bits * 100 + T)
    w, x, b = torch.randn(40, 96, generator=g), torch.randn(T, 96, generator=g), torch.randn(40)
    qw = quantize_weight(w, bits, 32, axis=1)
    want = F.linear(x.double(), dequantize_weight(qw).double(), b.double())
    torch.testing.assert_close(weight_only_linear(x, qw, b).double(), want, rtol=1e-5, atol=1e-5)


def _int16_tokens(x: torch.Tensor) -> torch.Tensor:
    """x as the weight-only kernel sees it: each row rounded to INT16 steps of max|x_t| / 32767
    (the scale and the division in fp32, as the kernel does them), in float64."""
    s = (x.abs().amax(1, keepdim=True) / 32767).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(x / s).clamp(-32767, 32767).double() * s.double()


@needs_vnni
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("M", [1, 5, 8, 9, 17, 33])
@pytest.mark.parametrize("K, N, group", [(64, 16, 64), (96, 33, 32), (576, 1536, 64),
                                         (1024, 40, 512), (48, 100, 4)])
def test_weight_only_kernel_is_the_int16_token_product(bits, M, K, N, group):
    """The native W8A16 / W4A16 kernel computes x16 @ dq(W)^T + b, x16 the tokens rounded to
    INT16 (exact integer products; the group sums scaled in fp32): every row count (tiles of
    up to 8), output channels that are not a multiple of 16, groups from 4 to 512 inputs; and
    stays within the INT16 rounding bound (half a step times sum |w|) of the fp32 product."""
    g = torch.Generator().manual_seed(bits * 10_000 + M * 100 + K + N)
    w, x, b = torch.randn(N, K, generator=g), 3 * torch.randn(M, K, generator=g), torch.randn(N)
    x[0, 0] = 40.0  # an outlier that sets row 0's scale
    rows = quantize_weight(w, bits, group, axis=1)
    packed = vnni_layout(rows)
    assert packed.layout == "vnni16" and rows.layout == "rows"
    from troupe.kernels.quant import weight_only_linear

    got = weight_only_linear(x, packed, b).double()
    dq = dequantize_weight(rows).double()
    want = _int16_tokens(x) @ dq.t() + b.double()
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    step = x.abs().amax(1, keepdim=True).double() / 32767
    bound = 0.5 * step * dq.abs().sum(1)[None, :] + 1e-6 * want.abs().max()
    assert ((got - (x.double() @ dq.t() + b.double())).abs() <= bound).all()
    no_bias = weight_only_linear(x, packed).double()
    assert (no_bias + b.double() - want).abs().max() <= 1e-6 * want.abs().max()


@needs_vnni
@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_packing_round_trips(bits):
    rows = quantize_weight(torch.randn(100, 128), bits, 32, axis=1)
    packed = vnni_layout(rows)
    back = row_layout(packed)
    assert back.layout == "rows"
    assert torch.equal(back.q, rows.q) and torch.equal(back.scales, rows.scales)
    assert torch.equal(dequantize_weight(packed), dequantize_weight(rows))
    # 7 blocks of 16 outputs (12 of zeros), 128 inputs, 1 or 1/2 byte each, and 4 group scales
    assert packed.nbytes == 112 * 128 * bits // 8 + 112 * 4 * 4
    for group in (6, 1024):  # not a multiple of 4, or an INT32 sum that could overflow
        odd = quantize_weight(torch.randn(16, 1024 if group == 1024 else 96), bits, group, axis=1)
        assert vnni_layout(odd).layout == "rows"


@needs_vnni
@pytest.mark.parametrize("M", [1, 6, 8, 13])
@pytest.mark.parametrize("K, N, k", [(64, 16, 1), (96, 33, 3), (576, 1536, 16)])
def test_vnni_kernel_fuses_the_outlier_channels(M, K, N, k):
    """W8A8 with k input channels kept fp32: the native kernel (the channels zeroed while the
    tokens are quantized, their fp32 product added in the epilogue) equals the torch path
    (clone, zero, INT8 product, plus the fp32 product beside it) to fp32 rounding; the INT8 part
    is bit for bit the same, so what differs is only the order of the fp32 additions."""
    g = torch.Generator().manual_seed(M * 1000 + K + N + k)
    w, x, b = torch.randn(N, K, generator=g), 3 * torch.randn(M, K, generator=g), torch.randn(N)
    channels = torch.randperm(K, generator=g)[:k].sort().values
    x[:, channels] *= 50  # outliers: they would set every token's scale
    rows_w = w[:, channels].t().contiguous()
    w = w.clone()
    w[:, channels] = 0
    rows = quantize_weight(w, 8, 1, axis=0)
    packed = vnni_layout(rows)
    got = int8_linear(x, packed, b, (channels, rows_w))
    want = int8_linear(x, rows, b, (channels, rows_w))
    # two fp32 sums of the same terms (the rescaled INT8 product, the bias, k products) in
    # different orders: within a few ulps of the sum of the terms' magnitudes
    side = x[:, channels].abs() @ rows_w.abs() + b.abs() + want.abs()
    assert ((got - want).abs() <= (k + 2) * 2**-23 * side + 1e-6).all()
    plain = int8_linear(x, packed, b)  # without them the outliers wreck the scales
    assert (plain - want).abs().max() > 10 * (got - want).abs().max()
    with pytest.raises(RuntimeError, match="outlier channel"):
        int8_linear(x, packed, b, (torch.tensor([K]), rows_w[:1]))
