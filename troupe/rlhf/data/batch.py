"""Turning text into the left-padded tensors the roles work on."""

from __future__ import annotations

import torch

from troupe.data import Tokenizer


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, valid), both (B, max length), real tokens right-aligned; in host memory, as batches
    travel between the roles (troupe.wire)."""
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad_id, dtype=torch.long)  # host: a batch between roles
    valid = torch.zeros(len(seqs), S, dtype=torch.bool)  # host: (as ids)
    for i, s in enumerate(seqs):
        if s:
            ids[i, S - len(s):] = torch.tensor(s)  # host: (as ids)
            valid[i, S - len(s):] = True
    return ids, valid


def prompts(tok: Tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as the model sees them (through its chat template, if it uses one)."""
    return left_pad([tok.prompt(t) for t in texts], tok.pad_id)


def completions(tok: Tokenizer, prompt_texts: list[str], responses: list[str]):
    """Prompt + response + eos, left-padded: (ids, valid, response_mask) where response_mask
    (B, S-1) marks the next-token targets that belong to the response (its eos included)."""
    seqs, starts = [], []
    for p, r in zip(prompt_texts, responses):
        pi = tok.prompt(p)
        seqs.append(pi + tok.encode(r) + [tok.eos_id])
        starts.append(len(pi))
    ids, valid = left_pad(seqs, tok.pad_id)
    S = ids.shape[1]
    mask = torch.zeros(len(seqs), S - 1, device=ids.device)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        first = S - len(s) + start  # index of the first response token
        mask[i, first - 1:] = 1.0  # target t+1 is predicted at t
    return ids, valid, mask


def split_completions(tok: Tokenizer, prompt_texts: list[str], responses: list[str]):
    """Prompt + response + eos with the prompts left-padded to a common ``prompt_len`` columns
    and the responses after them, right-padded: (ids, valid, response_mask, prompt_len), the
    mask as ``completions``'. The layout of rollouts, so that rows sharing a prompt (DPO's
    chosen and rejected) or an opening (a system prompt) run it once
    (``GPTLM.token_logprobs``' ``prompt_len``)."""
    ps = [tok.prompt(p) for p in prompt_texts]
    rs = [tok.encode(r) + [tok.eos_id] for r in responses]
    P, R = max(map(len, ps)), max(map(len, rs))
    ids = torch.full((len(ps), P + R), tok.pad_id, dtype=torch.long)  # host: (as left_pad's)
    valid = torch.zeros(len(ps), P + R, dtype=torch.bool)  # host: (as ids)
    mask = torch.zeros(len(ps), P + R - 1)  # host: (as ids)
    for i, (p, r) in enumerate(zip(ps, rs)):
        ids[i, P - len(p):P + len(r)] = torch.tensor(p + r)  # host: (as ids)
        valid[i, P - len(p):P + len(r)] = True
        mask[i, P - 1:P - 1 + len(r)] = 1.0  # target t+1 is predicted at t
    return ids, valid, mask, P


def response_mask(response_BN: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 for generated tokens up to and including the first eos, 0 after it."""
    is_eos = (response_BN == eos_id).long()
    before = is_eos.cumsum(1) - is_eos  # eos tokens strictly before position t
    return (before == 0).float()
