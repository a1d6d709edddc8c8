"""Driver of the three-step RLHF pipeline: one graph holding the roles the recipe's algorithm
needs (policy always; reference when there is a KL term or DPO; a reward model when the reward
is learned; a critic for PPO), colocated on the same bundles by default; then step 1 (SFT) and
step 2 (reward model) from troupe.rlhf.pipeline.stages and step 3 from
troupe.rlhf.pipeline.step3 (PPO, GRPO, RLOO, REINFORCE++) or troupe.rlhf.pipeline.dpo. Metrics
go to JSON lines, plots to rlhf.png, weights after each step and every
``step3.checkpoint_every`` iterations, and the final policy to out_dir/policy-hf as a Hugging
Face directory."""

from __future__ import annotations

import json
import time
from pathlib import Path

from troupe.devices import cluster_device
from troupe.rlhf.config import STEP3, RLHFConfig
from troupe.rlhf.data.datasets import Data, prepare_data
from troupe.rlhf.pipeline.dpo import run_dpo
from troupe.rlhf.pipeline.stages import evaluate_policy, run_reward, run_sft
from troupe.rlhf.pipeline.step3 import run_step3, setup_roles
from troupe.rlhf.plan import Plan, plan
from troupe.rlhf.plots import plot
from troupe.rlhf.roles.actors import (
    CriticActor,
    PolicyActor,
    ReferenceActor,
    RewardActor,
    RolloutActor,
)
from troupe.rlhf.roles.topology import RLHFTopology
from troupe.runtime.cluster import init
from troupe.runtime.graph import ActorGraph
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog

STEPS = ("sft", "reward", STEP3)
ROLES = ("policy", "reference", "reward", "critic")

__all__ = ["Data", "MetricsLog", "ROLES", "STEPS", "build_graph", "evaluate_policy",
           "graph_roles", "load_data", "prepare_data", "reuse_graph", "run", "run_step3",
           "run_reward", "run_sft"]


def roles(cfg: RLHFConfig) -> list[str]:
    """The roles the recipe's algorithm needs, policy first."""
    needed = {"reference": cfg.uses_reference() and not cfg.reference_in_policy,
              "reward": cfg.uses_reward_model() and not cfg.reward_in_critic,
              "critic": cfg.uses_critic()}
    return ["policy"] + [r for r in ROLES[1:] if needed[r]]


def gpus_per_worker(cfg: RLHFConfig, device: str) -> float:
    """What each worker of each role asks Ray for: ``cfg.num_gpus``, or on cuda one GPU per
    rank shared in equal parts by the colocated roles (one each when placed apart)."""
    if device != "cuda":
        return 0.0
    if cfg.num_gpus is not None:
        return cfg.num_gpus
    return 1.0 / len(roles(cfg)) if cfg.colocate else 1.0


def build_graph(cfg: RLHFConfig, timeout_s: float = 300.0,
                steps: tuple[str, ...] = STEPS) -> Graph:
    """The roles of ``graph_roles(cfg, steps)``, ``cfg.workers`` each; colocated on the
    policy's bundles unless ``cfg.colocate`` is off; data-parallel groups for the roles that
    train (RLHFTopology); and the rollout replicas of ``step3.rollout`` on their own, when step
    3 is one of ``steps`` and asks for them."""
    conf, device = _worker_config(cfg)
    g, r = ActorGraph("rlhf"), cfg.step3.rollout
    classes = {"policy": PolicyActor, "reference": ReferenceActor, "reward": RewardActor,
               "critic": CriticActor}
    for name in roles(cfg):
        g.role(name, classes[name], cfg.ranks(name), num_cpus=cfg.num_cpus, config=conf,
               num_gpus=gpus_per_worker(cfg, device),
               colocate_with="policy" if cfg.colocate and name != "policy" else None,
               max_restarts=cfg.max_restarts, tensor_parallel=cfg.tp_of(name))
    if "rollout" in graph_roles(cfg, steps):  # engines on their own actors
        g.role("rollout", RolloutActor, cfg.ranks("rollout"), num_cpus=r.num_cpus,
               config=conf, num_gpus=(r.num_gpus or 1.0) if device == "cuda" else 0.0,
               max_restarts=r.max_restarts, tensor_parallel=cfg.tp_of("rollout"))
    topology = RLHFTopology.of_recipe(list(g.roles), cfg)
    topology.declare(g)
    graph = g.build(timeout_s=timeout_s, call_timeout_s=900,
                    collective_timeout_s=cfg.collective_timeout_s)
    try:
        setup_roles(graph, topology)
    except BaseException:
        graph.shutdown()
        raise
    return graph


def graph_roles(cfg: RLHFConfig, steps: tuple[str, ...] = STEPS) -> list[str]:
    """The roles of the graph that runs ``steps`` of ``cfg``: ``roles(cfg)``, and "rollout"
    when step 3 runs on replicas of its own."""
    r = cfg.step3.rollout
    replicas = r.replicas and STEP3 in steps and cfg.algo().online
    return roles(cfg) + (["rollout"] if replicas else [])


