"""Attention for a decode step on the CPU: one new token per sequence against its cached keys
and values, read once in place (csrc/decode_attention.cpp). In a W8A8 decode step at batch 8
(d_model 1024, 4 layers) torch's CPU flash-attention kernel took 2.1 ms of 5.6; this one takes
0.7 ms (SmolLM2-135M: 3.9 ms -> 1.5 ms a step; benchmarks/RESULTS.md). ``decode_attention``
returns None where the native kernel does not apply (a GPU, autograd, a head size other than
16-128 in steps of 16 or 256, no compiler, TROUPE_NATIVE=0): the caller keeps
``scaled_dot_product_attention``."""

from __future__ import annotations

import math

import torch

from troupe.kernels import _native


def _extension():
    return _native.load_extension("decode_attention")


def decode_attention(q_BH1D: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(D), masked) v for q of one position, grouped-query heads allowed
    (H a multiple of k's heads); ``mask`` None (every key) or a boolean (B, 1, 1, S) of the
    keys each sequence may see. (B, H, 1, D), or None when the native kernel does not apply."""
    B, H, T, D = q_BH1D.shape
    S = k_BHSD.shape[2]
    if torch.compiler.is_compiling():  # a traced step (troupe.generation.static_step): torch's
        return None
    if not (T == 1 and q_BH1D.device.type == "cpu"
            and q_BH1D.dtype == k_BHSD.dtype == v_BHSD.dtype == torch.float32
            and not (torch.is_grad_enabled() and (q_BH1D.requires_grad or k_BHSD.requires_grad
                                                  or v_BHSD.requires_grad))
            and q_BH1D.stride(3) == k_BHSD.stride(3) == v_BHSD.stride(3) == 1):
        return None
    if mask is not None and not (mask.dtype == torch.bool and mask.shape == (B, 1, 1, S)):
        return None
    ext = _extension()
    if ext is None or not ext.supports(D):
        return None
    valid = None if mask is None else mask.reshape(B, S).contiguous()
    return ext.decode(q_BH1D, k_BHSD, v_BHSD, valid, 1.0 / math.sqrt(D))
