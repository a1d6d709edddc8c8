"""Driver of GPT pretraining: the trainer graph (data-parallel ranks; expert-parallel and
expert-data-parallel groups in DeepSpeed's layout; shard owners with offload), the step loop,
evaluation, metrics and checkpoints with exact resume.

At the end the model is exported as a Hugging Face directory, out_dir/hf, where it has one.

Failures follow troupe.runtime.recovery (max_restarts): the run goes back to its last
complete checkpoint and the losses it logs are the uninterrupted run's; past the restarts it
stops with RunFailedError and out_dir/failure.json.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from troupe import checkpoint as ckpt
from troupe.checkpoint.storage import StorePath
from troupe.collectives import straggler
from troupe.data import ByteTokens
from troupe.data.stream import StreamDataset, is_stream, prepare
from troupe.devices import cluster_device
from troupe.errors import WorkerCallError, WorkerDiedError, one_line
from troupe.models import save_pretrained
from troupe.models.hf_config import config_to_hf
from troupe.pretrain.config import PretrainConfig
from troupe.pretrain.export import load_full_model
from troupe.pretrain.plan import plan
from troupe.pretrain.rank import StepStats
from troupe.pretrain.topology import OWNER, TRAINER, PretrainTopology
from troupe.pretrain.workers import ShardOwnerActor, TrainerActor, RankInfo
from troupe.runtime import checkpoint
from troupe.runtime.cluster import init
from troupe.runtime.graph import ActorGraph
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog, plot_losses
from troupe.runtime.recovery import FailurePolicy, run_steps

log = logging.getLogger(__name__)


@dataclass
class Trainers:
    """A built pretraining graph and what its workers reported at setup."""

    graph: Graph
    trainers: list[RankInfo]
    owners: list[RankInfo]  # the shard owners' (train.offload), else empty
    topology: PretrainTopology | None = None  # the groups it was wired with

    def shutdown(self) -> None:
        self.graph.shutdown()


def build_graph(cfg: PretrainConfig, name: str = "pretrain",
                timeout_s: float | None = None) -> Trainers:
    """Start ``workers`` TrainerActor actors and, with train.offload, as many CPU-only
    ShardOwnerActor owners, wired with the groups of their PretrainTopology
    (troupe/pretrain/topology.py); then set every worker up with it. On cuda (``device``)
    each trainer asks Ray for ``num_gpus`` and the trainers' groups are NCCL's."""
    T, W, device = cfg.train, cfg.workers, _device(cfg)
    config = cfg.model_copy(update={"device": device})  # the workers' own choice (and class)
    num_gpus = cfg.num_gpus if device == "cuda" else 0.0
    g = ActorGraph(name).role(TRAINER, TrainerActor, W, num_cpus=cfg.threads, num_gpus=num_gpus,
                              strategy=T.strategy, max_restarts=cfg.max_restarts, config=config)
    if cfg.train.offload:
        g.role(OWNER, ShardOwnerActor, W, num_cpus=T.shard_cpus,
               max_restarts=cfg.max_restarts, config=config)
    topology = PretrainTopology.of(cfg)
    topology.declare(g)
    prepare_data(cfg)  # a streamed corpus' tokens, before any trainer reads them
    graph = g.build(timeout_s=timeout_s or T.placement_timeout_s, call_timeout_s=600,
                    collective_timeout_s=cfg.collective_timeout_s)
    try:
        trainers, owners = _both(graph, TrainerActor.setup, ShardOwnerActor.setup, topology)
    except BaseException:
        graph.shutdown()
        raise
    return Trainers(graph, trainers, owners, topology)


def reuse_graph(built: Trainers, cfg: PretrainConfig) -> Trainers:
    """``built`` (by ``build_graph`` for another recipe of the same ranks and groups) with
    every worker given ``cfg`` and set up afresh: what a run builds, without starting its
    processes again. ValueError naming what differs."""
    topology = PretrainTopology.of(cfg)
    want = {TRAINER: cfg.workers, **({OWNER: cfg.workers} if cfg.train.offload else {})}
    have = {name: built.graph[name].world_size for name in built.graph.roles}
    if have != want or topology != built.topology:
        raise ValueError(f"this graph holds {have} (role: ranks) wired as {built.topology}; "
                         f"the recipe needs {want} wired as {topology}")
    config = cfg.model_copy(update={"device": _device(cfg)})
    prepare_data(cfg)
    _both(built.graph, TrainerActor.configure, ShardOwnerActor.configure, config)
    trainers, owners = _both(built.graph, TrainerActor.setup, ShardOwnerActor.setup, topology)
    return Trainers(built.graph, trainers, owners, topology)


def _device(cfg: PretrainConfig) -> str:
    """Where the trainers compute, ``device`` resolved on this cluster."""
    info = init()
    return cluster_device(cfg.device, info.num_gpus, cfg.workers * cfg.num_gpus, info.embedded)


def _both(graph: Graph, trainer_method: Callable, owner_method: Callable, *args) -> list[list]:
    """Call the trainers' method and, when there are shard owners, the owners' method of the
    same name at once (their calls exchange tensors); returns [trainer results, owner
    results (empty without owners)]."""
    calls = [graph[TRAINER].invoke_async(trainer_method, *args)]
    if OWNER in graph.roles:
        calls.append(graph[OWNER].invoke_async(owner_method, *args))
    return [c.result() for c in calls] + [[]] * (2 - len(calls))


def _checkpointed(graph: Graph) -> list:
    """The roles a checkpoint holds, each with its save and load methods."""
    parts = [(graph[TRAINER], TrainerActor.save, TrainerActor.load)]
    if OWNER in graph.roles:
        parts.append((graph[OWNER], ShardOwnerActor.save, ShardOwnerActor.load))
    return parts


def run(cfg: PretrainConfig, resume: str | None = "auto", stop_after: int | None = None,
        progress: bool = True, on_step: Callable[[int, Graph], None] | None = None,
        export: Callable[[PretrainConfig, Path], object] | None = None,
        name: str = "pretrain", graph: Trainers | None = None) -> list[dict]:
    """Train per ``cfg``; returns the metric records of this run (also in out_dir/metrics.jsonl).

    resume: "auto" (the newest complete checkpoint in train.checkpoint_dir, by default
    out_dir/checkpoints, if any), a checkpoint directory, or None.
    stop_after: stop (with a checkpoint) after this step, as an interruption.
    on_step(step, graph): called before each step (fault injection, custom logging).
    export(cfg, out_dir): what is written once the last step is done (default: the Hugging
    Face directory out_dir/hf, when the model has that form). name: of the graph and the
    progress bar. graph: one ``build_graph`` made for another run of the same ranks and
    groups, reused (``reuse_graph``) and left running; by default the run builds its own.
    Raises RunFailedError once failures exceed max_restarts (see the module doc).
    """
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.model_dump(), indent=1))
    built = build_graph(cfg, name) if graph is None else reuse_graph(graph, cfg)
    try:
        records = _train(built.graph, cfg, resume, stop_after, progress, on_step, name)
        plot_losses(MetricsLog(out / "metrics.jsonl").records(), out / "loss.png",
                    f"{out.name}: {cfg.optimizer.name}")
    finally:
        if graph is None:
            built.shutdown()
    if stop_after is None or stop_after >= cfg.train.steps:
        if export is not None:
            export(cfg, out)
        elif exportable(cfg):
            export_hf(cfg, out / "hf")
    return records


def prepare_data(cfg: PretrainConfig) -> StreamDataset | None:
    """A streamed corpus (troupe.data.stream) tokenized once, off the trainers, in Ray tasks
    (reused when its tokens are in the cache already), as the trainers will read it; None for
    an in-memory source."""
    if not is_stream(cfg.data.source):
        return None
    init()
    return StreamDataset(prepare(cfg.data, cfg.model.pretrained, cfg.data.cache_dir),
                         cfg.data.seed)


def exportable(cfg: PretrainConfig) -> bool:
    """Whether the trained model has a Hugging Face form (troupe.models.save_pretrained):
    dense GPTs and the Llama family (Mixtral for MoE), not offloaded checkpoints."""
    try:
        config_to_hf(cfg.model.architecture())
    except ValueError as e:
        log.info("no Hugging Face export: %s", e)
        return False
    return not cfg.train.offload


def export_hf(cfg: PretrainConfig, directory: Path) -> Path:
    """The newest checkpoint's model as a Hugging Face directory, with its tokenizer: the
    pretrained model's tokenizer files when the run started from one, else troupe's byte
    tokenizer in Hugging Face's form (so RLHF and the server can start from the directory)."""
    newest = ckpt.latest(checkpoint_root(cfg))
    model = load_full_model(newest, cfg)
    save_pretrained(model, directory, cfg.model.pretrained)
    if cfg.model.pretrained is None:
        ByteTokens().save_pretrained(directory)
    log.info("exported %s as a Hugging Face directory: %s", newest, directory)
    return directory


