"""Driver of GPT pretraining: the trainer graph (data-parallel ranks; expert-parallel and
expert-data-parallel groups in DeepSpeed's layout), the step loop, evaluation, metrics and
checkpoints with exact resume.

Failure policy (train.max_restarts): when a worker dies or a step raises, Ray restarts the lost
worker, every group is rebuilt under a new generation, all workers are set up again and loaded
from the last complete checkpoint, and the run goes on from there; the losses it logs are the
uninterrupted run's. After max_restarts failures the run stops with RunFailedError and writes
out_dir/failure.json naming each failure's role, rank, node and cause.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from troupe.actors import ParameterShardRank, PretrainRank
from troupe.errors import RunFailedError, WorkerCallError, WorkerDiedError, failure_record
from troupe.models.moe import expert_layout
from troupe.runtime import checkpoint
from troupe.runtime.graph import ActorGraph, rewire
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog, plot_losses
from troupe.training import PretrainConfig
from troupe.training.storage import StorePath

log = logging.getLogger(__name__)


def build_graph(cfg: PretrainConfig, name: str = "pretrain", num_cpus: float = 1.0,
                num_gpus: float = 0.0, timeout_s: float | None = None) -> Graph:
    """Start ``train.num_workers`` PretrainRank actors wired with "dp" (and "ep"/"edp"); with
    train.offload, as many CPU-only ParameterShardRank owners ("shard") and the "offload" group
    of trainers and owners. ``graph.info`` / ``graph.owner_info`` hold each trainer's / owner's
    pid and memory figures."""
    T, config = cfg.train, cfg.model_dump()
    W = T.num_workers
    g = ActorGraph(name).role("trainer", PretrainRank, W, num_cpus=num_cpus, num_gpus=num_gpus,
                              strategy=T.strategy, max_restarts=T.max_restarts, config=config)
    if W > 1:
        g.collective("dp", ["trainer"])
    if cfg.train.offload:
        g.role("shard", ParameterShardRank, W, num_cpus=T.shard_cpus,
               max_restarts=T.max_restarts, config=config)
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
    graph = g.build(timeout_s=timeout_s or T.placement_timeout_s, call_timeout_s=600)
    try:
        _setup(graph)
    except BaseException:
        graph.shutdown()
        raise
    return graph


def _setup(graph: Graph) -> None:
    graph.info, *owners = together(graph, "setup")
    graph.owner_info = owners[0] if owners else []


def together(graph: Graph, method: str, *args) -> list[list]:
    """Call ``method`` on the trainers and, when there are any, the shard owners at once (their
    calls exchange tensors with each other); returns [trainer results, owner results]."""
    refs = [(role, role.call_async(method, *args)) for role in _roles(graph)]
    return [role.get(r, method) for role, r in refs]


def _roles(graph: Graph) -> list:
    """The trainers, then the shard owners when the graph has them."""
    return [graph[r] for r in ("trainer", "shard") if r in graph.roles]


def run(cfg: PretrainConfig, resume: str | None = "auto", stop_after: int | None = None,
        progress: bool = True, on_step: Callable[[int, Graph], None] | None = None) -> list[dict]:
    """Train per ``cfg``; returns the metric records of this run (also in out_dir/metrics.jsonl).

    resume: "auto" (the newest complete checkpoint in train.checkpoint_dir, by default
    out_dir/checkpoints, if any), a checkpoint directory, or None.
    stop_after: stop (with a checkpoint) after this step, as an interruption.
    on_step(step, graph): called before each step (fault injection, custom logging).
    Raises RunFailedError once failures exceed train.max_restarts (see the module doc).
    """
    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.model_dump(), indent=1))
    ckpt_root, metrics = checkpoint_root(cfg), MetricsLog(out / "metrics.jsonl")
    graph = build_graph(cfg)
    try:
        source = checkpoint.latest(ckpt_root) if resume == "auto" else resume
        start = 0
        if source is not None:
            start = checkpoint.restore(_roles(graph), source)
            log.info("resumed from %s at step %d", source, start)
        metrics.truncate_after(start)
        records: list[dict] = []
        failures: list[dict] = []
        last = min(cfg.train.steps, stop_after or cfg.train.steps)
        bar = tqdm(desc="pretrain", disable=not progress, initial=start, total=cfg.train.steps)
        step = start + 1
        while step <= last:
            if on_step is not None:
                on_step(step, graph)
            try:
                done = _step(graph, cfg, step, last, ckpt_root)
            except (WorkerDiedError, WorkerCallError) as e:
                failures.append(failure_record(e, step=step))
                start = _recover(graph, cfg, failures, out)
                records = [r for r in records if r["step"] <= start]
                metrics.truncate_after(start)
                metrics.write({**failures[-1], "kind": "recovery", "failure": failures[-1]["kind"],
                               "step": start, "failed_step": step})
                bar.n = start
                step = start + 1
                continue
            for rec in done:
                metrics.write(rec)
            records += done
            bar.update(1)
            step += 1
        bar.close()
        plot_losses(metrics.records(), out / "loss.png", f"{out.name}: {cfg.optimizer.name}")
        return records
    finally:
        graph.shutdown()


def checkpoint_root(cfg: PretrainConfig) -> StorePath:
    """Where the run's checkpoints go: train.checkpoint_dir, or out_dir/checkpoints."""
    return cfg.train.checkpoint_dir or Path(cfg.train.out_dir) / "checkpoints"