def reuse_graph(graph: Graph, cfg: RLHFConfig, steps: tuple[str, ...] = STEPS) -> Graph:
    """``graph`` (built by ``build_graph`` for another recipe with the same roles, ranks and
    groups) with every worker given ``cfg`` and its role built afresh: what a run builds,
    without starting its processes again. ValueError naming what differs."""
    want = {name: (cfg.ranks(name), cfg.tp_of(name)) for name in graph_roles(cfg, steps)}
    have = {name: (graph[name].world_size, graph[name].tensor_parallel) for name in graph.roles}
    if have != want:
        raise ValueError(f"this graph holds {have} (role: ranks, tensor_parallel); the recipe "
                         f"needs {want}")
    conf, _ = _worker_config(cfg)
    for call in [graph[name].invoke_async(PolicyActor.configure, conf) for name in graph.roles]:
        call.result()
    setup_roles(graph, RLHFTopology.of_recipe(list(graph.roles), cfg))
    return graph


def _worker_config(cfg: RLHFConfig) -> tuple[dict, str]:
    """What every worker is given (the recipe, its device resolved on this cluster), and
    that device."""
    info = init()
    r = cfg.step3.rollout
    needed = (sum(map(cfg.ranks, roles(cfg))) * gpus_per_worker(cfg, "cuda")
              + cfg.ranks("rollout") * (r.num_gpus or 1.0))
    device = cluster_device(cfg.device, info.num_gpus, needed, info.embedded)
    return cfg.model_copy(update={"device": device}).model_dump(), device


def load_data(cfg: RLHFConfig, steps: tuple[str, ...] = STEPS) -> Data:
    """The data ``steps`` read, checked (DataError naming the file, row and field, or the
    setting the data is too small for) and without the examples longer than the model's
    context (troupe.rlhf.plan)."""
    return plan(cfg, steps).data


def run(cfg: RLHFConfig, steps: tuple[str, ...] = STEPS, resume: bool = False,
        planned: Plan | None = None, graph: Graph | None = None) -> dict:
    """Run ``steps`` (a subset of "sft", "reward", "step3", in that order; "step3" is step 3
    whatever the algorithm, and its older name "ppo" is read as it) and return a summary; a
    later step alone uses the weights an earlier run left in ``out_dir``, and ``resume``
    continues step 3 from its latest checkpoint there. Step 2 is skipped when no learned
    reward model is used; step 3 without step 1's weights starts from the model's own (a
    pretrained model's only). ``planned``: ``troupe.rlhf.plan.plan(cfg, steps)``, which the
    apps make before Ray starts (else it is made here); its record opens metrics.jsonl. The
    summary holds step 3's result under "step3", and under "ppo" as it used to. ``graph``: one
    ``build_graph`` made for another run of the same roles and ranks, reused (``reuse_graph``)
    and left running at the end; by default the run builds its own and shuts it down."""
    steps = tuple(STEP3 if s == "ppo" else s for s in steps)
    if resume and ("sft" in steps or "reward" in steps):
        raise ValueError("resume continues step 3 from its checkpoint; run it with steps "
                         "('step3',) alone (steps 1 and 2 would change the weights it started "
                         "from)")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.model_dump(), indent=1))
    planned = planned or plan(cfg, steps)
    data = planned.data
    sft_path, reward_path = out / "sft" / "policy.trp", out / "reward" / "reward.trp"
    if STEP3 in steps:
        _check_inputs(cfg, steps, sft_path, reward_path)
    summary: dict = {"algorithm": cfg.algorithm, "steps": list(steps)}
    t0 = time.perf_counter()
    own = graph is None
    graph = build_graph(cfg, steps=steps) if own else reuse_graph(graph, cfg, steps)
    log = MetricsLog(out / "metrics.jsonl", cfg.logging, cfg.model_dump(mode="json"))
    log.write({**planned.record(), "step": 0})
    try:
        if "sft" in steps:
            run_sft(graph, cfg, data, log, out)
            summary["sft"] = evaluate_policy(graph, data, cfg.seed + 99)
            log.write({"kind": "sft_eval", "step": cfg.sft.steps, **summary["sft"]})
        if "reward" in steps and cfg.uses_reward_model():
            run_reward(graph, cfg, data, log, out)
            summary["reward_accuracy"] = log.records()[-1]["accuracy"]
        if STEP3 in steps:
            start = sft_path if sft_path.is_file() else None
            if not cfg.algo().online:  # learns the preference pairs
                summary[STEP3] = run_dpo(graph, cfg, data, log, out, start)
            else:
                summary[STEP3] = run_step3(graph, cfg, data, log, out, start,
                                           reward_path if cfg.uses_reward_model() else None,
                                           resume=resume)
            summary["ppo"] = summary[STEP3]  # its older name, for scripts that read it
            if cfg.model.pretrained is not None or cfg.model.gpt.moe is None:
                summary["exported"] = graph["policy"].invoke(PolicyActor.export,
                                                             str(out / "policy-hf"))[0]
    finally:
        log.close()
        if own:
            graph.shutdown()
    plot(log.records(), out / "rlhf.png")
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _check_inputs(cfg: RLHFConfig, steps: tuple[str, ...], sft_path: Path,
                  reward_path: Path) -> None:
    """Step 3's inputs exist (or will, from the steps run before it), before any work."""
    if "sft" not in steps and not sft_path.is_file() and cfg.model.pretrained is None:
        raise FileNotFoundError(f"step 3 starts from the SFT policy, and {sft_path} does not "
                                "exist: run step 1 first (a model.pretrained model can start "
                                "from its own weights)")
    if cfg.uses_reward_model() and "reward" not in steps and not reward_path.is_file():
        raise FileNotFoundError(f"step 3 scores with the reward model, and {reward_path} does "
                                "not exist: run step 2 first, or use reward.function alone "
                                "(reward.model_coef=0)")
