"""Attention for the decoder (troupe.models.gpt): grouped-query heads with rotary or learned
positions, q and k norms, sliding windows; the KV cache it extends when decoding; the prefix
tree that runs a shared prompt once for many responses; and the masks (causal over real keys,
within a window)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from troupe.collectives import Communicator, copy_in
from troupe.kernels.decode_attention import decode_attention
from troupe.models.layers import (RMSNorm, apply_rope, row_parallel, rope_angles,
                                  rope_attention_factor, rope_frequencies)

if TYPE_CHECKING:
    from troupe.models.gpt import GPTConfig


@dataclass
class KVCache:
    """Keys and values of every layer for a batch, (B, Hkv, max_len, head size) each; ``length``
    positions are filled."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, cfg: GPTConfig, batch: int, max_len: int, device=None,
              dtype: torch.dtype = torch.float32) -> "KVCache":
        shape = (batch, cfg.kv_heads, max_len, cfg.head_size)
        return cls([torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
                   [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)])

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this step's keys and values after the ``length`` filled positions (in place,
        no autograd) and return views of everything so far."""
        L, T = self.length, k.shape[2]
        self.k[layer][:, :, L:L + T] = k
        self.v[layer][:, :, L:L + T] = v
        return self.k[layer][:, :, :L + T], self.v[layer][:, :, :L + T]

    def advance(self, T: int) -> None:
        """The pass's T tokens are in: count them (GPT.hidden, after every layer extended)."""
        self.length += T


