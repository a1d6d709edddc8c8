"""Expert-parallel serving: a replica of a MoE model whose experts live in ``expert_parallel``
ServeRank actors (rank r holds every dense weight and experts r*n .. (r+1)*n - 1 of each MoE
layer). The replica (``ExpertParallelReplica``, a ServeReplica) decodes through
``ExpertParallelBatcher``: new sequences go to the rank with the fewest, and every step runs
on all ranks at once, since each forward pass exchanges tokens with the other ranks' experts
through all_to_all over the "ep" group. Should a rank die, the replica is broken for good and
Ray Serve replaces it (troupe.serving.deploy)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import ray
import torch

from troupe.actors import Dispatch, PerRank, dispatch
from troupe.config import validate
from troupe.errors import WorkerDiedError
from troupe.generation import ContinuousBatcher, Event, SamplingParams
from troupe.parallel import apply_expert_parallel
from troupe.runtime.graph import ActorGraph
from troupe.runtime.handle import Graph
from troupe.runtime.topology import Group, Topology
from troupe.serving.config import ServeConfig
from troupe.serving.model import (calibrate, load_source, placed, quantize_served,
                                  source_tokenizer, weight_bytes)
from troupe.serving.replica import ServeReplica


@dataclass(frozen=True)
class RankModel:
    """What an expert-parallel rank holds once set up."""

    seq_len: int
    weight_bytes: int
    quantized: dict[str, str]  # module name -> quantization mode
    vocab_size: int


@dataclass(frozen=True)
class ServingTopology(Topology):
    """An expert-parallel replica's one group: "ep" over its ranks (NCCL between GPU ranks,
    else gloo)."""

    ep: Group = Group("ep", ("expert",))


class ServeRank:
    """Expert-parallel rank r of a served MoE model: every dense weight (quantized as the
    config says), experts r*n .. (r+1)*n - 1 of each MoE layer, and a continuous batcher over
    the sequences given to this rank. All ranks step together (lockstep), since each forward
    pass exchanges tokens with the other ranks' experts through all_to_all over the topology's
    "ep" group."""

    def __init__(self, config: dict[str, Any]):
        self.cfg = validate(ServeConfig, config, "serve config")
        torch.set_num_threads(self.cfg.threads)
        self.batcher: ContinuousBatcher | None = None

    @dispatch(Dispatch.ALL)
    def setup(self, topology: ServingTopology) -> RankModel:
        tok = source_tokenizer(self.cfg.model)
        model = placed(load_source(self.cfg.model), self.cfg)
        outliers = calibrate(model, self.cfg, tok)  # on the whole model: the same on every rank
        model = apply_expert_parallel(model, topology.ep.communicator())
        modes = quantize_served(model, self.cfg, outliers)
        self.batcher = ContinuousBatcher(model, tok.eos_id, self.cfg.limits.max_batch,
                                         lockstep=True, tokenizer=tok.hf)
        return RankModel(model.cfg.seq_len, weight_bytes(model), modes, model.cfg.vocab_size)

    @dispatch(Dispatch.ALL)
    def step(self, work: tuple[list, list]) -> list[Event]:
        """Take new sequences (seq_id, prompt, SamplingParams) and cancellations, then one
        lockstep step; returns its events (give each rank its own work with PerRank)."""
        adds, cancels = work
        for seq_id, prompt, params in adds:
            self.batcher.add(seq_id, prompt, params)
        for seq_id in cancels:
            self.batcher.cancel(seq_id)
        return self.batcher.step()


class ExpertParallelBatcher:
    """The ContinuousBatcher interface over a graph of ServeRank actors: new sequences go to
    the rank with the fewest, and every step runs on all ranks at once (one Ray call each,
    carrying that rank's new sequences and cancellations). ``lost`` says why the gang is
    broken, once a rank has died: the others cannot step without it."""

    adapters = prefix_cache = grammars = None  # the serving Batcher protocol: none of them
    structured_outputs = False
    prefill_tokens = 0
    speculation = {"passes": 0, "proposed": 0, "accepted": 0}  # none: a lockstep engine

    def __init__(self, graph: Graph):
        self.graph, self.ranks = graph, graph["expert"]
        self.lost: str | None = None
        self.where: dict[str, int] = {}  # sequence -> rank
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._cancels: list[str] = []
        self._lock = threading.Lock()

    def add(self, seq_id: str, prompt: list[int], params: SamplingParams) -> None:
        with self._lock:
            self._adds.append((seq_id, list(prompt), params))

    def cancel(self, seq_id: str) -> None:
        with self._lock:
            self._cancels.append(seq_id)

    def waiting(self) -> int:
        return 0  # each rank admits what it is given at the next step

    def kv_usage(self) -> tuple[int, int]:
        return 0, 0  # the ranks' caches are theirs (not reported through the replica)

    def has_work(self) -> bool:
        return bool(self.where or self._adds)

    def reset(self) -> list[str]:
        """Drop every sequence (the ranks drop theirs at the next step); returns their ids."""
        with self._lock:
            dropped = list(self.where) + [seq[0] for seq in self._adds]
            self._cancels += list(self.where)  # sent to their ranks by the next step
            self._adds = []
        return dropped

    def active_ids(self) -> list[str]:
        return list(self.where)

    def step(self) -> list[Event]:
        with self._lock:
            adds, self._adds = self._adds, []
            cancels, self._cancels = self._cancels, []
        P = self.ranks.world_size
        work: list[tuple[list, list]] = [([], []) for _ in range(P)]
        load = Counter(self.where.values())
        for seq in adds:
            r = min(range(P), key=load.__getitem__)
            self.where[seq[0]] = r
            load[r] += 1
            work[r][0].append(seq)
        for seq_id in cancels:
            r = self.where.pop(seq_id, None)
            if r is not None:
                work[r][1].append(seq_id)
        try:
            stepped = self.ranks.invoke(ServeRank.step, PerRank(work))
        except WorkerDiedError as e:
            self._lose(e)
            raise
        events = [e for rank_events in stepped for e in rank_events]
        for e in events:
            if e.finish_reason is not None:
                self.where.pop(e.seq_id, None)
        return events

    async def probe(self, timeout_s: float = 1.0) -> None:
        """Ask every rank whether it lives (a rank busy stepping answers late; only a death
        counts); a dead one sets ``lost``."""
        if self.lost is not None:
            return
        refs = [actor.ready.remote() for actor in self.ranks.actors]
        futures = [asyncio.wrap_future(ref.future()) for ref in refs]
        done, pending = await asyncio.wait(futures, timeout=timeout_s)
        for f in pending:
            f.cancel()
        for rank, f in enumerate(futures):
            if f in done and isinstance(f.exception(), ray.exceptions.RayActorError):
                self._lose(self.ranks.died(rank, f.exception()))
                return

    def _lose(self, e: WorkerDiedError) -> None:
        self.lost = f"expert-parallel rank {e.rank} died: {e.cause}".split("\n")[0]

    def shutdown(self) -> None:
        self.graph.shutdown()


class ExpertParallelReplica(ServeReplica):
    """A ServeReplica whose MoE model lives in ``expert_parallel`` ServeRank actors. Should
    one of them die, the replica is broken for good: ``/health`` answers 503 at once (it asks
    the ranks), requests get 503, and Ray Serve's health check (every second) has it replaced,
    a new replica with a new gang; the old gang's actors and placement group go with the old
    replica (``__del__``)."""

    def broken(self) -> str | None:
        return self.batcher.lost

    async def probe(self) -> None:
        await self.batcher.probe()

    def __del__(self):  # Serve calls it when it stops the replica
        batcher = getattr(self, "batcher", None)
        if batcher is not None:
            batcher.shutdown()

    def _make_batcher(self) -> tuple[Any, dict[str, Any]]:
        P = self.cfg.expert_parallel
        g = ActorGraph(f"serve-{uuid.uuid4().hex[:8]}")
        gpus = self.cfg.num_gpus if self.cfg.device == "cuda" else 0.0
        g.role("expert", ServeRank, P, num_cpus=self.cfg.num_cpus, num_gpus=gpus,
               config=self.cfg.model_dump())
        topology = ServingTopology()
        topology.declare(g)
        graph = g.build(timeout_s=300, call_timeout_s=300)
        infos = graph["expert"].invoke(ServeRank.setup, topology)
        return ExpertParallelBatcher(graph), {
            "seq_len": infos[0].seq_len, "vocab_size": infos[0].vocab_size, "expert_parallel": P,
            "weight_bytes": [i.weight_bytes for i in infos], "quantized": infos[0].quantized}
