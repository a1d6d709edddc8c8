"""fp32 linear layers for a few rows (decoding) with weights packed for them.

A decode step multiplies a handful of rows (one token per sequence) by every weight of the
model, so a linear layer is a matrix-vector product in disguise: each weight element is read
once and used M <= 16 times. MKL's sgemm reaches about a quarter of this CPU's memory bandwidth
at that shape (benchmarks/RESULTS.md, "Decoding in fp32"). Packed as (N/16, K, 16), each
16-wide vector of weights is loaded once and multiplied by every row's input broadcast
(troupe/kernels/csrc/small_gemm.cpp), the outputs stay in registers, and the layer runs at
the speed the memory gives.

``DecodeWeights(model)`` packs a model's fp32 CPU linear layers (and its output embedding)
and, inside ``with weights.active():``, makes them use the packed product for inputs of at most
``MAX_ROWS`` rows without autograd; everything else goes to ``F.linear`` as before. The packed
copy belongs to the engine that made it (troupe.generation.ContinuousBatcher): a server builds
its engine once, RLHF's policy once per batch of rollouts (its weights change in between; the
copy is not checked against them). The C++
source is compiled on first use (torch.utils.cpp_extension, cached); without a compiler, on
a GPU, or with TROUPE_NATIVE=0 the model is left as it is.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from troupe.kernels import _native

MAX_ROWS = 16


def _extension():
    """The compiled extension, or None when it cannot be built here."""
    return _native.load_extension("small_gemm")


def available() -> bool:
    return _extension() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (ceil(N / 16), K, 16), the output rows padded with zeros to a multiple of 16."""
    N, K = weight.shape
    padded = F.pad(weight.detach().float(), (0, 0, 0, -N % 16))
    return padded.view(-1, 16, K).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n_out: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W^T + bias for at most MAX_ROWS rows, W given ``pack``ed."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = _extension().linear(rows, packed, None if bias is None else
                            F.pad(bias.detach(), (0, packed.shape[0] * 16 - bias.shape[0])))
    return y[:, :n_out].reshape(*x.shape[:-1], n_out)


class DecodeWeights:
    """A model's fp32 CPU linear layers (and tied output projection) packed for decoding;
    ``active()`` switches them to the packed product (for few-row, no-grad inputs)."""

    def __init__(self, model: nn.Module):
        self.model, self.layers, self.logits_weight = model, {}, None
        if not available():
            return
        for module in model.modules():
            w = getattr(module, "weight", None)
            if type(module) is nn.Linear and w.dtype == torch.float32 and w.device.type == "cpu":
                self.layers[module] = pack(w)
        emb = getattr(model, "tok_emb", None)
        if getattr(getattr(model, "cfg", None), "tie_embeddings", False) and emb is not None \
                and getattr(model, "lm_head", None) is None \
                and emb.weight.dtype == torch.float32 and emb.weight.device.type == "cpu":
            self.logits_weight = pack(emb.weight)

    def __bool__(self) -> bool:  # a quantized model may have no fp32 layer but the logits
        return bool(self.layers) or self.logits_weight is not None

    def refresh(self) -> None:
        """Pack the model's current weights into the buffers already held (no allocation:
        fresh pages cost more than the copy)."""
        for module, packed in self.layers.items():
            _pack_into(packed, module.weight)
        if self.logits_weight is not None:
            _pack_into(self.logits_weight, self.model.tok_emb.weight)

    @contextlib.contextmanager
    def active(self):
        if not self.layers:
            yield
            return
        for module, packed in self.layers.items():
            module.forward = functools.partial(_forward, module, packed)
        try:
            yield
        finally:
            for module in self.layers:
                del module.forward  # back to the class's forward

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The model's next-token logits of hidden states (..., C), packed when it can."""
        if self.logits_weight is not None and _small(h):
            return linear(h, self.logits_weight, self.model.cfg.vocab_size)
        with self.active():
            return self.model.logits(h)


def _pack_into(packed: torch.Tensor, weight: torch.Tensor) -> None:
    N, K = weight.shape
    whole = N // 16 * 16
    packed[:N // 16].copy_(weight.detach()[:whole].view(-1, 16, K).transpose(1, 2))
    if whole < N:
        packed[-1].copy_(pack(weight[whole:])[0])


def _small(x: torch.Tensor) -> bool:
    return x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and not (
        torch.is_grad_enabled() and x.requires_grad)


def _forward(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if _small(x) and not (torch.is_grad_enabled() and module.weight.requires_grad):
        return linear(x, packed, module.out_features, module.bias)
    return F.linear(x, module.weight, module.bias)
