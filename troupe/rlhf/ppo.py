"""Step 3 on the graph: PPO iterations (rollouts, experience, policy and critic updates),
checkpoints of the trained roles, and recovery from failed workers.

One iteration: the policy samples responses to a batch of prompts (``PolicyActor.generate``,
one slice per rank); the policy, reference, reward and critic score them at once
(``make_experience``: per-token KL-penalised rewards, GAE, advantages whitened over the whole
batch, troupe.rlhf.algorithms); then ``ppo_epochs`` updates of the policy (clipped surrogate,
optional pretraining loss) and critic (clipped value loss) run side by side.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from troupe.actors import PerRank
from troupe.checkpoint import read_manifest
from troupe.errors import WorkerCallError, WorkerDiedError
from troupe.rlhf import algorithms
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data import Data
from troupe.rlhf.experience import Experience, Rollout, RolloutRequest
from troupe.rlhf.stages import evaluate_policy, seeds
from troupe.rlhf.workers import CriticActor, PolicyActor, ReferenceActor, RewardActor
from troupe.runtime import checkpoint
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog
from troupe.runtime.recovery import FailurePolicy

logger = logging.getLogger(__name__)


@dataclass
class PPOState:
    """Where PPO stands on the driver: iterations done, the sampling RNG, and the evaluation
    before PPO (kept for the summary)."""

    iteration: int
    rng: random.Random
    before: dict | None


def make_experience(graph: Graph, cfg: RLHFConfig, rollouts: list[Rollout]
                    ) -> tuple[list[Experience], dict]:
    """Score each rank's rollouts with the four roles at once and turn the scores into
    experience (one per data-parallel rank); also the batch's mean score and KL."""
    batch = PerRank(rollouts)
    calls = [graph["policy"].invoke_async(PolicyActor.logprobs, batch),
             graph["reference"].invoke_async(ReferenceActor.logprobs, batch),
             graph["reward"].invoke_async(RewardActor.score, batch),
             graph["critic"].invoke_async(CriticActor.values, batch)]
    logp, ref, score, values = (c.result() for c in calls)
    p, advs, rets = cfg.ppo, [], []
    for r, ro in enumerate(rollouts):
        rewards = algorithms.kl_rewards(logp[r], ref[r], score[r], ro.action, p.kl_coef,
                                        p.clip_reward)
        adv, ret = algorithms.gae(rewards, values[r], ro.action, p.gamma, p.lam)
        advs.append(adv)
        rets.append(ret)
    advs = algorithms.whiten(advs, [ro.action for ro in rollouts])
    exps = [Experience(ro.ids, ro.valid, ro.action, logp[r], values[r], advs[r], rets[r])
            for r, ro in enumerate(rollouts)]
    kl = torch.cat([((lp - rf) * ro.action).sum(1) for lp, rf, ro in zip(logp, ref, rollouts)])
    return exps, {"score": torch.cat(score).mean().item(), "kl": kl.mean().item()}


