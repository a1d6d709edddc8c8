"""The engine's KV cache (troupe.generation.engine): one row, a slot, per sequence of the batch,
each with a length of its own. Rows are written in place at each sequence's own position
(troupe.models.RowCache), so a sequence joins by being written into a free slot and leaves by
giving its slot up: nothing else in the cache moves. The live sequences keep the first slots
(a leaving one's slot goes to the last live row, whose positions alone are copied), so that
every pass reads one contiguous range of rows, as views.

Slots and columns grow by doubling (up to ``max_rows`` and the model's context) when the batch
or its longest row needs more: every row copied then, a logarithmic number of times in a run.
``Slots(cfg, max_rows, max_rows, context, ...)`` preallocates them all, as a captured decode
step needs its buffers never to move."""

from __future__ import annotations

import torch

from troupe.models import RowCache


class Slots:
    """Up to ``max_rows`` slots of keys and values for every layer of a model of config
    ``cfg`` (``rows`` and ``columns`` of them to begin with; ``kv_heads``: the heads a layer's
    cache holds, when not the config's); ``lengths`` on the device and
    ``host`` (the same, on the host) count each slot's filled positions."""

    def __init__(self, cfg, max_rows: int, rows: int, columns: int, device, dtype: torch.dtype,
                 context: int | None = None, kv_heads: int | None = None):
        self.max_rows, self.device, self.dtype = max_rows, device, dtype
        self.context = min(context or cfg.seq_len, cfg.seq_len)  # the most columns a row has
        rows, columns = min(rows, max_rows), min(columns, self.context)
        # a tensor-parallel rank's cache holds its own key/value heads (GPT.cache_heads)
        shape = (rows, kv_heads or cfg.kv_heads, columns, cfg.head_size)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.host = [0] * rows

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def columns(self) -> int:
        return self.k[0].shape[2]

    def view(self, first: int, end: int, new: int, counts: list[int] | None = None) -> RowCache:
        """Rows ``first``..``end`` - 1 for a pass of ``new`` tokens a row (``counts``: the
        real ones of each row, when fewer), with room made for them; the host lengths counted
        as the pass will."""
        span = max(self.host[first:end]) + new
        self.reserve(end, span)
        for i in range(first, end):
            self.host[i] += new if counts is None else counts[i - first]
        return RowCache([t[first:end] for t in self.k], [t[first:end] for t in self.v],
                        self.lengths[first:end], span,
                        None if counts is None else torch.tensor(counts, device=self.device))

    def reserve(self, rows: int, columns: int) -> None:
        """At least ``rows`` slots of ``columns`` columns (each doubling, within its limit)."""
        if rows <= self.rows and columns <= self.columns:
            return
        if columns > self.context:
            raise RuntimeError(f"KV cache is full: a sequence needs {columns} positions of the "
                               f"model's {self.context}")
        if rows > self.max_rows:
            raise RuntimeError(f"{rows} slots asked of an engine of {self.max_rows}")
        R = self.rows if rows <= self.rows else min(max(2 * self.rows, rows), self.max_rows)
        C = (self.columns if columns <= self.columns
             else min(max(2 * self.columns, columns), self.context))
        for kind in (self.k, self.v):
            for i, t in enumerate(kind):
                bigger = t.new_zeros(R, t.shape[1], C, t.shape[3])
                bigger[:t.shape[0], :, :t.shape[2]] = t
                kind[i] = bigger
        lengths = self.lengths.new_zeros(R)
        lengths[:self.lengths.shape[0]] = self.lengths
        self.lengths, self.host = lengths, self.host + [0] * (R - len(self.host))

    def fill(self, row: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Slot ``row`` holds the given positions (per layer (Hkv, n, D): a cached prefix, an
        opening run once) and nothing after them."""
        n = k[0].shape[1]
        self.reserve(row + 1, n)
        for ours, theirs in zip(self.k + self.v, k + v):
            ours[row, :, :n] = theirs
        self.set_length(row, n)

    def copy(self, src: int, dst: int) -> None:
        """Slot ``dst`` becomes a copy of slot ``src`` (its filled positions)."""
        n = self.host[src]
        self.reserve(dst + 1, n)
        for t in self.k + self.v:
            t[dst, :, :n] = t[src, :, :n]
        self.set_length(dst, n)

    def set_length(self, row: int, n: int) -> None:
        self.host[row] = n
        self.lengths[row] = n

    def keys(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Slot ``row``'s filled positions, per layer (Hkv, length, D) views."""
        n = self.host[row]
        return [t[row, :, :n] for t in self.k], [t[row, :, :n] for t in self.v]

    def keep(self, live: list[int], spoilt: list[int] = ()) -> list[int]:
        """Only the slots ``live`` stay, as slots 0 .. len(live) - 1: one already there stays
        put, one after them takes a free one (its positions alone copied). ``spoilt``: slots
        given up that may hold non-finite keys or values (a sequence whose logits were not
        finite), zeroed: a later row's columns past its length enter its attention with
        weight 0. Returns, for each new slot, the old slot it holds."""
        for row in spoilt:
            for t in self.k + self.v:
                t[row].zero_()
        order: list[int | None] = [None] * len(live)
        movers = []
        for row in live:
            if row < len(live):
                order[row] = row
            else:
                movers.append(row)
        free = [j for j, held in enumerate(order) if held is None]
        for src, dst in zip(movers, free):
            self.copy(src, dst)
            order[dst] = src
        for row in range(len(live), self.rows):
            self.host[row] = 0
        self.lengths[len(live):] = 0
        return order

    def clear(self, zero: bool = True) -> None:
        """Every slot free; zeroed unless ``zero`` is False (after a failed step what it wrote
        is unknown; slots whose sequences all ended, as an engine reusing them finds them,
        hold finite values: ``keep`` zeroes the others)."""
        self.host = [0] * self.rows
        self.lengths.zero_()
        for t in self.k + self.v if zero else ():
            t.zero_()

    def used(self, live: int) -> int:
        """Positions held by the first ``live`` slots."""
        return sum(self.host[:live])


def right_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, list[int]]:
    """``rows`` of tokens as one (B, longest) int64 tensor in host memory, each padded on the
    right with ``pad`` (a pass over slots: ``Slots.view(..., counts)`` writes only the real
    ones), and each row's count."""
    counts = [len(r) for r in rows]
    idx = torch.full((len(rows), max(counts)), pad, dtype=torch.long)  # host: moved in one copy
    for i, r in enumerate(rows):
        idx[i, :len(r)] = torch.tensor(r)  # host: (as idx)
    return idx, counts