def _step(graph: Graph, cfg: PretrainConfig, step: int, last: int,
          ckpt_root: StorePath) -> list[dict]:
    """One optimizer step on every rank, then the evaluation and checkpoint it is due."""
    T = cfg.train
    ranks = together(graph, "train_step", step)[0]
    out = [{"kind": "train", **ranks[0], "loss": sum(r["loss"] for r in ranks) / len(ranks),
            "aux_loss": sum(r["aux_loss"] for r in ranks) / len(ranks),
            "tokens": sum(r["tokens"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks)}]
    if (T.eval_every and step % T.eval_every == 0) or step == T.steps:
        val = sum(graph["trainer"].call("evaluate")) / T.num_workers
        out.append({"kind": "eval", "step": step, "val_loss": val})
    if (T.checkpoint_every and step % T.checkpoint_every == 0) or step in (last, T.steps):
        checkpoint.save(_roles(graph), ckpt_root, step, optimizer=cfg.optimizer.name,
                        config=cfg.model_dump(mode="json"))
    return out


def _recover(graph: Graph, cfg: PretrainConfig, failures: list[dict], out: Path) -> int:
    """Apply the failure policy to the newest of ``failures`` (a run writing to ``out``):
    give up with a report, or bring every worker back (Ray restarts the lost ones), rebuild the
    groups, set the workers up and load the last complete checkpoint (none: the initial state).
    Returns the step to go on after."""
    T = cfg.train
    if len(failures) > T.max_restarts:
        _give_up(failures, out)
    f = failures[-1]
    log.warning("pretraining: role %r rank %s on node %s %s at step %d; restart %d of %d from "
                "the last checkpoint", f["role"], f["rank"], f["node_id"], f["cause"], f["step"],
                len(failures), T.max_restarts)
    roles = _roles(graph)
    try:
        for role in roles:
            role.wait_ready(T.placement_timeout_s)
        rewire(graph, generation=len(failures), timeout_s=T.placement_timeout_s)
        _setup(graph)
        source = checkpoint.latest(checkpoint_root(cfg))
        return checkpoint.restore(roles, source) if source is not None else 0
    except (WorkerDiedError, WorkerCallError) as e:  # a worker that cannot come back
        failures.append(failure_record(e, step=f["step"], during="recovery"))
        _give_up(failures, out)


def _give_up(failures: list[dict], out: Path) -> None:
    (out / "failure.json").write_text(json.dumps({"failures": failures}, indent=1))
    raise RunFailedError("pretraining", len(failures) - 1, failures)
