"""Step 3 of the online algorithms on the graph (PPO, GRPO, RLOO, REINFORCE++): rollouts,
experience, policy (and critic) updates, checkpoints of the trained roles, and recovery from
failed workers.

One iteration: the policy samples ``samples_per_prompt`` responses to each of a batch of
prompts (``PolicyActor.generate``, one slice per rank); the roles the algorithm has score them
at once while the driver runs the reward function, if any (``make_experience``); the scores
become advantages by the algorithm's estimator (troupe.rlhf.algorithms): PPO's GAE over
KL-penalised token rewards with a critic, GRPO's group-normalized and RLOO's leave-one-out
sequence scores, REINFORCE++'s returns normalized over the whole batch; then ``ppo_epochs``
updates of the policy (and critic) run side by side.
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
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.datasets import Data
from troupe.rlhf.data.experience import merged_agent
from troupe.rlhf.pipeline.replicas import Replicas, per_rank
from troupe.rlhf.pipeline.rewards import RewardFunction
from troupe.rlhf.pipeline.scoring import Batch, draw, make_experience, sample
from troupe.rlhf.pipeline.stages import evaluate_policy
from troupe.rlhf.roles.actors import (
    CriticActor,
    PolicyActor,
    ReferenceActor,
    ReferenceCalls,
    RewardActor,
    RewardCalls,
    RolloutActor,
    reference_of,
    reward_of,
)
from troupe.rlhf.roles.topology import RLHFTopology
from troupe.runtime import checkpoint
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog
from troupe.runtime.recovery import FailurePolicy, run_steps

logger = logging.getLogger(__name__)
KINDS = ("step3", "step3_eval")  # the metric kinds step 3 writes (a redone iteration's replace)


@dataclass
class Step3State:
    """Where step 3 stands on the driver: iterations done, the sampling RNG, and the
    evaluation before it (kept for the summary)."""

    iteration: int
    rng: random.Random
    before: dict | None


def reward_function(cfg: RLHFConfig) -> RewardFunction | None:
    """The recipe's reward function's process pool (None without one); call ``close``."""
    r = cfg.reward
    if not r.function:
        return None
    return RewardFunction(r.function, r.timeout_s, r.function_workers, r.failure_score,
                          memory_mb=r.function_memory_mb)


def role_memory(graph: Graph) -> dict[str, float]:
    """Each role's peak memory so far (MiB, the most of its workers; the CUDA allocator's or
    the resident set's: runtime.metrics.peak_memory_mb), asked at the evaluations only."""
    return {name: round(max(group.invoke(PolicyActor.peak_memory_mb)), 1)
            for name, group in graph.roles.items()}


