"""A slice of an MoE layer's experts: two-layer MLPs (GELU, or SwiGLU as in Mixtral) held as
stacked weights."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from troupe.kernels.grouped_mlp import grouped_mlp


class Experts(nn.Module):
    """Experts ``first`` .. ``first + num_local - 1`` of a layer; input rows arrive grouped by
    expert, ``counts[e]`` rows for local expert e. ``mlp="swiglu"``: w1 holds each expert's
    gate and up projections stacked (M, 2 * d_ff), gate first. ``bias=False``: no b1, b2."""

    def __init__(self, num_local: int, first: int, d_model: int, d_ff: int,
                 mlp: str = "gelu", bias: bool = True):
        super().__init__()
        if mlp not in ("gelu", "swiglu"):
            raise ValueError(f"MoE experts are GELU or SwiGLU MLPs, not {mlp!r}")
        self.num_local, self.first, self.mlp = num_local, first, mlp
        self.d_ff = d_ff
        width = 2 * d_ff if mlp == "swiglu" else d_ff
        self.w1 = nn.Parameter(torch.empty(num_local, d_model, width))
        self.b1 = nn.Parameter(torch.zeros(num_local, width)) if bias else None
        self.w2 = nn.Parameter(torch.empty(num_local, d_ff, d_model))
        self.b2 = nn.Parameter(torch.zeros(num_local, d_model)) if bias else None
        for p in self.parameters():
            p.expert = True  # reduced over the expert-data-parallel group, not all of data parallel

    @property
    def bias(self) -> bool:
        return self.b1 is not None

    def init_weights(self, seed: int, prefix: str, std: float, out_std: float) -> None:
        """Each expert's weights depend on the seed and its global index only, so any
        expert-parallel split of the layer starts from the same experts."""
        with torch.no_grad():
            for e in range(self.num_local):
                g = torch.Generator().manual_seed(seed ^ zlib.crc32(f"{prefix}:{self.first + e}".encode()))
                # drawn with a CPU generator, so that every device starts from the same experts
                w1 = torch.randn(self.w1.shape[1:], generator=g)  # host: then copied into place
                w2 = torch.randn(self.w2.shape[1:], generator=g)  # host: (as w1)
                self.w1[e].copy_(w1 * std)
                self.w2[e].copy_(w2 * out_std)
            if self.bias:
                self.b1.zero_()
                self.b2.zero_()

    def forward(self, x_AM: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """(A, M) rows grouped by local expert -> (A, M); cost follows A, not the expert count."""
        return grouped_mlp(x_AM, counts, self.w1, self.b1, self.w2, self.b2,
                           swiglu=self.mlp == "swiglu")