def ppo_iteration(graph: Graph, cfg: RLHFConfig, data: Data, it: int,
                  rng: random.Random) -> dict:
    """Generate, score, and update policy and critic once; returns the iteration's metrics."""
    p, W = cfg.ppo, cfg.workers
    t0 = time.perf_counter()
    prompts = rng.sample(data.prompts, p.prompts_per_iter)
    request = RolloutRequest(prompts, seeds(rng, len(prompts)))
    rollouts = graph["policy"].invoke(PolicyActor.generate, request)
    t1 = time.perf_counter()
    exps, stats = make_experience(graph, cfg, rollouts)
    t2 = time.perf_counter()
    for _ in range(p.ppo_epochs):
        ptx = [rng.sample(data.sft, max(1, p.prompts_per_iter // W)) if p.ptx_coef > 0 else None
               for _ in range(W)]
        policy = graph["policy"].invoke_async(PolicyActor.ppo_step, PerRank(exps), it,
                                              PerRank(ptx))
        critic = graph["critic"].invoke_async(CriticActor.critic_step, PerRank(exps), it)
        pstats, cstats = policy.result(), critic.result()
    rec = {"kind": "ppo", "step": it, **stats,
           "policy_loss": sum(s.policy_loss for s in pstats) / W,
           "value_loss": sum(s.value_loss for s in cstats) / W,
           "generate_s": t1 - t0, "score_s": t2 - t1, "train_s": time.perf_counter() - t2}
    if data.gold is not None:
        golds = [data.gold(q, r) for ro in rollouts for q, r in zip(ro.prompts, ro.responses)]
        rec["gold"] = sum(golds) / len(golds)
    return rec


def _trained(graph: Graph) -> list:
    """The roles whose PPO state a checkpoint holds, with their save and load methods."""
    return [(graph["policy"], PolicyActor.save_state, PolicyActor.load_state),
            (graph["critic"], CriticActor.save_state, CriticActor.load_state)]


def restore(graph: Graph, cfg: RLHFConfig, root: Path, sft_path: Path, reward_path: Path,
            resume: bool) -> PPOState:
    """Every role at the start of PPO (policy and reference from step 1's weights, reward and
    critic from step 2's), then the trained ones at the latest checkpoint under ``root``.
    One role at a time: each reads a whole weights file, and four reads at once stacked their
    transient copies (+2 GB at the start of PPO for a 135M model)."""
    graph["reward"].invoke(RewardActor.load, str(reward_path))  # frees its training state first
    graph["reference"].invoke(ReferenceActor.load, str(sft_path))
    graph["policy"].invoke(PolicyActor.begin_ppo, str(sft_path))
    graph["critic"].invoke(CriticActor.begin_ppo, str(reward_path))
    rng = random.Random(cfg.seed + 30)
    found = checkpoint.restore_latest(_trained(graph), root)
    if found is None:
        if resume:
            logger.warning("no PPO checkpoint under %s: PPO starts from the beginning", root)
        return PPOState(0, rng, None)
    source, done = found
    meta = read_manifest(source)
    version, state, gauss = meta["rng"]
    rng.setstate((version, tuple(state), gauss))
    return PPOState(done, rng, meta["before"])


def save_checkpoint(graph: Graph, root: Path, out: Path, state: PPOState) -> None:
    """The policy's and critic's full state (atomically, the newest two kept; the driver's
    RNG in the manifest), and their weights as out/ppo/iter-N/{policy,critic}.trp."""
    it = state.iteration
    checkpoint.save(_trained(graph), root, it, rng=list(state.rng.getstate()),
                    before=state.before)
    d = out / "ppo" / f"iter-{it:05d}"
    graph["policy"].invoke(PolicyActor.save, str(d / "policy.trp"))
    graph["critic"].invoke(CriticActor.save, str(d / "critic.trp"))
    (d / "state.json").write_text(json.dumps({"iteration": it}))


def setup_roles(graph: Graph) -> None:
    """Build every role afresh on its workers (its groups wired)."""
    calls = [graph["policy"].invoke_async(PolicyActor.setup),
             graph["reference"].invoke_async(ReferenceActor.setup),
             graph["reward"].invoke_async(RewardActor.setup),
             graph["critic"].invoke_async(CriticActor.setup)]
    for c in calls:
        c.result()


def _restart(graph: Graph, cfg: RLHFConfig, root: Path, sft_path: Path, reward_path: Path,
             resume: bool) -> PPOState:
    """After the failure policy brought the workers back: every role built afresh, then
    ``restore``."""
    setup_roles(graph)
    return restore(graph, cfg, root, sft_path, reward_path, resume)


def run_ppo(graph: Graph, cfg: RLHFConfig, data: Data, log: MetricsLog, out: Path,
            sft_path: Path, reward_path: Path, on_iteration: Callable | None = None,
            resume: bool = False) -> dict:
    """PPO for ``cfg.ppo.iterations`` iterations, checkpointed every ``checkpoint_every``
    to out/ppo/checkpoints/step-N. A failed worker is handled by troupe.runtime.recovery
    (``cfg.max_restarts``): every role goes back to the last checkpoint and the iterations
    after it are redone exactly; past the restarts, RunFailedError and out/failure.json.
    ``resume`` starts from the latest checkpoint that an earlier run left in ``out``.
    ``on_iteration(it, graph)`` is called before each iteration (again when one is redone)."""
    p, root = cfg.ppo, out / "ppo" / "checkpoints"
    if not resume and root.exists():  # a fresh run must never go back to an older run's state
        shutil.rmtree(root)
    state = restore(graph, cfg, root, sft_path, reward_path, resume)
    if state.before is None:
        state.before = evaluate_policy(graph, data, cfg.seed + 99)
        log.write({"kind": "ppo_eval", "step": 0, **state.before})
    policy = FailurePolicy("rlhf", graph, cfg.max_restarts, out)
    bar = tqdm(total=p.iterations, initial=state.iteration, desc="step 3: PPO")
    while state.iteration < p.iterations:
        try:
            _iterate(graph, cfg, data, log, out, state, on_iteration)
            bar.update(1)
        except (WorkerDiedError, WorkerCallError) as e:
            failed = state.iteration + 1
            before, state = state.before, policy.recover(e, failed, lambda: _restart(
                graph, cfg, root, sft_path, reward_path, resume))
            state.before = state.before or before
            log.write({"kind": "recovery", "step": state.iteration, "failed_step": failed,
                       "role": e.role, "rank": e.rank, "node_id": e.node_id,
                       "error": str(e).splitlines()[0]})
            bar.reset(total=p.iterations)
            bar.update(state.iteration)
    bar.close()
    after = evaluate_policy(graph, data, cfg.seed + 99)
    return {"before": state.before, "after": after, "restarts": policy.restarts}


def _iterate(graph: Graph, cfg: RLHFConfig, data: Data, log: MetricsLog, out: Path,
             state: PPOState, on_iteration: Callable | None) -> None:
    """One iteration, then the evaluation and checkpoint it is due."""
    p, it = cfg.ppo, state.iteration + 1
    if on_iteration is not None:
        on_iteration(it, graph)
    log.write(ppo_iteration(graph, cfg, data, it, state.rng))
    state.iteration = it
    if it % p.eval_every == 0 or it == p.iterations:
        log.write({"kind": "ppo_eval", "step": it, **evaluate_policy(graph, data, cfg.seed + 99)})
    if p.checkpoint_every and (it % p.checkpoint_every == 0 or it == p.iterations):
        save_checkpoint(graph, out / "ppo" / "checkpoints", out, state)