def _train(graph: Graph, cfg: PretrainConfig, resume: str | None, stop_after: int | None,
           progress: bool, on_step: Callable[[int, Graph], None] | None,
           name: str = "pretrain") -> list[dict]:
    """The step loop (troupe.runtime.recovery.run_steps) from where ``resume`` says (see
    ``run``) to the last step; returns the records of the steps this run made."""
    out, T = Path(cfg.out_dir), cfg.train
    metrics = MetricsLog(out / "metrics.jsonl", cfg.logging, cfg.model_dump(mode="json"))
    policy = FailurePolicy("pretraining", graph, cfg.max_restarts, out, T.placement_timeout_s,
                           cfg.collective_timeout_s)
    start = _resume(graph, cfg, resume)
    metrics.truncate_after(start)
    records: list[dict] = []
    data = prepare_data(cfg)
    if data is not None:  # the corpus as prepared (its tokens, documents, skipped rows)
        metrics.write({**data.prepared.report(), "step": start})
    if start == 0:  # a run's first record: each rank's parameter, gradient and optimizer-state
        # bytes, beside the peak memory of its steps' records (a resumed run keeps it)
        records.append({"kind": "plan", "step": 0,
                        "memory_bytes": {"trainer": plan(cfg).bytes()}})
        metrics.write(records[-1])
    links = probe_links(graph)
    if links is not None:
        metrics.write({**links, "step": start})
    last = min(T.steps, stop_after or T.steps)

    def step(n: int) -> None:
        for rec in _step(graph, cfg, n, last):
            if data is not None and rec["kind"] == "train":
                rec.update(data.position(n, T.batch_size, cfg.model.window(
                    cfg.model.architecture())))
                bar.set_postfix(epoch=rec["epoch"], shard=rec["shard"], refresh=False)
            metrics.write(rec)
            records.append(rec)

    def restore() -> int:
        done = _restore(graph, cfg)
        records[:] = [r for r in records if r["step"] <= done]
        return done

    bar = tqdm(desc=name, disable=not progress, initial=start, total=T.steps)
    try:
        run_steps(policy, metrics, start, last, step, restore,
                  before_step=None if on_step is None else lambda n: on_step(n, graph), bar=bar)
    finally:
        bar.close()
        metrics.close()
    return records


