"""The token embedding held as integers (``quantize_model``'s ``embedding``: int8 or int4)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from troupe.kernels.quant import QuantizedWeight, group_divisor, quantize_weight, unpack_int4


class QuantizedEmbedding(nn.Module):
    """A token embedding held as INT8 or INT4 rows with a scale per group of ``group_size``
    values along the model dimension (as w8a16 / w4a16 hold a Linear's rows); a lookup
    dequantizes the rows it gathers, in ``dtype``. For a model whose output projection is the
    embedding (tied), ``quantize_model`` gives the head the same integers (a weight-only
    QuantizedLinear): SmolLM2's 49152 x 576 matrix is a fifth of its weights."""

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        if qw.axis != 1 or qw.layout != "rows":
            raise ValueError("QuantizedEmbedding holds row-layout weights grouped along the "
                             "model dimension")
        self.qw, self.dtype = qw, dtype
        self.num_embeddings, self.embedding_dim = qw.shape

    @classmethod
    def of(cls, emb: nn.Embedding, bits: int, group_size: int = 64) -> "QuantizedEmbedding":
        """``emb`` quantized, its group scales rounded to fp16 (the integers quantized against
        the rounded scales): stored as fp16, they cost half as much on disk, losslessly (for
        SmolLM2 in INT4 with groups of 64: 0.9 MB instead of 1.8, of 15)."""
        w = emb.weight.detach().float()
        return cls(quantize_weight(w, bits, group_divisor(w.shape[1], group_size), axis=1,
                                   scale_dtype=torch.float16), emb.weight.dtype)

    @property
    def weight_nbytes(self) -> int:
        return self.qw.nbytes

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.qw = dataclasses.replace(self.qw, q=fn(self.qw.q), scales=fn(self.qw.scales).float())
        probe = fn(torch.zeros((), dtype=self.dtype))  # host: a probe of what fn casts to
        self.dtype = probe.dtype if probe.is_floating_point() else self.dtype
        return self

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        qw, C = self.qw, self.embedding_dim
        q = qw.q[idx]
        if qw.bits == 4:
            q = unpack_int4(q, C)
        g = qw.group_size
        rows = q.float().reshape(*idx.shape, C // g, g) * qw.scales[idx][..., None]
        return rows.reshape(*idx.shape, C).to(self.dtype)