@dataclass
class RowCache:
    """Keys and values of rows that each have a length of their own, (B, Hkv, capacity, head
    size) per layer: row b's first ``lengths[b]`` positions are filled, with no gaps, so a
    token's column is its position. A pass of T tokens writes row b's at columns lengths[b]
    to lengths[b] + T - 1, in place, and each attends to its row's columns up to its own. The
    rows are the generation engine's slots (troupe.generation.slots): a sequence joins by
    being written into a free row and leaves by its row being given up, and rows that advance
    by different counts (speculative decoding's accepted tokens) need nothing more.

    ``lengths`` (B,) int64 on the cache's device is a view of the engine's, advanced in place.
    ``span``: max(lengths) + T, the columns the pass reads, given by the caller (who knows the
    lengths on the host: no device read a pass). ``counts`` (B,): how many of the T tokens are
    real in each row (a right-padded prefill; None: all T), what ``advance`` adds; a padding
    token's keys and values are not written (the columns past a row's length are never seen,
    but they enter the attention's product with weight 0: they must stay finite). With one
    token a row, a count of 0 marks a padding row (a static step's batch padded to its size
    on free slots): it writes its own slot's next column, which nothing reads, and keeps its
    length (no data-dependent shapes in the step)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: torch.Tensor
    span: int
    counts: torch.Tensor | None = None
    _where: tuple | None = field(default=None, repr=False)  # the pass's write indices

    def positions(self, T: int) -> torch.Tensor:
        """(B, T): the pass's tokens' positions, each row's from its own length."""
        return self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def mask(self, T: int) -> torch.Tensor:
        """(B, 1, T, span): each token sees its row's columns up to its own."""
        columns = torch.arange(self.span, device=self.lengths.device)
        return (columns[None, None, :] <= self.positions(T)[:, :, None]).unsqueeze(1)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write the pass's keys and values (B, Hkv, T, D) at each row's columns; views of the
        ``span`` columns the pass reads."""
        B, _, T, _ = k.shape
        if self._where is None:  # the same for every layer of the pass
            rows = torch.arange(B, device=k.device)[:, None].expand(B, T)
            real = None if self.counts is None or T == 1 else \
                torch.arange(T, device=k.device)[None] < self.counts[:, None]
            columns = self.positions(T)
            self._where = (rows, columns, None) if real is None else \
                (rows[real], columns[real], real)  # the real tokens only
        rows, columns, real = self._where
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, T, Hkv, D), as indexed
        if real is not None:
            k, v = k[real], v[real]
        self.k[layer][rows, :, columns] = k  # index_put_, in place
        self.v[layer][rows, :, columns] = v
        return self.k[layer][:, :, :self.span], self.v[layer][:, :, :self.span]

    def advance(self, T: int) -> None:
        self.lengths += T if self.counts is None else self.counts


class PrefixTree:
    """Rows that share prefixes, each prefix computed once, in one pass: GRPO's samples of a
    prompt continue that prompt, and prompts that open with the same system prompt continue
    that opening. The tree is a list of levels, each a (rows, width) block of tokens whose
    row i continues row ``parents[i]`` of the level before (the first level has no parent);
    ``valid`` (rows, width) marks each level's real tokens (the rest is padding).

    ``GPT.hidden(tree.pack(ids), cache=tree)`` runs every level's tokens side by side as one
    sequence: every weight is read, and its gradient written, once a
    layer, as for one batch (a pass per level would write each weight's gradient once per
    level). Only attention sees the levels: a row attends causally to its own tokens and to
    all of its ancestors' (their keys and values gathered for it), as if the row held its
    whole path. Values and gradients are those of running every row whole, up to the order
    of float sums, for each prefix's compute once (Prefix Grouper, Liu et al. 2025).
    ``unpack`` splits the hidden states back into the levels.
    """

    def __init__(self, levels: list[tuple[torch.Tensor | None, torch.Tensor]]):
        """``levels``: (parents, valid) per level, root first (its parents None)."""
        self.valid = [v for _, v in levels]
        self.length = 0  # GPT.hidden's cache protocol: positions come from the tree
        device = self.valid[0].device
        # index[l][j]: for each row of level l, its ancestor row in level j (j <= l)
        self.index: list[list[torch.Tensor]] = []
        for parents, valid in levels:
            own = torch.arange(len(valid), device=device)
            up = [i.index_select(0, parents) for i in self.index[-1]] if self.index else []
            self.index.append(up + [own])
        # each level's keys: its ancestors' columns, then its own; masks and positions
        self.masks, self.key_positions, pos = [], [], []
        for l, valid in enumerate(self.valid):
            path = torch.cat([self.valid[j].index_select(0, self.index[l][j])
                              for j in range(l)] + [valid], 1)
            self.masks.append(attention_mask(path, valid.shape[1]))
            self.key_positions.append((path.long().cumsum(1) - 1).clamp_min(0))
            pos.append(self.key_positions[-1][:, -valid.shape[1]:])
        self.positions = torch.cat([p.reshape(1, -1) for p in pos], 1)  # (1, tokens)
        self.windowed: dict[int, list[torch.Tensor]] = {}  # window -> each level's mask
        self.sizes = [v.numel() for v in self.valid]
        self.span = sum(v.shape[1] for v in self.valid)  # a row's whole path, padding included

    def advance(self, T: int) -> None:
        """GPT.hidden's cache protocol (a tree's positions are its own: nothing to count)."""

    def pack(self, ids: list[torch.Tensor]) -> torch.Tensor:
        """(1, all levels' positions): the levels' (rows, width) ids laid end to end."""
        return torch.cat([x.reshape(1, -1) for x in ids], 1)

    def unpack(self, h_1TC: torch.Tensor) -> list[torch.Tensor]:
        """Per level, its (rows, width, C) part of a packed (1, tokens, C)."""
        return [x.view(*v.shape, -1)
                for x, v in zip(h_1TC[0].split(self.sizes), self.valid)]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
               gqa: bool, window: int | None = None) -> torch.Tensor:
        """Attention over the tree: q (1, H, tokens, D), k and v (1, Hkv, tokens, D) of the
        packed sequence -> (1, H, tokens, D); within ``window`` positions when given."""
        def levels(x):  # (1, h, tokens, D) -> per level (rows, h, width, D)
            return [part.view(x.shape[1], *val.shape, x.shape[3]).transpose(0, 1)
                    for part, val in zip(x[0].split(self.sizes, 1), self.valid)]
        qs, ks, vs = levels(q), levels(k), levels(v)
        masks = self.masks
        if window is not None and window < self.span:
            if window not in self.windowed:
                self.windowed[window] = [
                    within_window(m, kp[:, -v.shape[1]:], kp, window)
                    for m, kp, v in zip(self.masks, self.key_positions, self.valid)]
            masks = self.windowed[window]
        out = []
        for l in range(len(qs)):
            keys = torch.cat([ks[j].index_select(0, self.index[l][j]) for j in range(l + 1)], 2)
            values = torch.cat([vs[j].index_select(0, self.index[l][j])
                                for j in range(l + 1)], 2)
            y = F.scaled_dot_product_attention(qs[l], keys, values, attn_mask=masks[l],
                                               dropout_p=dropout, enable_gqa=gqa)
            out.append(y.transpose(0, 1).reshape(y.shape[1], -1, y.shape[3]))
        return torch.cat(out, 1).unsqueeze(0)


class Attention(nn.Module):
    """Causal self-attention; q, k and v come from one projection (q heads, then k and v with
    ``n_kv_head`` heads each); rotary positions when the config says so. ``tp``: the
    tensor-parallel group, once troupe.parallel.tensor has kept this rank's heads
    (``n_head`` and ``n_kv`` then count this rank's)."""

    def __init__(self, cfg: GPTConfig, window: int | None = None):
        super().__init__()
        self.n_head, self.n_kv, self.dropout = cfg.n_head, cfg.kv_heads, cfg.dropout
        self.head_dim = cfg.head_size
        self.window = window  # sliding: keys fewer than ``window`` positions back (GPT.hidden)
        # troupe's own GPT has no qkv bias: a key bias gets exactly zero gradient (softmax
        # ignores a shift shared by all keys), so its frozen variance would be zero and 1-bit
        # momentum noise would blow it up. Qwen2 has one.
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * self.n_kv) * self.head_dim,
                             bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=cfg.out_bias)
        self.rope = cfg.positions == "rope"
        if self.rope:
            self.register_buffer("inv_freq", rope_frequencies(
                self.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)
            self.rope_scale = rope_attention_factor(cfg.rope_scaling)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.tp: Communicator | None = None

    def forward(self, x_BTC: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | RowCache | PrefixTree | None = None, layer: int = 0,
                pos: torch.Tensor | None = None, angles=None) -> torch.Tensor:
        """``angles``: the rotary cos and sin of ``pos`` when the caller computed them once
        for all layers (GPT.hidden); else they come from ``pos`` (default 0..T-1)."""
        B, T, _ = x_BTC.shape
        H, Hkv, D = self.n_head, self.n_kv, self.head_dim
        tp = self.tp
        qkv = self.qkv(x_BTC if tp is None else copy_in(x_BTC, tp)).view(B, T, H + 2 * Hkv, D)
        if self.qk_norm:  # the norms' weights serve every head: summed over a split's ranks
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
            qkv = torch.cat([self.q_norm(q, tp), self.k_norm(k, tp), v], 2)
        if self.rope:  # q and k rotated together (their heads side by side in qkv)
            if angles is None:
                pos = torch.arange(T, device=x_BTC.device) if pos is None else pos
                angles = rope_angles(pos, self.inv_freq, self.rope_scale)
            q, k = apply_rope(qkv[:, :, :H + Hkv], angles).split([H, Hkv], dim=2)
            v = qkv[:, :, H + Hkv:]
        else:
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        dropout = self.dropout if self.training else 0.0
        gqa = Hkv != H  # grouped-query attention: each k/v head serves H / Hkv query heads,
        # read in place by the attention kernel (no copy of the cache per step)
        if isinstance(cache, PrefixTree):
            y = cache.attend(q, k, v, dropout, gqa, self.window)
            return row_parallel(self.proj, y.transpose(1, 2).reshape(B, T, H * D), tp)
        if cache is not None:  # append this step's keys and values, attend over all so far
            k, v = cache.extend(layer, k, v)
        # a decode step on the CPU: the native kernel (None where it does not apply)
        y = decode_attention(q, k, v, mask) if cache is not None and T == 1 and not dropout \
            else None
        if y is not None:
            return row_parallel(self.proj, y.transpose(1, 2).reshape(B, T, H * D), tp)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, dropout_p=dropout,
                                               enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                               enable_gqa=gqa)
        return row_parallel(self.proj, y.transpose(1, 2).reshape(B, T, H * D), tp)


def attention_mask(valid_BS: torch.Tensor, T: int) -> torch.Tensor:
    """(B, 1, T, S) boolean mask for the last T of S positions: causal, real keys only, and
    each query may always see itself (so padding rows are not empty)."""
    B, S = valid_BS.shape
    q = torch.arange(S - T, S, device=valid_BS.device)[:, None]
    k = torch.arange(S, device=valid_BS.device)[None, :]
    mask = (k <= q) & valid_BS[:, None, :]
    return (mask | (k == q)).unsqueeze(1)


def within_window(mask: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  window: int) -> torch.Tensor:
    """``mask`` (B, 1, T, S) narrowed to a sliding window: a query at position p sees only
    keys at positions above p - window (itself and the window - 1 before it). Positions
    count real tokens: q_pos (B or 1, T), k_pos (B or 1, S). A mask of None is causal over
    the positions (as ``is_causal``)."""
    gap = (q_pos[:, :, None] - k_pos[:, None, :]).unsqueeze(1)  # (B, 1, T, S)
    if mask is None:
        return (gap >= 0) & (gap < window)
    return mask & (gap < window)
