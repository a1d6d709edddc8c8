"""Step 3's batch, on the driver: prompts drawn and answered by the policy, the rollouts'
rewards (the learned reward model's and the reward function's), the groups the algorithm keeps
(dynamic sampling: more rounds of prompts until enough groups have rewards that differ), the
scores the algorithm asks for (troupe.rlhf.algorithms.Algorithm.scores), and the experience
each data-parallel rank of the policy (and critic) trains on.

Every sample carries a group id: the samples of one prompt draw share it, so rows can be
filtered, reordered and refilled without breaking the group estimators' statistics.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from troupe.actors import PerRank
from troupe.rlhf import algorithms
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.datasets import Data
from troupe.rlhf.data.experience import Experience, Rollout, RolloutRequest
from troupe.rlhf.pipeline.rewards import RewardFunction
from troupe.rlhf.pipeline.stages import seeds
from troupe.rlhf.roles.actors import (
    CriticActor,
    PolicyActor,
    ReferenceCalls,
    RewardCalls,
    reference_of,
    reward_of,
)
from troupe.runtime.handle import Graph

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    """An iteration's rollouts (one per policy rank), their data rows' extra fields, and,
    once known, their sequence rewards (B,) and the sampling's statistics."""

    rollouts: list[Rollout]
    fields: list[dict] | None = None
    reward: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)


def draw(cfg: RLHFConfig, data: Data, rng: random.Random, first_group: int
         ) -> tuple[RolloutRequest, list[dict] | None]:
    """``step3.prompts_per_iter`` prompts drawn without repeats, each asked
    ``samples_per_prompt`` times in a row (one group id per draw, from ``first_group``)."""
    n, k = cfg.samples_per_prompt(), cfg.step3.prompts_per_iter
    picked = rng.sample(range(len(data.prompts)), k)
    prompts = [data.prompts[i] for i in picked for _ in range(n)]
    fields = [data.fields[i] for i in picked for _ in range(n)] if data.fields else None
    groups = [first_group + j for j in range(k) for _ in range(n)]
    return RolloutRequest(prompts, seeds(rng, len(prompts)), groups=groups,
                          fields=fields if cfg.env.function else None), fields


def rewards(graph: Graph, cfg: RLHFConfig, rollouts: list[Rollout],
            reward_fn: RewardFunction | None, fields: list[dict] | None) -> tuple[torch.Tensor, dict]:
    """(B,) each sequence's reward: the reward function's (run here on the driver, in its
    process pool) while the learned reward model scores on its workers, weighted and summed;
    and the number of the function's failures."""
    score_call = (reward_of(graph, cfg).invoke_async(RewardCalls.reward_score, PerRank(rollouts))
                  if cfg.uses_reward_model() else None)
    score = torch.zeros(sum(len(ro.responses) for ro in rollouts))  # host: driver's sums
    stats: dict = {}
    if reward_fn is not None:
        prompts = [q for ro in rollouts for q in ro.prompts]
        got = reward_fn(prompts, [r for ro in rollouts for r in ro.responses], fields)
        score += cfg.reward.function_coef * torch.tensor(got.values)  # host: (as score)
        stats["reward_failures"] = len(got.failures)
        if got.failures:
            i, why = got.failures[0]
            logger.warning("reward.function %s: %d of %d samples failed (scored %g); first: "
                           "sample %d %s", cfg.reward.function, len(got.failures), len(prompts),
                           cfg.reward.failure_score, i, why)
    if rollouts[0].env_reward is not None:  # multi-turn: what the environments gave
        score += cfg.env.reward_coef * torch.cat([ro.env_reward for ro in rollouts])
    if score_call is not None:
        score += cfg.reward_model_weight() * torch.cat(score_call.result())
    return score, stats


