"""What crosses between the RLHF driver and its role workers: rollout requests and rollouts,
the experience PPO trains on, and each step's statistics. Sequences are left-padded prompts
followed by responses; S is the sequence length, and per-token quantities have S - 1 entries
(the target at t + 1 is predicted at t)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from troupe.actors.dispatch import even_bounds


def _split_rows(obj: Any, n: int) -> list[Any]:
    """``obj`` (a dataclass whose fields are per-row tensors or lists) cut into ``n``
    contiguous row slices; other fields are copied to every slice."""
    rows = len(getattr(obj, fields(obj)[0].name))
    out = []
    for lo, hi in even_bounds(rows, n):
        out.append(type(obj)(**{
            f.name: (v[lo:hi] if isinstance(v, (torch.Tensor, list)) else v)
            for f in fields(obj) for v in [getattr(obj, f.name)]}))
    return out


@dataclass
class RolloutRequest:
    """Prompts to answer, each with the seed of its sampling stream (so a response does not
    depend on which rank or batch it lands in). temperature None: the recipe's."""

    prompts: list[str]
    seeds: list[int]
    temperature: float | None = None
    use_ema: bool = False

    def split(self, n: int) -> list["RolloutRequest"]:
        return _split_rows(self, n)


@dataclass
class Rollout:
    """The policy's responses to a RolloutRequest, as token sequences and text."""

    ids: torch.Tensor      # (B, S) prompt (left-padded) + response, eos after the end
    valid: torch.Tensor    # (B, S) bool: real tokens (the response up to its first eos)
    action: torch.Tensor   # (B, S-1) 1.0 where the target is a response token
    prompts: list[str]
    responses: list[str]   # decoded, without the eos
    seconds: float = 0.0   # generation time on the rank

    def split(self, n: int) -> list["Rollout"]:
        return _split_rows(self, n)


@dataclass
class Experience:
    """A rollout scored by the other roles: what one PPO epoch trains on."""

    ids: torch.Tensor         # (B, S)
    valid: torch.Tensor       # (B, S)
    action: torch.Tensor      # (B, S-1)
    old_logp: torch.Tensor    # (B, S-1) the policy's log-probabilities when sampling
    old_values: torch.Tensor  # (B, S-1) the critic's values then
    advantages: torch.Tensor  # (B, S-1) GAE advantages, whitened over the whole batch
    returns: torch.Tensor     # (B, S-1) value targets

    def split(self, n: int) -> list["Experience"]:
        return _split_rows(self, n)


@dataclass(frozen=True)
class SFTStats:
    loss: float
    lr: float


@dataclass(frozen=True)
class RewardStats:
    loss: float
    accuracy: float  # chosen scored above rejected, fraction of this rank's pairs
    lr: float


@dataclass(frozen=True)
class RewardEval:
    loss: float
    correct: int  # pairs whose chosen response scored higher
    count: int


@dataclass(frozen=True)
class PolicyStats:
    policy_loss: float
    ptx_loss: float | None = None  # the pretraining-loss term, when ppo.ptx_coef > 0


@dataclass(frozen=True)
class CriticStats:
    value_loss: float
