"""The batch's shared KV cache, as the engine (troupe.generation.engine) lays it out: one cache
of B rows and C columns whose filled columns end at ``cache.length`` for every row, each row's
tokens right-aligned there, the columns before a row's first token invalid (``valid``, (B, C'):
exactly a left-padded batch). These functions return the cache and mask changed; the engine
holds them."""

from __future__ import annotations

import torch

from troupe.models import KVCache


def with_room(cache: KVCache, valid: torch.Tensor, context: int) -> tuple[KVCache, torch.Tensor]:
    """A free column for the next token: the cache doubles its columns (up to the model's
    ``context``), and at the context drops the columns no sequence uses any more. The cache
    holds as many columns as the batch needs, not the whole context: copying it (retiring,
    merging) costs what the sequences use."""
    capacity = cache.k[0].shape[2]
    if cache.length + 1 <= capacity:
        return cache, valid
    if capacity < context:
        return placed(cache, valid, cache.length, min(max(2 * capacity, cache.length + 1),
                                                      context))
    return compacted(cache, valid)


def merged(cache: KVCache, valid: torch.Tensor, new: KVCache,
           new_valid: torch.Tensor) -> tuple[KVCache, torch.Tensor]:
    """The rows of ``new`` (a prefill's) below those of ``cache``, both right-aligned to the
    longer of the two."""
    L = max(cache.length, new.length)
    C = max(cache.k[0].shape[2], new.k[0].shape[2], L)
    old, old_valid = placed(cache, valid, L, C)
    new, new_valid = placed(new, new_valid, L, C)
    return (KVCache([torch.cat([a, b]) for a, b in zip(old.k, new.k)],
                    [torch.cat([a, b]) for a, b in zip(old.v, new.v)], L),
            torch.cat([old_valid, new_valid]))


def compacted(cache: KVCache, valid: torch.Tensor) -> tuple[KVCache, torch.Tensor]:
    """Leading columns that no row uses any more dropped (in place)."""
    first = int(valid.float().argmax(1).min())  # earliest real column of any row
    if first == 0:
        raise RuntimeError("KV cache is full: a sequence reached the model's context")
    L = cache.length - first
    for t in cache.k + cache.v:
        t[:, :, :L] = t[:, :, first:first + L].clone()
    cache.length = L
    return cache, valid[:, first:]


def select_rows(cache: KVCache, valid: torch.Tensor,
                index: list[int]) -> tuple[KVCache, torch.Tensor]:
    """Rows ``index`` of the cache and mask (a row may be taken twice)."""
    at = torch.tensor(index, device=valid.device)
    return (KVCache([t.index_select(0, at) for t in cache.k],
                    [t.index_select(0, at) for t in cache.v], cache.length),
            valid.index_select(0, at))


def placed(cache: KVCache, valid: torch.Tensor, L: int, C: int) -> tuple[KVCache, torch.Tensor]:
    """The cache with C columns, its filled ones moved right to end at column L; the columns
    before them are invalid (and zero: masked columns still enter the product, no NaN)."""
    d = L - cache.length
    if d == 0 and C == cache.k[0].shape[2]:
        return cache, valid
    k, v = [], []
    for src, dst in ((cache.k, k), (cache.v, v)):
        for t in src:
            B, H, _, D = t.shape
            moved = t.new_zeros(B, H, C, D)
            moved[:, :, d:L] = t[:, :, :cache.length]
            dst.append(moved)
    pad = valid.new_zeros(valid.shape[0], d)
    return KVCache(k, v, L), torch.cat([pad, valid], 1)