def sample(graph: Graph, cfg: RLHFConfig, data: Data, rng: random.Random,
           reward_fn: RewardFunction | None,
           generate: Callable[[RolloutRequest], list[Rollout]] | None = None) -> Batch:
    """The iteration's rollouts. Without dynamic sampling: one draw, its rewards left to
    ``make_experience`` (scored at once with the other roles' work). With it: rounds of draws
    (at most ``step3.sample_rounds``), each scored, keeping the groups the algorithm keeps, until
    ``prompts_per_iter`` are kept; if the rounds run out first, dropped groups fill the batch
    (their advantages are zero: they add no gradient). ``generate(request)`` answers a request
    with one rollout per policy rank (default: the policy's own workers generate)."""
    if generate is None:
        generate = partial(graph["policy"].invoke, PolicyActor.generate)
    if not cfg.dynamic_sampling():
        request, fields = draw(cfg, data, rng, 0)
        return Batch(generate(request), fields)
    alg, want = cfg.algo(), cfg.step3.prompts_per_iter
    kept, dropped, stats = [], [], {"groups_sampled": 0, "reward_failures": 0}
    for round_ in range(cfg.step3.sample_rounds):
        request, fields = draw(cfg, data, rng, round_ * want)
        parts = generate(request)
        reward, more = rewards(graph, cfg, parts, reward_fn, fields)
        rollout = Rollout.concat(parts)
        keep = alg.keep(reward, torch.tensor(rollout.groups))  # host: ids
        for g in dict.fromkeys(rollout.groups):  # the groups, in order
            rows = [i for i, x in enumerate(rollout.groups) if x == g]
            (kept if keep[rows[0]] else dropped).append((rollout, rows, reward, fields))
        stats["groups_sampled"] += want
        stats["reward_failures"] += more.get("reward_failures", 0)
        if len(kept) >= want:
            break
    if reward_fn is None:
        del stats["reward_failures"]
    stats.update(groups_kept=len(kept), sample_rounds=round_ + 1,
                 groups_filled=max(0, want - len(kept)))
    picked = (kept + dropped)[:want]
    return Batch(Rollout.concat([ro.rows(rows) for ro, rows, _, _ in picked]).split(cfg.workers),
                 None if picked[0][3] is None else
                 [f[i] for _, rows, _, f in picked for i in rows],
                 torch.cat([r[rows] for _, rows, r, _ in picked]), stats)


def make_experience(graph: Graph, cfg: RLHFConfig, batch: Batch,
                    reward_fn: RewardFunction | None = None) -> tuple[list[Experience], dict]:
    """Score each rank's rollouts with what the algorithm asks for, at once (and their
    rewards meanwhile, unless the batch has them), and turn the scores into experience, one
    per data-parallel rank; also the batch's statistics."""
    alg, rollouts, want = cfg.algo(), batch.rollouts, cfg.algo().scores(cfg)
    per_rank, calls = PerRank(rollouts), {}
    if "logp" in want:
        calls["logp"] = graph["policy"].invoke_async(PolicyActor.logprobs, per_rank)
    if "ref" in want:
        calls["ref"] = reference_of(graph, cfg).invoke_async(ReferenceCalls.reference_logprobs,
                                                              per_rank)
    if "values" in want:
        calls["values"] = graph["critic"].invoke_async(CriticActor.values, per_rank)
    reward, stats = batch.reward, dict(batch.stats)
    if reward is None:
        reward, more = rewards(graph, cfg, rollouts, reward_fn, batch.fields)
        stats.update(more)
    out = {k: c.result() for k, c in calls.items()}
    stats["reward"] = reward.mean().item()
    rows = [len(ro.responses) for ro in rollouts]
    action = [ro.action for ro in rollouts]
    if cfg.overlong_buffer() > 0:
        penalty = algorithms.overlong_penalty(torch.cat(action).sum(1), cfg.step3.max_new_tokens,
                                              cfg.overlong_buffer(), cfg.step3.overlong_penalty)
        reward = reward + penalty
        stats["overlong_penalty"] = penalty.mean().item()
    scores = algorithms.Scores(list(reward.split(rows)), _groups(rollouts), action,
                               out.get("logp"), out.get("ref"), out.get("values"))
    made = alg.advantages(scores, cfg)
    stats.update(made.stats)
    logp, ref = out.get("logp"), out.get("ref")
    exps = [Experience(ro.ids, ro.valid, ro.action, made.advantages[r],
                       old_logp=logp[r] if logp else None,
                       ref_logp=ref[r] if ref and cfg.kl_in_loss() else None,
                       old_values=out["values"][r] if "values" in out else None,
                       returns=made.returns[r] if made.returns else None,
                       prompt_len=ro.prompt_len, engine_logp=ro.engine_logp)
            for r, ro in enumerate(rollouts)]
    if ref and logp:
        kl = torch.cat([((lp - rf) * ro.action).sum(1) for lp, rf, ro in zip(logp, ref, rollouts)])
        stats["kl"] = kl.mean().item()
    return exps, stats


def _groups(rollouts: list[Rollout]) -> list[torch.Tensor]:
    """Each rank's group ids (one group per row when the rollouts carry none)."""
    out, start = [], 0
    for ro in rollouts:
        B = len(ro.responses)
        out.append(torch.tensor(ro.groups) if ro.groups is not None  # host: ids
                   else torch.arange(start, start + B))  # host: ids
        start += B
    return out
