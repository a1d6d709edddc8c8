"""Driver of GPT pretraining: the trainer graph (data-parallel ranks; expert-parallel and
expert-data-parallel groups in DeepSpeed's layout), the step loop, evaluation, metrics and
checkpoints with exact resume."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tqdm import tqdm

from troupe.actors import ParameterShardRank, PretrainRank
from troupe.models.moe import expert_layout
from troupe.runtime import checkpoint
from troupe.runtime.graph import ActorGraph
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog, plot_losses
from troupe.training import PretrainConfig

log = logging.getLogger(__name__)


def build_graph(cfg: PretrainConfig, name: str = "pretrain", num_cpus: float = 1.0,
                num_gpus: float = 0.0, timeout_s: float = 300.0) -> Graph:
    """Start ``train.num_workers`` PretrainRank actors wired with "dp" (and "ep"/"edp"); with
    train.offload, as many CPU-only ParameterShardRank owners ("shard") and the "offload" group
    of trainers and owners. ``graph.info`` / ``graph.owner_info`` hold each trainer's / owner's
    pid and memory figures."""
    W, config = cfg.train.num_workers, cfg.model_dump()
    g = ActorGraph(name).role("trainer", PretrainRank, W, num_cpus=num_cpus, num_gpus=num_gpus,
                              config=config)
    if W > 1:
        g.collective("dp", ["trainer"])
    if cfg.train.offload:
        g.role("shard", ParameterShardRank, W, num_cpus=cfg.train.shard_cpus, config=config)
        g.collective("offload", ["trainer", "shard"], backend="gloo")
        if cfg.optimizer.name == "lamb" and W > 1:
            g.collective("owners", ["shard"], backend="gloo")
    moe = cfg.model.moe
    if moe is not None:
        layout = expert_layout(W, moe.ep_size)
        if moe.ep_size > 1:
            g.collective("ep", ["trainer"], parts=layout.ep_groups)
        if W // moe.ep_size > 1:
            g.collective("edp", ["trainer"], parts=layout.edp_groups)
    graph = g.build(timeout_s=timeout_s, call_timeout_s=600)
    try:
        graph.info, *owners = together(graph, "setup")
        graph.owner_info = owners[0] if owners else []
    except BaseException:
        graph.shutdown()
        raise
    return graph


def together(graph: Graph, method: str, *args) -> list[list]:
    """Call ``method`` on the trainers and, when there are any, the shard owners at once (their
    calls exchange tensors with each other); returns [trainer results, owner results]."""
    refs = [(role, role.call_async(method, *args)) for role in _roles(graph)]
    return [role.get(r, method) for role, r in refs]


def _roles(graph: Graph) -> list:
    """The trainers, then the shard owners when the graph has them."""
    return [graph[r] for r in ("trainer", "shard") if r in graph.roles]


def run(cfg: PretrainConfig, resume: str | None = "auto", stop_after: int | None = None,
        progress: bool = True) -> list[dict]:
    """Train per ``cfg``; returns the metric records of this run (also in out_dir/metrics.jsonl).

    resume: "auto" (the newest complete checkpoint in out_dir/checkpoints, if any), a checkpoint
    directory, or None. stop_after: stop (with a checkpoint) after this step, as an interruption.
    """
    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.model_dump(), indent=1))
    ckpt_root, metrics = out / "checkpoints", MetricsLog(out / "metrics.jsonl")
    graph = build_graph(cfg)
    try:
        trainer, start, roles = graph["trainer"], 0, _roles(graph)
        source = checkpoint.latest(ckpt_root) if resume == "auto" else resume
        if source is not None:
            start = checkpoint.restore(roles, source)
            log.info("resumed from %s at step %d", source, start)
        metrics.truncate_after(start)
        records, T = [], cfg.train
        last = min(T.steps, stop_after or T.steps)
        for step in tqdm(range(start + 1, last + 1), desc="pretrain", disable=not progress,
                         initial=start, total=T.steps):
            ranks = together(graph, "train_step", step)[0]
            rec = {"kind": "train", **ranks[0], "loss": sum(r["loss"] for r in ranks) / len(ranks),
                   "aux_loss": sum(r["aux_loss"] for r in ranks) / len(ranks),
                   "tokens": sum(r["tokens"] for r in ranks),
                   "seconds": max(r["seconds"] for r in ranks)}
            records.append(rec)
            metrics.write(rec)
            if (T.eval_every and step % T.eval_every == 0) or step == T.steps:
                val = sum(trainer.call("evaluate")) / T.num_workers
                records.append({"kind": "eval", "step": step, "val_loss": val})
                metrics.write(records[-1])
            if (T.checkpoint_every and step % T.checkpoint_every == 0) or step in (last, T.steps):
                checkpoint.save(roles, ckpt_root, step, optimizer=cfg.optimizer.name)
        plot_losses(metrics.records(), out / "loss.png", f"{out.name}: {cfg.optimizer.name}")
        return records
    finally:
        graph.shutdown()