def probe_links(graph: Graph, nbytes: int = 4 << 20) -> dict | None:
    """When the trainers span nodes: a ``links`` record of each data-parallel pair's transfer
    of ``nbytes`` (rank r to r + 1, one pair at a time) and the rank whose link is the slow
    one, if one stands out (troupe.collectives.straggler.slowest_rank); None on one node."""
    nodes = graph.placement([TRAINER])[TRAINER]
    if len(set(nodes)) < 2:
        return None
    try:
        answers = graph[TRAINER].invoke(TrainerActor.probe_links, nbytes)
    except (WorkerDiedError, WorkerCallError) as e:  # the steps' own recovery will meet it
        log.warning("the link probe failed: %s", one_line(e))
        return None
    seconds, where = answers[0]["seconds"], [a["node"] for a in answers]
    W = len(where)
    slow = straggler.slowest_rank(seconds)
    return {"kind": "links", "bytes": nbytes,
            "pairs": [{"from": f"rank {k} ({where[k]})", "to": f"rank {(k + 1) % W} "
                       f"({where[(k + 1) % W]})", "seconds": round(s, 4),
                       "mb_per_s": round(nbytes / s / 1e6, 1) if s > 0 else None}
                      for k, s in enumerate(seconds)],
            "slowest": None if slow is None else f"rank {slow} on {where[slow]}"}


