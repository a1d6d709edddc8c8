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
