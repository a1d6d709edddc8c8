"""Where compressed_allreduce puts each element of a flat buffer, as a layout for optimizer
state that is sharded the way the compression already is.

compressed_allreduce pads tensor k (n_k elements at offset o_k of the flat buffer) to
N_k = padded_numel(n_k, W) and makes rank j the server of its chunk j, C_k = N_k / W elements.
Row j of the layout is chunk j of every tensor, one after another (S = sum_k C_k elements)::

    flat    | tensor 0 ................ | tensor 1 ....... |
    row 0   | t0 chunk 0 | t1 chunk 0 |
    row 1   | t0 chunk 1 | t1 chunk 1 |     (a tensor's last chunks end in zero padding)

A sharded 1-bit optimizer keeps row ``rank`` of its state, an unsharded one all W rows; the
element-wise updates of a row see the same values either way, so the two agree bit for bit.
Per-tensor reductions (LAMB's norms) are summed per row first and then over rows in rank
order, the same arithmetic whether the rows are local or gathered from the group.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from troupe.collectives import padded_numel


class ChunkLayout:
    """The (W, S) row layout of a flat buffer of tensors at ``segments`` ((offset, numel) each,
    as FlatParams.segments) for a group of ``world`` ranks."""

    def __init__(self, segments: Sequence[tuple[int, int]], world: int):
        self.W = world
        self.segments = list(segments)
        self.chunks = [padded_numel(n, world) // world for _, n in self.segments]
        self.starts = list(itertools.accumulate(self.chunks, initial=0))
        self.S = self.starts[-1]  # elements of one row
        self.T = len(self.segments)

    def pieces(self, j: int):
        """(k, flat offset, row position, length) of each tensor's chunk j: its real elements,
        ``length`` <= C_k (0 when tensor k ends before chunk j)."""
        for k, (offset, _) in enumerate(self.segments):
            lo, length = self.span(k, j)
            yield k, offset + lo, self.starts[k], length

    def span(self, k: int, j: int) -> tuple[int, int]:
        """(start within tensor k, length) of its chunk j's real elements: 0 to C_k of them."""
        C, n = self.chunks[k], self.segments[k][1]
        return j * C, max(min(C, n - j * C), 0)

    def gather(self, flat: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Rows ``rows`` of ``flat`` (anything indexed like the flat buffer) as a new
        (len(rows), S) tensor, padding zero."""
        parts = []
        for j in rows:
            for k, at, _, length in self.pieces(j):
                parts.append(flat[at:at + length])
                if length < self.chunks[k]:
                    parts.append(flat.new_zeros(self.chunks[k] - length))
        return torch.cat(parts).view(len(rows), self.S)

    def scatter(self, x_RS: torch.Tensor, rows: Sequence[int], flat: torch.Tensor) -> None:
        """Write rows ``rows`` of the layout (``x_RS``, one row each) back into ``flat``
        (padding is dropped)."""
        for i, j in enumerate(rows):
            for _, at, pos, length in self.pieces(j):
                flat[at:at + length].copy_(x_RS[i, pos:pos + length])

    def tensor_of(self, x_WS: torch.Tensor, k: int) -> torch.Tensor:
        """Tensor k's n_k elements from all W rows of the layout (a new tensor)."""
        s, C, n = self.starts[k], self.chunks[k], self.segments[k][1]
        return x_WS[:, s:s + C].reshape(-1)[:n]

    def expand(self, x_T: torch.Tensor) -> torch.Tensor:
        """(S,): tensor k's value ``x_T[k]`` over its chunk of a row, padding included."""
        return x_T.repeat_interleave(torch.tensor(self.chunks, device=x_T.device),
                                     output_size=self.S)

    def ids(self, j: int, device: torch.device | str) -> torch.Tensor:
        """Each element's tensor index in row j (T for padding): built when needed, not kept
        (S int64s would outweigh the fp32 state they index)."""
        values, lengths = [], []
        for k, _, _, length in self.pieces(j):
            values += [k, self.T]
            lengths += [length, self.chunks[k] - length]
        return torch.tensor(values, device=device).repeat_interleave(
            torch.tensor(lengths, device=device))

    def row_sums(self, x_RS: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """(R, T + 1): per row, the sum of each tensor's elements (the last column: padding),
        accumulated in element order (index_add_ on a 1-D tensor is a serial loop)."""
        out = x_RS.new_zeros(len(rows), self.T + 1)
        for i, j in enumerate(rows):
            out[i].index_add_(0, self.ids(j, x_RS.device), x_RS[i])
        return out

    def row_maxes(self, x_RS: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """(R, T + 1): per row, the largest element of each tensor (-inf where a row has none)."""
        out = x_RS.new_full((len(rows), self.T + 1), float("-inf"))
        for i, j in enumerate(rows):
            out[i].scatter_reduce_(0, self.ids(j, x_RS.device), x_RS[i], "amax")
        return out
