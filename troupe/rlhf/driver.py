"""Driver of the three-step RLHF pipeline: one graph holding the policy, reference, reward and
critic roles (colocated on the same bundles by default), then step 1 (SFT) and step 2 (reward
model) from troupe.rlhf.stages and step 3 (PPO) from troupe.rlhf.ppo. Metrics go to JSON
lines, plots to rlhf.png, weights after each step and every ``ppo.checkpoint_every`` PPO
iterations, and the final policy to out_dir/policy-hf as a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data import Data, prepare_data
from troupe.rlhf.plots import plot
from troupe.rlhf.ppo import run_ppo, setup_roles
from troupe.rlhf.stages import evaluate_policy, run_reward, run_sft
from troupe.rlhf.workers import CriticActor, PolicyActor, ReferenceActor, RewardActor
from troupe.runtime.graph import ActorGraph
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog

STEPS = ("sft", "reward", "ppo")
ROLES = ("policy", "reference", "reward", "critic")

__all__ = ["Data", "MetricsLog", "ROLES", "STEPS", "build_graph", "evaluate_policy",
           "prepare_data", "run", "run_ppo", "run_reward", "run_sft"]


def build_graph(cfg: RLHFConfig, timeout_s: float = 300.0) -> Graph:
    """The four roles, ``cfg.workers`` each; colocated on the policy's bundles unless
    ``cfg.colocate`` is off; data-parallel groups for the roles that train."""
    g, W, conf = ActorGraph("rlhf"), cfg.workers, cfg.model_dump()
    g.role("policy", PolicyActor, W, num_cpus=cfg.num_cpus, config=conf,
           max_restarts=cfg.max_restarts)
    for name, cls in (("reference", ReferenceActor), ("reward", RewardActor),
                      ("critic", CriticActor)):
        g.role(name, cls, W, num_cpus=cfg.num_cpus, config=conf,
               colocate_with="policy" if cfg.colocate else None,
               max_restarts=cfg.max_restarts)
    if W > 1:
        for name in ("policy", "reward", "critic"):
            g.collective(name, [name])
    graph = g.build(timeout_s=timeout_s, call_timeout_s=900)
    try:
        setup_roles(graph)
    except BaseException:
        graph.shutdown()
        raise
    return graph


def run(cfg: RLHFConfig, steps: tuple[str, ...] = STEPS, resume: bool = False) -> dict:
    """Run ``steps`` (a subset of "sft", "reward", "ppo", in that order) and return a summary;
    a later step alone uses the weights an earlier run left in ``out_dir``, and ``resume``
    continues PPO from its latest checkpoint there."""
    if resume and ("sft" in steps or "reward" in steps):
        raise ValueError("resume continues PPO from its checkpoint; run it with steps ('ppo',) "
                         "alone (steps 1 and 2 would change the weights PPO started from)")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.model_dump(), indent=1))
    log, data = MetricsLog(out / "metrics.jsonl"), prepare_data(cfg)
    sft_path, reward_path = out / "sft" / "policy.trp", out / "reward" / "reward.trp"
    summary: dict = {}
    graph = build_graph(cfg)
    try:
        if "sft" in steps:
            run_sft(graph, cfg, data, log, out)
            summary["sft"] = evaluate_policy(graph, data, cfg.seed + 99)
            log.write({"kind": "sft_eval", "step": cfg.sft.steps, **summary["sft"]})
        if "reward" in steps:
            run_reward(graph, cfg, data, log, out)
            summary["reward_accuracy"] = log.records()[-1]["accuracy"]
        if "ppo" in steps:
            summary["ppo"] = run_ppo(graph, cfg, data, log, out, sft_path, reward_path,
                                     resume=resume)
            if cfg.model.pretrained is not None or cfg.model.gpt.moe is None:
                summary["exported"] = graph["policy"].invoke(PolicyActor.export,
                                                             str(out / "policy-hf"))
    finally:
        graph.shutdown()
    plot(log.records(), out / "rlhf.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
