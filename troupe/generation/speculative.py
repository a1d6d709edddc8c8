"""Speculative decoding by prompt lookup: more than one token out of each read of the weights.

At a small batch a decode step is bound by reading every weight once for one token a row. A
sequence whose next tokens repeat something in its own context (an edit or summary of a given
text, code, a tool call's arguments) can have them proposed by looking its last few tokens up
in that context (prompt lookup, as vLLM's n-gram proposer): ``PromptLookup`` proposes the k
tokens that followed the latest earlier occurrence of the longest suffix (``max_n`` tokens down
to ``min_n``) that occurred before.

``verify`` runs each row's last token and its proposals through the model in one pass, each at
its own position of the row's cache (the native step takes them as rows of their own reading
one cache row: troupe.generation.decode_layers), and then chooses the row's tokens one position
at a time with the engine's own sampler (``choose``: grammar, logit adjustments, logprobs and
all), keeping going while the token chosen is the one proposed. So the tokens are exactly those
of decoding without speculation: a greedy choice is the same argmax, and a sampled one the same
counter-based draw (troupe.generation.sampling.uniform: the seed and the output position pick
it, not the number of passes), up to the float rounding of the logits (the verify pass sums in
another order). For a proposal that is one token, this "draw, then compare" is the rejection
rule of Leviathan et al. (accept with probability p(x), else draw from p without x). The cache
rolls back by length alone: a row keeps its columns up to its last accepted token, and the
rejected ones' keys past it are overwritten by its next tokens.
"""

from __future__ import annotations

import contextlib

import torch

from troupe.generation.sampling import finite_rows
from troupe.generation.sequence import Event, Sequence, choose
from troupe.generation.slots import right_padded
from troupe.kernels.small_gemm import MAX_ROWS


class PromptLookup:
    """Proposals for one sequence from its own tokens (prompt and output), indexed as they come:
    each n-gram (n = min_n..max_n) that has a token after it, by its latest start."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.index: dict[tuple[int, ...], int] = {}
        self.done = 1  # the tokens indexed as what followed the n-grams before them

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's
        longest suffix found (none: [])."""
        L = len(context)
        for j in range(self.done, L):  # each n-gram that token j followed
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self.index[tuple(context[j - n:j])] = j - n
        self.done = max(self.done, L)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            at = self.index.get(tuple(context[L - n:]))
            if at is not None:
                return context[at + n:at + n + k]
        return []


def proposals(seqs: list[Sequence], k: int, room: list[int], draft=None) -> list[list[int]]:
    """Each sequence's proposals, from ``draft`` (troupe.generation.draft.DraftModel) or by
    prompt lookup: at most ``k``, at most one fewer than the tokens it may still make (the
    pass's own token counts), and within ``room`` (the columns its slot has left)."""
    want = [max(min(k, s.params.max_tokens - len(s.out) - 1, free - 1), 0)
            for s, free in zip(seqs, room)]
    if draft is not None:
        return draft.propose([s.prompt + s.out for s in seqs], want)
    out = []
    for s, left in zip(seqs, want):
        if s.lookup is None:
            s.lookup = PromptLookup()
        out.append(s.lookup.propose(s.prompt + s.out, left) if left else [])
    return out


def accept(seqs: list[Sequence], props: list[list[int]], logits: torch.Tensor,
           greedy: list[int], finite: list[bool], eos_id: int | None
           ) -> tuple[list[Event], list[int]]:
    """Choose each row's tokens from the verify pass's logits (N rows, row b's 1 + len(props[b])
    of them in order) while they agree with the proposals; the events and, per row, how many
    proposals were accepted."""
    events, matched, at = [], [], 0
    for s, p in zip(seqs, props):
        n = 0
        for t in range(len(p) + 1):
            i = at + t
            [ev] = choose([s], eos_id, logits[i:i + 1], [greedy[i]], [finite[i]])
            events.append(ev)
            if ev.finish_reason is not None or t == len(p) or ev.token != p[t]:
                break
            n += 1
        matched.append(n)
        at += len(p) + 1
    return events, matched


def step(engine, seqs: list[Sequence], k: int) -> list[Event] | None:
    """One speculative step of ``engine`` (a ContinuousBatcher) for its batch ``seqs`` (slots
    0 .. B - 1): proposals, one verify pass, the tokens accepted; None when no row has a
    proposal (the engine's ordinary step is then the cheaper one)."""
    slots = engine.slots
    B = len(seqs)
    lengths = slots.host[:B]
    props = proposals(seqs, k, [slots.context - n for n in lengths], engine.draft)
    if _native(engine):  # the verify in one native call: its rows at most MAX_ROWS (a
        # batch of more rows than that, as a speculate_batch above it allows, proposes none)
        while any(props) and sum(len(p) + 1 for p in props) > MAX_ROWS:
            max(props, key=len).pop()
    if not any(props):
        if engine.draft is not None:  # it caught up: within what the target will have run
            for b, n in enumerate(lengths):
                engine.draft.rolled_back(b, n + 1)
        return None
    rows = [b for b, p in enumerate(props) for _ in range(len(p) + 1)]
    cols = [lengths[b] + t for b, p in enumerate(props) for t in range(len(p) + 1)]
    tokens = [t for s, p in zip(seqs, props) for t in (s.out[-1], *p)]
    slots.reserve(B, max(cols) + 1)
    logits, greedy, finite = _verify(engine, seqs, props, tokens, rows, cols)
    events, matched = accept(seqs, props, logits, greedy, finite, engine.eos_id)
    for b, n in enumerate(matched):  # the rejected proposals' columns are dropped
        slots.set_length(b, lengths[b] + 1 + n)
        if engine.draft is not None:
            engine.draft.rolled_back(b, lengths[b] + 1 + n)
    stats = engine.speculation
    stats["passes"] += 1
    stats["proposed"] += sum(map(len, props))
    stats["accepted"] += sum(matched)
    return events


def _native(engine) -> bool:
    """Whether the verify can run as one native call (the decode step's own kernels: the same
    numbers a row gets decoding, which the W8A8 layers' token-wise rounding would otherwise
    amplify into other tokens)."""
    fused = engine._fused()
    return fused is not None and fused.has_logits and engine.slots.dtype == torch.float32


def _verify(engine, seqs, props, tokens, rows, cols):
    """The verify pass: the logits (N, V) of every token run, each row's greedy choice and
    finiteness; through the native step where it applies, else the model's own, right-padded."""
    slots, device = engine.slots, engine.device
    names = [s.params.adapter for s in seqs]
    fused = engine._fused()
    if _native(engine) and len(tokens) <= MAX_ROWS:
        per_token = [names[b] for b in rows]
        adapter_slots = engine.adapters.slot_ids(per_token) if engine._adapted() else None
        with engine._routed(per_token) if fused.routed else contextlib.nullcontext():
            return fused.tokens(torch.tensor(tokens, device=device),
                                torch.tensor(rows, device=device),
                                torch.tensor(cols, device=device), slots.k, slots.v,
                                max(cols) + 1, adapter_slots)
    idx, counts = right_padded([[s.out[-1], *p] for s, p in zip(seqs, props)],
                               engine.eos_id or 0)
    T = idx.shape[1]
    with engine._routed(names), engine._products():
        h, _ = engine.model.hidden(idx.to(device), cache=slots.view(0, len(seqs), T, counts))
    real = torch.arange(T)[None] < torch.tensor(counts)[:, None]  # host: (as idx)
    logits = engine._logits(h[real.to(device)])
    return logits, logits.argmax(-1).tolist(), finite_rows(logits).tolist()
