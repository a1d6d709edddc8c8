"""Packed ternary (five trits a byte) and binary (eight signs a byte) weight rows, and the
reference product a native kernel must equal."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from troupe.kernels.lowbit import (lowbit_linear_reference, pack_sign_rows, pack_trits,
                                   unpack, unpack_sign_rows, unpack_trits)
from troupe.kernels.quant import quantize_tokens


def test_every_five_trits_survive_a_byte():
    """All 243 groups of five trits: one byte each, decoded back by multiply-wrap-shift."""
    groups = torch.tensor(list(itertools.product([-1, 0, 1], repeat=5)), dtype=torch.int8)
    packed = pack_trits(groups)
    assert packed.shape == (243, 1) and packed.dtype == torch.uint8
    assert len(set(packed.flatten().tolist())) == 243
    assert torch.equal(unpack_trits(packed, 5), groups)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 7), n=st.integers(0, 300), seed=st.integers(0, 10_000))
def test_trit_rows_round_trip_any_size(rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (rows, n), generator=g, dtype=torch.int8)
    packed = pack_trits(q)
    assert packed.shape == (rows, (n + 4) // 5)
    assert torch.equal(unpack_trits(packed, n), q)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 7), n=st.integers(0, 300), seed=st.integers(0, 10_000))
def test_sign_rows_round_trip_any_size(rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randint(0, 2, (rows, n), generator=g) * 2 - 1).to(torch.int8)
    packed = pack_sign_rows(q)
    assert packed.shape == (rows, (n + 7) // 8)
    assert torch.equal(unpack_sign_rows(packed, n), q)


def test_values_outside_the_alphabet_are_refused():
    with pytest.raises(ValueError, match="-1, 0, 1"):
        pack_trits(torch.tensor([[2, 0]], dtype=torch.int8))
    with pytest.raises(ValueError, match="-1, 1"):
        pack_sign_rows(torch.tensor([[1, 0]], dtype=torch.int8))
    with pytest.raises(ValueError, match="kind"):
        unpack(torch.zeros(1, 1, dtype=torch.uint8), 5, "quaternary")


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 9), I=st.integers(1, 70), O=st.integers(1, 20),
       kind=st.sampled_from(["ternary", "binary"]), seed=st.integers(0, 10_000))
def test_reference_product_is_the_integer_product_rescaled(T, I, O, kind, seed):
    """Against a float64 computation of the same integers: exact up to fp32 rounding of the
    two rescales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, I, generator=g)
    q = (torch.randint(-1, 2, (O, I), generator=g) if kind == "ternary"
         else torch.randint(0, 2, (O, I), generator=g) * 2 - 1).to(torch.int8)
    scales = torch.rand(O, generator=g) + 0.1
    packed = pack_trits(q) if kind == "ternary" else pack_sign_rows(q)
    y = lowbit_linear_reference(x, packed, scales, kind)
    xq, xs = quantize_tokens(x)
    want = (xq.double() @ q.double().t()) * xs.double()[:, None] * scales.double()[None, :]
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)


def _random_layer(g, O, I, kind):
    q = (torch.randint(-1, 2, (O, I), generator=g) if kind == "ternary"
         else torch.randint(0, 2, (O, I), generator=g) * 2 - 1).to(torch.int8)
    packed = pack_trits(q) if kind == "ternary" else pack_sign_rows(q)
    return packed, torch.rand(O, generator=g) + 0.1


@pytest.mark.parametrize("path", ["native", "torch"])
@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 19), I=st.integers(1, 700), O=st.integers(1, 40),
       kind=st.sampled_from(["ternary", "binary"]), with_bias=st.booleans(),
       seed=st.integers(0, 10_000))
def test_the_product_equals_the_reference_exactly(path, T, I, O, kind, with_bias, seed):
    """Odd sizes included: rows that end mid-byte and mid-vector, more tokens than one pass
    holds (8) and more rows than one rescale (16)."""
    from troupe.kernels import lowbit

    if path == "native" and not lowbit.native_available():
        pytest.skip("no AVX-512 VNNI here")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, I, generator=g) * (torch.rand(T, 1, generator=g) * 10)
    packed, scales = _random_layer(g, O, I, kind)
    bias = torch.randn(O, generator=g) if with_bias else None
    want = lowbit_linear_reference(x, packed, scales, kind, bias)
    if path == "torch":
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(lowbit, "native_available", lambda: False)
            got = lowbit.lowbit_linear(x, packed, scales, kind, bias)
    else:
        got = lowbit.lowbit_linear(x, packed, scales, kind, bias)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ternary", "binary"])
@pytest.mark.parametrize("T", [1, 8, 33])
def test_the_product_on_cuda_equals_the_reference(kind, T):
    """The CUDA path (unpacked for the call, the integers multiplied exactly in fp32): the
    integer sums equal the CPU reference's; the two rescales may round apart by an ulp."""
    from troupe.kernels.lowbit import lowbit_linear

    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 517, generator=g)
    packed, scales = _random_layer(g, 70, 517, kind)
    want = lowbit_linear_reference(x, packed, scales, kind)
    got = lowbit_linear(x.cuda(), packed.cuda(), scales.cuda(), kind).cpu()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ternary", "binary"])
def test_a_lowbit_layer_moves_to_cuda_and_back(mode):
    from troupe.compression import QuantizedLinear

    torch.manual_seed(0)
    q = QuantizedLinear(torch.nn.Linear(256, 96), mode)
    x = torch.randn(9, 256)
    cpu = q(x)
    q.cuda()
    assert q.qw.packed.is_cuda and q.qw.layout == "rows"
    torch.testing.assert_close(q(x.cuda()).cpu(), cpu, rtol=1e-5, atol=1e-5)
    q.cpu()
    assert torch.equal(q(x), cpu)
