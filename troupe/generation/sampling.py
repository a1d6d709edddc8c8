"""Sampling one token from next-token logits: temperature, nucleus (top-p), a seed per
sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: tokens to generate at most; temperature 0 is greedy decoding; top_p keeps
    the smallest set of tokens whose probability adds up to it; seed makes sampling
    repeatable; stop: strings that end the text (not included in it)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


def sample(logits_V: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """A token from one sequence's logits (V,): argmax at temperature 0, else a draw from the
    tempered (and top-p truncated) distribution with the sequence's CPU generator."""
    if p.temperature <= 0:
        return int(logits_V.argmax())
    probs = torch.softmax(logits_V.float().cpu() / p.temperature, -1)  # the generator is a CPU one
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # the first token is always kept
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
