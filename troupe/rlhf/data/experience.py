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
    depend on which rank or batch it lands in) and its group id (the samples of one prompt
    draw share one; group estimators compare within it). temperature None: the recipe's."""

    prompts: list        # text, or chat messages (troupe.rlhf.data.datasets.Prompt)
    seeds: list[int]
    temperature: float | None = None
    use_ema: bool = False
    groups: list[int] | None = None
    fields: list[dict] | None = None  # each prompt's data row's other fields (an
    # environment's reset gets them: troupe.rlhf.agents.loop)

    def split(self, n: int) -> list[RolloutRequest]:
        return _split_rows(self, n)


@dataclass
class Rollout:
    """The policy's responses to a RolloutRequest, as token sequences and text."""

    ids: torch.Tensor      # (B, S) prompt (left-padded) + response, eos after the end
    valid: torch.Tensor    # (B, S) bool: real tokens (the response up to its first eos)
    action: torch.Tensor   # (B, S-1) 1.0 where the target is a response token
    prompts: list          # as in the request
    responses: list[str]   # decoded, without the eos
    seconds: float = 0.0   # generation time on the rank
    prompt_len: int = 0    # the first prompt_len columns are the (left-padded) prompts
    groups: list[int] | None = None  # as in the request
    engine_logp: torch.Tensor | None = None  # (B, S-1) the engine's log-prob of each sampled
    # token, where ``action`` is 1 (the distribution it sampled from, before temperature)
    versions: list[int] | None = None  # the policy version (updates done) whose weights
    # generated each row, every token of it (rollout replicas; None: the policy's own, current)
    prompt_tokens: tuple[int, int] = (0, 0)  # (the rows' prompt tokens, those the engine ran;
    # not kept by ``rows``: a subset's share of what the engine ran is not known)
    env_reward: torch.Tensor | None = None  # (B,) multi-turn rollouts: each trajectory's
    # reward from its environment (troupe.rlhf.agents.loop)
    agent: dict | None = None  # multi-turn rollouts: turns, tool-call turns, how they ended,
    # environment failures (troupe.rlhf.agents.loop.rollout_of; not kept by ``rows``)
    speculation: tuple[int, int, int] = (0, 0, 0)  # the engine's speculative decoding: verify
    # passes, tokens proposed, tokens accepted (troupe.generation.speculative; not kept by rows)

    def split(self, n: int) -> list[Rollout]:
        parts = _split_rows(self, n)
        for p in parts[1:]:  # the figures of the whole, counted once
            p.agent, p.speculation = None, (0, 0, 0)
        return parts

    def rows(self, index: list[int]) -> Rollout:
        """The rollout of the rows ``index``, in that order."""
        pick = torch.tensor(index, dtype=torch.long)  # host: a rollout
        return Rollout(self.ids[pick], self.valid[pick], self.action[pick],
                       [self.prompts[i] for i in index], [self.responses[i] for i in index],
                       self.seconds, self.prompt_len,
                       None if self.groups is None else [self.groups[i] for i in index],
                       None if self.engine_logp is None else self.engine_logp[pick],
                       None if self.versions is None else [self.versions[i] for i in index],
                       env_reward=None if self.env_reward is None else self.env_reward[pick])

    @staticmethod
    def concat(parts: list[Rollout], pad_id: int = 0) -> Rollout:
        """One rollout of every part's rows, the prompts left-padded to the longest (padding
        is invalid and no target, whatever its id)."""
        P = max(r.prompt_len for r in parts)

        def pad(x: torch.Tensor, r: Rollout, value) -> torch.Tensor:
            return torch.nn.functional.pad(x, (P - r.prompt_len, 0), value=value)

        return Rollout(torch.cat([pad(r.ids, r, pad_id) for r in parts]),
                       torch.cat([pad(r.valid, r, False) for r in parts]),
                       torch.cat([pad(r.action, r, 0.0) for r in parts]),
                       [q for r in parts for q in r.prompts],
                       [x for r in parts for x in r.responses],
                       sum(r.seconds for r in parts), P,
                       None if any(r.groups is None for r in parts)
                       else [g for r in parts for g in r.groups],
                       None if any(r.engine_logp is None for r in parts)
                       else torch.cat([pad(r.engine_logp, r, 0.0) for r in parts]),
                       None if any(r.versions is None for r in parts)
                       else [v for r in parts for v in r.versions],
                       tuple(sum(c) for c in zip(*(r.prompt_tokens for r in parts))),
                       None if any(r.env_reward is None for r in parts)
                       else torch.cat([r.env_reward for r in parts]),
                       merged_agent([r.agent for r in parts]),
                       tuple(sum(c) for c in zip(*(r.speculation for r in parts))))


def merged_agent(agents: list[dict | None]) -> dict | None:
    """Several rollouts' agent figures as one (sums; lists joined; None: none had any)."""
    if all(a is None for a in agents):
        return None
    out: dict = {}
    for a in filter(None, agents):
        for k, v in a.items():
            if isinstance(v, dict):
                out[k] = {**out.get(k, {}), **{e: out.get(k, {}).get(e, 0) + n
                                               for e, n in v.items()}}
            else:
                out[k] = out.get(k, [] if isinstance(v, list) else 0) + v
    return out


@dataclass
class Experience:
    """A rollout scored by the other roles: what one policy (and critic) epoch trains on.
    Fields an algorithm does not use are None: old_logp with a single epoch and no KL in the
    reward (the ratio is then 1 and the policy's own log-probabilities serve), ref_logp
    unless the KL is a loss term, old_values and returns without a critic."""

    ids: torch.Tensor         # (B, S)
    valid: torch.Tensor       # (B, S)
    action: torch.Tensor      # (B, S-1)
    advantages: torch.Tensor  # (B, S-1) the algorithm's advantages on the response tokens
    old_logp: torch.Tensor | None = None    # (B, S-1) the policy's log-probs when sampling
    ref_logp: torch.Tensor | None = None    # (B, S-1) the reference's
    old_values: torch.Tensor | None = None  # (B, S-1) the critic's values then
    returns: torch.Tensor | None = None     # (B, S-1) value targets
    prompt_len: int = 0                     # as in the rollout
    engine_logp: torch.Tensor | None = None  # (B, S-1) as in the rollout

    def split(self, n: int) -> list[Experience]:
        return _split_rows(self, n)


@dataclass
class PreferenceBatch:
    """DPO's batch: (prompt, chosen, rejected) rows and the reference's summed response
    log-probabilities of each (computed once per pair)."""

    pairs: list
    ref_chosen: torch.Tensor    # (B,)
    ref_rejected: torch.Tensor  # (B,)

    def split(self, n: int) -> list[PreferenceBatch]:
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
    policy_loss: float             # the algorithm's surrogate, without the KL and ptx terms
    ptx_loss: float | None = None  # the pretraining-loss term, when step3.ptx_coef > 0
    kl: float | None = None        # mean per-token KL estimate, when it is a loss term
    entropy: float = 0.0           # mean per-token entropy of the policy on its responses
    clip_fraction: float = 0.0     # share of response tokens whose ratio was clipped
    tokens: int = 0                # response tokens these means are over
    mismatch: tuple[float, float, float] = (0.0, 0.0, 0.0)  # over the tokens with an engine
    # log-prob: (sum and max of |trainer - engine| log-prob, how many were truncated)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)  # GPTLM.padding over the update's forwards


@dataclass(frozen=True)
class DPOStats:
    loss: float
    margin: float    # mean implicit reward margin beta * h
    accuracy: float  # share of pairs with a positive margin
    lr: float


@dataclass(frozen=True)
class CriticStats:
    value_loss: float
