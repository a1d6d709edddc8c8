"""The native decode-step attention against torch's scaled_dot_product_attention."""

import pytest
import torch
import torch.nn.functional as F

from troupe.kernels.decode_attention import _extension, decode_attention

needs_native = pytest.mark.skipif(_extension() is None, reason="no C++ compiler here")


@needs_native
@pytest.mark.parametrize("B, H, Hkv, S, D", [(8, 16, 16, 100, 64), (8, 9, 3, 37, 64),
                                             (3, 4, 2, 16, 128), (2, 8, 1, 33, 256),
                                             (1, 2, 1, 1, 16), (2, 6, 2, 50, 96)])
@pytest.mark.parametrize("masked", [False, True])
def test_equals_sdpa_on_a_cache_view(B, H, Hkv, S, D, masked):
    """q a strided view of a fused qkv output, k and v the first S columns of a larger cache
    (as KVCache.extend returns them), grouped-query heads, left-padding masks; keys 16 at a
    time and the tail one by one (S from 1 to 100)."""
    g = torch.Generator().manual_seed(B * 1000 + S + D)
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * D, generator=g)
    q = qkv[..., :H * D].view(B, 1, H, D).transpose(1, 2)
    k = torch.randn(B, Hkv, S + 7, D, generator=g)[:, :, :S]
    v = torch.randn(B, Hkv, S + 7, D, generator=g)[:, :, :S]
    mask = None
    if masked:
        valid = torch.rand(B, S, generator=g) > 0.3
        valid[:, -1] = True  # the new token itself
        mask = valid[:, None, None, :]
        k[~valid[:, None, :, None].expand_as(k)] = float("nan")  # never read: padding
    want = F.scaled_dot_product_attention(q, k.nan_to_num(0.0), v.nan_to_num(0.0),
                                          attn_mask=mask, enable_gqa=H != Hkv)
    got = decode_attention(q, k, v, mask)
    assert got.shape == (B, H, 1, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_declines_what_it_does_not_cover():
    q, k = torch.randn(2, 4, 1, 24), torch.randn(2, 4, 9, 24)
    assert decode_attention(q, k, k, None) is None  # head size 24
    q, k = torch.randn(2, 4, 2, 64), torch.randn(2, 4, 9, 64)
    assert decode_attention(q, k, k, None) is None  # two query positions
    q = torch.randn(2, 4, 1, 64, requires_grad=True)
    assert decode_attention(q, k, k, None) is None  # autograd
    assert decode_attention(q.detach(), k, k, torch.ones(2, 4, 1, 9, dtype=torch.bool)) is None
