"""A slice of an MoE layer's experts: two-layer GELU MLPs held as stacked weights."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from troupe.kernels.grouped_mlp import grouped_mlp


class Experts(nn.Module):
    """Experts ``first`` .. ``first + num_local - 1`` of a layer; input rows arrive grouped by
    expert, ``counts[e]`` rows for local expert e."""

    def __init__(self, num_local: int, first: int, d_model: int, d_ff: int):
        super().__init__()
        self.num_local, self.first = num_local, first
        self.w1 = nn.Parameter(torch.empty(num_local, d_model, d_ff))
        self.b1 = nn.Parameter(torch.zeros(num_local, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_local, d_ff, d_model))
        self.b2 = nn.Parameter(torch.zeros(num_local, d_model))
        for p in self.parameters():
            p.expert = True  # reduced over the expert-data-parallel group, not all of data parallel

    def init_weights(self, seed: int, prefix: str, std: float, out_std: float) -> None:
        """Each expert's weights depend on the seed and its global index only, so any
        expert-parallel split of the layer starts from the same experts."""
        with torch.no_grad():
            for e in range(self.num_local):
                g = torch.Generator().manual_seed(seed ^ zlib.crc32(f"{prefix}:{self.first + e}".encode()))
                self.w1[e].copy_(torch.randn(self.w1.shape[1:], generator=g) * std)
                self.w2[e].copy_(torch.randn(self.w2.shape[1:], generator=g) * out_std)
            self.b1.zero_()
            self.b2.zero_()

    def forward(self, x_AM: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """(A, M) rows grouped by local expert -> (A, M); cost follows A, not the expert count."""
        return grouped_mlp(x_AM, counts, self.w1, self.b1, self.w2, self.b2)