def _resume(graph: Graph, cfg: PretrainConfig, resume: str | None) -> int:
    """Load the checkpoint ``resume`` names ("auto": the newest complete one that loads, a
    damaged one skipped with a warning); returns its step, 0 for a fresh start."""
    if resume is None:
        return 0
    expect = {"optimizer": cfg.optimizer.name, "zero_stage": cfg.zero_stage}
    # ZeRO-2/3, and ZeRO-1's elementwise optimizers, cut the saved shards again for this run's
    # number of trainers and tensor_parallel (troupe.pretrain.rank.Trainer.load_other_layout)
    reshard = (TRAINER,) if cfg.zero_stage != 1 or cfg.optimizer.sharded else ()
    if resume == "auto":
        found = checkpoint.restore_latest(_checkpointed(graph), checkpoint_root(cfg),
                                          cfg.model.record(), expect, reshard)
        source, start = found if found is not None else (None, 0)
    else:
        source, start = resume, checkpoint.restore(_checkpointed(graph), resume,
                                                   cfg.model.record(), expect, reshard)
    if source is not None:
        log.info("resumed from %s at step %d", source, start)
    return start


def checkpoint_root(cfg: PretrainConfig) -> StorePath:
    """Where the run's checkpoints go: train.checkpoint_dir, or out_dir/checkpoints."""
    return cfg.train.checkpoint_dir or Path(cfg.out_dir) / "checkpoints"


def _step(graph: Graph, cfg: PretrainConfig, step: int, last: int) -> list[dict]:
    """One optimizer step on every rank, then the evaluation and checkpoint it is due."""
    T = cfg.train
    ranks: list[StepStats] = _both(graph, TrainerActor.train_step,
                                   ShardOwnerActor.train_step, step)[0]
    out = [{"kind": "train", **asdict(ranks[0]),
            "loss": sum(r.loss for r in ranks) / len(ranks),
            "aux_loss": sum(r.aux_loss for r in ranks) / len(ranks),
            "tokens": sum(r.tokens for r in ranks),
            "a2a_bytes": sum(r.a2a_bytes for r in ranks),
            "seconds": max(r.seconds for r in ranks),
            "compute_s": max(r.compute_s for r in ranks),
            "comm_s": max(r.comm_s for r in ranks),
            "data_s": max(r.data_s for r in ranks),  # the slowest rank's wait for its rows
            # the slowest rank's seconds outside collectives: what the step is without links
            "busy_s": max(r.seconds - r.comm_s for r in ranks),
            "peak_memory_mb": max(r.peak_memory_mb for r in ranks)}]
    if (T.eval_every and step % T.eval_every == 0) or step == T.steps:
        val = sum(graph[TRAINER].invoke(TrainerActor.evaluate)) / cfg.workers
        out.append({"kind": "eval", "step": step, "val_loss": val})
    if (T.checkpoint_every and step % T.checkpoint_every == 0) or step in (last, T.steps):
        checkpoint.save(_checkpointed(graph), checkpoint_root(cfg), step, model=cfg.model.record(),
                        optimizer=cfg.optimizer.name, zero_stage=cfg.zero_stage,
                        config=cfg.model_dump(mode="json"))
    return out


def _restore(graph: Graph, cfg: PretrainConfig) -> int:
    """After a restart: every worker set up afresh and loaded from the last complete
    checkpoint (none: the initial state); returns its step."""
    _both(graph, TrainerActor.setup, ShardOwnerActor.setup, PretrainTopology.of(cfg))
    return _resume(graph, cfg, "auto")
