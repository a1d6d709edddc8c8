"""The fused native loops and the torch path of kernels.onebit agree bit for bit (the torch
path is also the CUDA one)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from troupe.kernels import _native, onebit

needs_native = pytest.mark.skipif(_native.load("onebit") is None, reason="no C compiler")


def both_paths(fn):
    """fn() through the native loops, then through the torch path."""
    native = fn()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(onebit, "_lib", lambda *t: None)
        reference = fn()
    return native, reference


@needs_native
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 5000), pad=st.integers(0, 40), seed=st.integers(0, 1000))
def test_native_matches_torch_path(n, pad, seed):
    g = torch.Generator().manual_seed(seed)
    N = (n + pad + 7) // 8 * 8
    e0, x = torch.randn(N, generator=g), torch.randn(n, generator=g)
    e0[::9] = 0.0
    x[::11] = -e0[: n : 11] if n else x[::11]  # exact zeros after the add too

    def run():
        e = e0.clone()
        scale = onebit.accumulate_(e, x)
        packed = onebit.pack_update_(e, scale)
        out = torch.full((N,), 7.0)
        onebit.unpack_(packed, out, scale)
        acc = out.clone()
        onebit.unpack_(packed, acc[: max(N - 3, 0)], 0.5, accumulate=True)
        return scale, packed, e, out, acc

    native, reference = both_paths(run)
    for a, b in zip(native, reference):  # the scale (a double sum either way), bytes, errors
        assert torch.equal(a, b)


def test_sign_of_zero_is_plus_and_error_is_exact():
    e = torch.tensor([0.0, 1.0, -1.0, 2.0, -3.0, 0.5, -0.5, 0.0])
    packed = onebit.pack_update_(e, torch.tensor([0.5]))
    assert packed.tolist() == [0b11010101]
    assert e.tolist() == [-0.5, 0.5, -0.5, 1.5, -2.5, 0.0, 0.0, -0.5]


def test_pack_update_needs_whole_bytes():
    with pytest.raises(ValueError, match="multiple of 8"):
        onebit.pack_update_(torch.zeros(9), torch.tensor([1.0]))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1001, 262_147])
def test_cuda_matches_the_cpu_bit_for_bit(n):
    """The CUDA path (torch ops and cupy bit-packing) gives the CPU loops' scale, bytes and
    errors exactly: what makes an NCCL run of compressed_allreduce equal a gloo run."""
    g = torch.Generator().manual_seed(n)
    N = (n + 15) // 8 * 8
    e0, x = torch.randn(N, generator=g), torch.randn(n, generator=g) * 3

    def run(device):
        e = e0.to(device, copy=True)  # the steps work in place: each run starts from e0
        scale = onebit.accumulate_(e, x.to(device))
        packed = onebit.pack_update_(e, scale)
        out = onebit.unpack_(packed, torch.zeros(N, device=device), scale)
        return [t.cpu() for t in (scale, packed, e, out)]

    for a, b in zip(run("cpu"), run("cuda")):
        assert torch.equal(a, b)


@needs_native
@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(0, 1000), wd=st.booleans())
def test_fused_optimizer_steps_match_torch_path(n, seed, wd):
    """The 1-bit optimizers' packed-momentum steps: the C loops and the torch ops round each
    operation alike."""
    g = torch.Generator().manual_seed(seed)
    e0, x, p0 = (torch.randn(n, generator=g) for _ in range(3))
    v = torch.rand(n, generator=g) * 1e-3
    v[::7] = 0.0  # eps alone below the update
    packed = torch.randint(0, 256, ((n + 7) // 8 + 3,), generator=g, dtype=torch.uint8)

    def run():
        e = onebit.momentum_(e0.clone(), packed, x, 0.9 * 0.013, 0.1)
        p = onebit.adam_apply_(p0.clone(), v, packed, 1e-3 * 0.013, 1 - 1e-3 * 0.01 * wd,
                               1 / 0.999, 1e-8)
        return e, p

    (e, p), (e_ref, p_ref) = both_paths(run)
    assert torch.equal(e, e_ref) and torch.equal(p, p_ref)
    signs = torch.tensor([1.0 if packed[i // 8] >> (7 - i % 8) & 1 else -1.0 for i in range(n)])
    expect = p0 * (1 - 1e-3 * 0.01 * wd) - signs * 1e-3 * 0.013 / ((v / 0.999).sqrt() + 1e-8)
    torch.testing.assert_close(p, expect, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(e, e0 + signs * 0.9 * 0.013 + x * 0.1)