def run_iteration(graph: Graph, cfg: RLHFConfig, data: Data, it: int, rng: random.Random,
                  reward_fn: RewardFunction | None = None,
                  replicas: Replicas | None = None) -> dict:
    """Generate (on the policy's workers, or on the rollout ``replicas``), score, and update
    the policy (and critic) ``ppo_epochs`` times; returns the metrics (the losses averaged
    over the epochs)."""
    p, W = cfg.step3, cfg.workers
    t0 = time.perf_counter()
    if replicas is None:
        batch = sample(graph, cfg, data, rng, reward_fn)
    elif p.rollout.max_staleness == 0:  # the synchronous order: drawn and generated now
        batch = sample(graph, cfg, data, rng, reward_fn, generate=lambda request: per_rank(
            replicas.collect(replicas.submit(request), it), W))
    else:
        parts, fields = replicas.batch(it, p.iterations, lambda: draw(cfg, data, rng, 0))
        batch = Batch(per_rank(parts, W), fields)
    t1 = time.perf_counter()
    exps, stats = make_experience(graph, cfg, batch, reward_fn)
    t2 = time.perf_counter()
    pstats, cstats = [], []
    for _ in range(p.ppo_epochs):
        ptx = [rng.sample(data.sft, max(1, p.prompts_per_iter // W)) if p.ptx_coef > 0 else None
               for _ in range(W)]
        policy = graph["policy"].invoke_async(PolicyActor.rl_step, PerRank(exps), it,
                                              PerRank(ptx))
        critic = (graph["critic"].invoke_async(CriticActor.critic_step, PerRank(exps), it)
                  if cfg.uses_critic() else None)
        pstats += policy.result()
        cstats += critic.result() if critic else []
    rollouts = batch.rollouts
    tokens = sum(s.tokens for s in pstats)
    lengths = torch.cat([ro.action.sum(1) for ro in rollouts])
    rec = {"kind": "step3", "step": it, "algorithm": cfg.algorithm, **stats,
           "policy_loss": sum(s.policy_loss for s in pstats) / len(pstats),
           "entropy": sum(s.entropy * s.tokens for s in pstats) / max(tokens, 1),
           "clip_fraction": sum(s.clip_fraction * s.tokens for s in pstats) / max(tokens, 1),
           "response_length": lengths.mean().item(),
           "generate_s": t1 - t0, "score_s": t2 - t1, "train_s": time.perf_counter() - t2,
           "generated_tokens_per_s": lengths.sum().item() / max(t1 - t0, 1e-9)}
    # the trainer against the rollout engine, on the response tokens (tis_cap: truncated)
    rec["logprob_mismatch_mean"] = sum(s.mismatch[0] for s in pstats) / max(tokens, 1)
    rec["logprob_mismatch_max"] = max(s.mismatch[1] for s in pstats)
    rec["tis_truncated"] = sum(s.mismatch[2] for s in pstats) / max(tokens, 1)
    real, padded, computed, real_computed = (sum(c) for c in zip(*(s.padding for s in pstats)))
    if padded:  # the policy update's share of padding, in the padded rows and as computed
        rec["padding"] = 1 - real / padded
        rec["padding_computed"] = 1 - real_computed / computed
        rec["computed_share"] = computed / padded  # computed / padded positions
    if cstats:
        rec["value_loss"] = sum(s.value_loss for s in cstats) / len(cstats)
    if pstats[0].kl is not None:
        rec["kl_loss"] = sum(s.kl for s in pstats) / len(pstats)
    if pstats[0].ptx_loss is not None:
        rec["ptx_loss"] = sum(s.ptx_loss for s in pstats) / len(pstats)
    if data.gold is not None:
        golds = [data.gold(q, r) for ro in rollouts for q, r in zip(ro.prompts, ro.responses)]
        rec["gold"] = sum(golds) / len(golds)
    prompt_tokens, prefill_tokens = (sum(c) for c in zip(*(ro.prompt_tokens for ro in rollouts)))
    if prompt_tokens:  # what the rollout engine ran of the prompts (its prefix cache)
        rec["prompt_tokens"], rec["prefill_tokens"] = prompt_tokens, prefill_tokens
    agent = merged_agent([ro.agent for ro in rollouts])
    if agent:  # multi-turn rollouts: how the trajectories went (troupe.rlhf.agents.loop)
        failures = agent["env_failures"]
        causes: dict[str, int] = {}
        for why in failures:
            causes[why.split(":", 1)[0]] = causes.get(why.split(":", 1)[0], 0) + 1
        rec.update(turns_mean=agent["turns"] / agent["trajectories"],
                   tool_call_fraction=agent["tool_turns"] / max(agent["turns"], 1),
                   trajectory_ends=agent["ends"], env_failures=len(failures),
                   env_failure_causes=causes, env_s=agent["env_seconds"])
        if failures:
            logger.warning("env.function %s: %d of %d trajectories failed; first: %s",
                           cfg.env.function, len(failures), agent["trajectories"], failures[0])
    if rollouts[0].versions is not None:  # updates between the generating weights and these
        stale = [it - 1 - v for ro in rollouts for v in ro.versions]
        rec["staleness_mean"], rec["staleness_max"] = sum(stale) / len(stale), max(stale)
        rec["rollout_s"] = max(ro.seconds for ro in rollouts)
    return rec


def _trained(graph: Graph) -> list:
    """The roles whose step-3 state a checkpoint holds, with their save and load methods."""
    out = [(graph["policy"], PolicyActor.save_state, PolicyActor.load_state)]
    if "critic" in graph.roles:
        out.append((graph["critic"], CriticActor.save_state, CriticActor.load_state))
    return out


def restore(graph: Graph, cfg: RLHFConfig, root: Path, sft_path: Path | None,
            reward_path: Path | None, resume: bool) -> Step3State:
    """Every role at the start of step 3 (policy and reference from step 1's weights, or the
    model's own when ``sft_path`` is None; reward and critic from step 2's), then the trained
    ones at the latest checkpoint under ``root``. One role at a time: each reads a whole
    weights file, and four reads at once stacked their transient copies (+2 GB at the start
    of PPO for a 135M model)."""
    sft = str(sft_path) if sft_path is not None else None
    if cfg.uses_reward_model():  # frees its training state first
        reward_of(graph, cfg).invoke(RewardCalls.load_reward, str(reward_path))
    if cfg.uses_reference() and sft is not None:
        reference_of(graph, cfg).invoke(ReferenceCalls.load_reference, sft)
    graph["policy"].invoke(PolicyActor.begin_step3, sft)
    if "critic" in graph.roles:  # from the reward model, or else the SFT policy's body
        graph["critic"].invoke(CriticActor.begin_step3,
                               str(reward_path) if cfg.uses_reward_model() else None, sft)
    rng = random.Random(cfg.seed + 30)
    found = checkpoint.restore_latest(_trained(graph), root)
    if found is None:
        if resume:
            logger.warning("no step-3 checkpoint under %s: step 3 starts from the beginning",
                           root)
        return Step3State(0, rng, None)
    source, done = found
    meta = read_manifest(source)
    version, state, gauss = meta["rng"]
    rng.setstate((version, tuple(state), gauss))
    return Step3State(done, rng, meta["before"])


def save_checkpoint(graph: Graph, root: Path, out: Path, state: Step3State) -> None:
    """The trained roles' full state (atomically, the newest two kept; the driver's RNG in
    the manifest), and their weights as out/step3/iter-N/{policy,critic}.trp."""
    it = state.iteration
    checkpoint.save(_trained(graph), root, it, rng=list(state.rng.getstate()),
                    before=state.before)
    d = out / "step3" / f"iter-{it:05d}"
    graph["policy"].invoke(PolicyActor.save, str(d / "policy.trp"))
    if "critic" in graph.roles:
        graph["critic"].invoke(CriticActor.save, str(d / "critic.trp"))
    (d / "state.json").write_text(json.dumps({"iteration": it}))


_SETUP = {"policy": PolicyActor.setup, "reference": ReferenceActor.setup,
          "reward": RewardActor.setup, "critic": CriticActor.setup,
          "rollout": RolloutActor.setup}


def setup_roles(graph: Graph, topology: RLHFTopology) -> None:
    """Build every role of the graph afresh on its workers, with its groups in ``topology``."""
    calls = [graph[name].invoke_async(_SETUP[name], topology) for name in graph.roles]
    for c in calls:
        c.result()


def _restart(graph: Graph, cfg: RLHFConfig, root: Path, sft_path: Path | None,
             reward_path: Path | None, resume: bool) -> Step3State:
    """After the failure policy brought the workers back: every role built afresh, then
    ``restore``."""
    setup_roles(graph, RLHFTopology.of(list(graph.roles), cfg.workers, cfg.zero_stage,
                                       cfg.step3.rollout.replicas))
    return restore(graph, cfg, root, sft_path, reward_path, resume)


def checkpoints(out: Path, resume: bool) -> Path:
    """Where step 3's checkpoints go: out/step3/checkpoints, or, resuming a run made while
    step 3 was called ppo, its out/ppo/checkpoints (the run goes on there)."""
    root, old = out / "step3" / "checkpoints", out / "ppo" / "checkpoints"
    return old if resume and not root.exists() and old.exists() else root


def run_step3(graph: Graph, cfg: RLHFConfig, data: Data, log: MetricsLog, out: Path,
            sft_path: Path | None, reward_path: Path | None,
            on_iteration: Callable | None = None, resume: bool = False) -> dict:
    """Step 3 of an online algorithm for ``cfg.step3.iterations`` iterations, checkpointed
    every ``checkpoint_every`` to out/step3/checkpoints/step-N. A failed worker is handled by
    troupe.runtime.recovery (``cfg.max_restarts``): every role goes back to the last
    checkpoint and the iterations after it are redone exactly; past the restarts,
    RunFailedError and out/failure.json. ``resume`` starts from the latest checkpoint that an
    earlier run left in ``out``. ``on_iteration(it, graph)`` is called before each iteration
    (again when one is redone)."""
    p, root = cfg.step3, checkpoints(out, resume)
    if not resume and root.exists():  # a fresh run must never go back to an older run's state
        shutil.rmtree(root)
    reward_fn = reward_function(cfg)  # fails here, before any work, if it cannot be imported
    replicas = Replicas(graph, cfg, log) if "rollout" in graph.roles else None
    try:
        state = restore(graph, cfg, root, sft_path, reward_path, resume)
        if replicas is not None:  # the replicas start from the policy's weights
            replicas.sync(state.iteration, state.iteration)
        if state.before is None:
            state.before = evaluate_policy(graph, data, cfg.seed + 99)
            log.write({"kind": "step3_eval", "step": 0, **state.before})
        policy = FailurePolicy("rlhf", graph, cfg.max_restarts, out,
                               collective_timeout_s=cfg.collective_timeout_s)

        def step(it: int) -> None:
            _iterate(graph, cfg, data, log, out, root, state, it, reward_fn, replicas)

        def back() -> int:  # every role built afresh, at the last checkpoint
            nonlocal state
            before, state = state.before, _restart(graph, cfg, root, sft_path, reward_path,
                                                   resume)
            state.before = state.before or before
            if replicas is not None:
                replicas.reset()
                replicas.sync(state.iteration, state.iteration)
            return state.iteration

        bar = tqdm(total=p.iterations, initial=state.iteration,
                   desc=f"step 3: {cfg.algorithm.upper()}")
        run_steps(policy, log, state.iteration, p.iterations, step, back, kinds=KINDS,
                  before_step=None if on_iteration is None else lambda it: on_iteration(it, graph),
                  bar=bar)
        bar.close()
    finally:
        if reward_fn is not None:
            reward_fn.close()
    after = evaluate_policy(graph, data, cfg.seed + 99)
    summary = {"before": state.before, "after": after, "restarts": policy.restarts}
    if replicas is not None:
        summary["rollout_restarts"] = replicas.restarts
    if reward_fn is not None:
        summary["reward_failures"] = reward_fn.failures
    return summary


def _iterate(graph: Graph, cfg: RLHFConfig, data: Data, log: MetricsLog, out: Path, root: Path,
             state: Step3State, it: int, reward_fn: RewardFunction | None,
             replicas: Replicas | None = None) -> None:
    """Iteration ``it`` (and the weights it made sent to the rollout replicas, unless it is
    the last), then the evaluation and checkpoint it is due."""
    p, t0 = cfg.step3, time.perf_counter()
    rec = run_iteration(graph, cfg, data, it, state.rng, reward_fn, replicas)
    if replicas is not None:
        rec.update(replicas.sync(it, it) if it < p.iterations else replicas.drain(it))
        rec["rollout_restarts"] = replicas.restarts
    rec["iteration_s"] = time.perf_counter() - t0  # the whole iteration, its sync included
    log.write(rec)
    state.iteration = it
    if it % p.eval_every == 0 or it == p.iterations:
        log.write({"kind": "step3_eval", "step": it,
                   **evaluate_policy(graph, data, cfg.seed + 99),
                   "peak_memory_mb": role_memory(graph)})
    if p.checkpoint_every and (it % p.checkpoint_every == 0 or it == p.iterations):
        save_checkpoint(graph, root, out, state)
