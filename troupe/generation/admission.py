"""How the engine's newcomers are prefilled (troupe.generation.engine): which prompts run from
a cached prefix, which run together, and the opening that prompts admitted together share.

A prompt that several newcomers share (GRPO's samples, a request's n choices) runs once. With
a prefix cache (troupe.generation.prefix_cache), a prompt whose start is cached runs from there
(a "hit"); the others run together, right-padded, those that begin alike (requests over one
system prompt arriving together) in a prefill of their own that runs their common opening once.
The cache's hit rate counts the tokens of either kind that were not run again."""

from __future__ import annotations

import os

SHARED_OPENING = 16  # tokens: a shorter opening shared by a prefill's prompts runs with each


def shared_opening(prompts: list[list[int]]) -> int:
    """How many first tokens all ``prompts`` share, leaving each at least one of its own."""
    return min(len(os.path.commonprefix(prompts)), min(len(x) for x in prompts) - 1)


def opening(prompts: list[list[int]], adapters: list) -> int:
    """The opening a prefill of ``prompts`` runs once: their shared first tokens when there
    are SHARED_OPENING of them or more under one adapter, else 0."""
    if len(prompts) < 2 or len(set(adapters)) != 1:
        return 0
    L = shared_opening(prompts)
    return L if L >= SHARED_OPENING else 0


def plan(seqs: list, cache, namespace) -> tuple[list[tuple], list[list]]:
    """The prefills of newcomers ``seqs`` (each with ``prompt`` and ``params.adapter``) under
    the prefix ``cache`` (``namespace(adapter)``: its key space): the hits, (prompt, cached
    tokens, their blocks, the sequences of that prompt) each, and the groups of sequences
    that run together."""
    groups: dict[tuple, list] = {}
    for s in seqs:
        groups.setdefault((tuple(s.prompt), s.params.adapter), []).append(s)
    hits, starts = [], {}
    for (prompt, adapter), group in groups.items():
        n, blocks = cache.lookup(list(prompt), namespace(adapter))
        if n:
            cache.record(len(prompt), n)
            hits.append((list(prompt), n, blocks, group))
        else:  # by their first block and adapter (a short prompt: by itself)
            start = (prompt[:cache.block], adapter) if len(prompt) > cache.block else prompt
            starts.setdefault(start, []).append(((prompt, adapter), group))
    together, alone = [], []
    for members in starts.values():
        prompts = [list(prompt) for (prompt, _), _ in members]
        L = opening(prompts, [adapter for (_, adapter), _ in members])
        for i, prompt in enumerate(prompts):
            cache.record(len(prompt), L if i else 0)
        (together.append if L else alone.append)([s for _, group in members for s in group])
    return hits, together + ([sum(alone, [])] if alone else [])
