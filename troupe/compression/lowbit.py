"""Ternary and binary weights (XTC's extreme compression; BitNet b1.58's ternary), per output
row, and their fake quantization for training through them.

- ``ternary``: W ~ s * T with T in {-1, 0, +1}. T = clamp(round(W / a), -1, 1) with
  a = mean |W| of the row (BitNet b1.58's absmean rounding: a weight becomes 0 when it is under
  half the row's mean magnitude); s is then the scale that minimises ||W - s T||^2 for that T,
  the mean |W| over the row's non-zero entries (TWN's choice of scale). BitNet keeps s = a;
  the least-squares scale is never worse on the weights themselves and costs nothing at
  inference (one fp32 scale a row either way). ``method="twn"`` uses TWN's threshold instead
  (0.7 mean |W|), for comparison.
- ``binary``: W ~ s * sign(W) (0 -> +1), s = mean |W| of the row, the least-squares scale of a
  sign matrix (XTC, BinaryBERT).

``fake_lowbit`` gives the forward the quantized weight and the backward the identity (a
straight-through estimator), so that distillation trains the fp32 weights through the
quantization."""

from __future__ import annotations

import torch

from troupe.kernels.lowbit import LowbitWeight, pack

KINDS = ("ternary", "binary")


def ternarize(w_OI: torch.Tensor, method: str = "absmean") -> tuple[torch.Tensor, torch.Tensor]:
    """(T int8 (O, I) in {-1, 0, 1}, scales fp32 (O,)) with W ~ scales[:, None] * T."""
    w = w_OI.detach().float()
    mean = w.abs().mean(dim=1, keepdim=True)
    if method == "absmean":
        t = torch.clamp(torch.round(w / mean.clamp_min(1e-12)), -1, 1)
    elif method == "twn":
        t = torch.sign(w) * (w.abs() > 0.7 * mean)
    else:
        raise ValueError(f"method must be 'absmean' or 'twn', got {method!r}")
    kept = t.abs()
    scale = (w.abs() * kept).sum(1) / kept.sum(1).clamp_min(1)
    return t.to(torch.int8), scale


def binarize(w_OI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(signs int8 (O, I) in {-1, 1}, scales fp32 (O,)) with W ~ scales[:, None] * signs."""
    w = w_OI.detach().float()
    signs = torch.where(w >= 0, 1, -1).to(torch.int8)
    return signs, w.abs().mean(dim=1)


def lowbit(w_OI: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "ternary":
        return ternarize(w_OI)
    if kind == "binary":
        return binarize(w_OI)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def dequantize(q_OI: torch.Tensor, scales_O: torch.Tensor) -> torch.Tensor:
    return q_OI.float() * scales_O[:, None]


def fake_lowbit(w_OI: torch.Tensor, kind: str) -> torch.Tensor:
    """The quantized weight in the forward, the identity in the backward."""
    q, s = lowbit(w_OI, kind)
    return w_OI + (dequantize(q, s).to(w_OI.dtype) - w_OI).detach()


def quantize_lowbit(w_OI: torch.Tensor, kind: str) -> LowbitWeight:
    """``w_OI`` ternarized or binarized and packed (troupe.kernels.lowbit)."""
    q, s = lowbit(w_OI, kind)
    return LowbitWeight(pack(q.cpu(), kind).to(w_OI.device), s, kind, tuple(w_OI.shape))
