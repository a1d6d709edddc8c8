import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from troupe.kernels import bitpack


def test_known_bytes_msb_first_and_zero_is_positive():
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, 2.0, -3.0, 5.0, -7.0, 0.5, -2.0])
    packed = bitpack.pack_signs(x)
    assert packed.tolist() == [0b10111010, 0b10000000]
    assert bitpack.unpack_signs(packed, 10).tolist() == [1, -1, 1, 1, 1, -1, 1, -1, 1, -1]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 2000), seed=st.integers(0, 1000))
def test_round_trip_any_size(n, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[::7] = 0.0
    packed = bitpack.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(bitpack.unpack_signs(packed, n), expected)
    # the device-generic torch path agrees byte for byte; so does a shift-based unpack
    assert torch.equal(bitpack._pack_torch(x), packed)
    shifted = (packed.view(-1, 1) >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1
    assert torch.equal(shifted.reshape(-1)[:n].float() * 2 - 1, expected)
    scaled = bitpack.unpack_signs(packed, n, scale=0.25)
    assert torch.equal(scaled, expected * 0.25)
    out = torch.empty(n)
    assert bitpack.unpack_signs(packed, n, scale=3.0, out=out) is out
    assert torch.equal(out, expected * 3.0)


def test_shapes_dtypes_and_bad_input():
    x = torch.randn(3, 5, 7).to(torch.bfloat16)
    assert torch.equal(bitpack.unpack_signs(bitpack.pack_signs(x), x.numel()).view(3, 5, 7),
                       torch.where(x >= 0, 1.0, -1.0))
    with pytest.raises(ValueError, match="uint8"):
        bitpack.unpack_signs(torch.zeros(2, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="fewer than numel"):
        bitpack.unpack_signs(torch.zeros(1, dtype=torch.uint8), 9)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 8, 1000, 1 << 20, (1 << 20) + 3])
def test_cupy_kernel_matches_cpu_bytes(n):
    pytest.importorskip("cupy")
    x = torch.randn(n)
    x[::5] = 0.0
    gpu = bitpack.pack_signs(x.cuda())
    assert gpu.is_cuda and torch.equal(gpu.cpu(), bitpack.pack_signs(x))
    assert torch.equal(bitpack.unpack_signs(gpu, n).cpu(), bitpack.unpack_signs(gpu.cpu(), n))
