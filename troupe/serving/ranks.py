"""A replica whose model lives in several ServeRank actors, which step together:

- expert-parallel (``expert_parallel`` ranks of a MoE model: rank r holds every dense weight
  and experts r*n .. (r+1)*n - 1 of each MoE layer): new sequences go to the rank with the
  fewest, and every step runs on all ranks at once, since each forward pass exchanges tokens
  with the other ranks' experts through all_to_all over the "ep" group;
- tensor-parallel (``tensor_parallel`` ranks, troupe.parallel.tensor: each holds its share of
  every layer's heads, MLP and vocabulary, quantized on its own): every rank runs every
  sequence, since each pass all-reduces over the "tp" group; they decide the same tokens
  (the logits are gathered whole on each, and sampling draws by (seed, request, position)),
  so the replica reads rank 0's events.

The replica (``RankedReplica``, a ServeReplica) decodes through ``RankBatcher``. Should a rank
die, the replica is broken for good and Ray Serve replaces it (troupe.serving.deploy)."""

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
from troupe.generation.grammar import Grammars
from troupe.generation.prefix_cache import PrefixCache
from troupe.parallel import apply_expert_parallel, apply_tensor_parallel
from troupe.parallel.tensor import bias_on_first_rank
from troupe.runtime.graph import ActorGraph
from troupe.runtime.handle import Graph
from troupe.runtime.topology import Group, Topology
from troupe.serving.config import ServeConfig
from troupe.serving.model import (calibrate, load_source, placed, quantize_served,
                                  source_tokenizer, weight_bytes)
from troupe.serving.replica import ServeReplica


ROLE = "rank"  # the ranks' role in the replica's graph


@dataclass(frozen=True)
class RankModel:
    """What a rank holds once set up."""

    seq_len: int
    weight_bytes: int
    quantized: dict[str, str]  # module name -> quantization mode
    vocab_size: int


@dataclass(frozen=True)
class ServingTopology(Topology):
    """A replica's one group over its ranks (NCCL between GPU ranks, else gloo): "ep"
    (expert-parallel) or "tp" (tensor-parallel)."""

    ep: Group | None = None
    tp: Group | None = None

    @classmethod
    def of(cls, cfg: ServeConfig) -> "ServingTopology":
        if cfg.tensor_parallel > 1:
            return cls(tp=Group("tp", (ROLE,)))
        return cls(ep=Group("ep", (ROLE,)))


class ServeRank:
    """Rank r of a served model split over several actors. Expert-parallel: every dense
    weight (quantized as the config says), experts r*n .. (r+1)*n - 1 of each MoE layer, and a
    continuous batcher over the sequences given to this rank; all ranks step together
    (lockstep), since each forward pass exchanges tokens with the other ranks' experts through
    all_to_all over the "ep" group. Tensor-parallel: its shards of every layer, quantized
    here, and a continuous batcher over every sequence (each rank is given the same work)."""

    def __init__(self, config: dict[str, Any]):
        self.cfg = validate(ServeConfig, config, "serve config")
        torch.set_num_threads(self.cfg.threads)
        self.batcher: ContinuousBatcher | None = None
        self.tok = None

    @dispatch(Dispatch.ALL)
    def setup(self, topology: ServingTopology) -> RankModel:
        tok = self.tok = source_tokenizer(self.cfg.model)
        model = placed(load_source(self.cfg.model), self.cfg)
        if topology.tp is not None:  # each rank finds its own shards' outlier channels
            model = apply_tensor_parallel(model, topology.tp.communicator(), training=False)
            modes = quantize_served(model, self.cfg, calibrate(model, self.cfg, tok))
            bias_on_first_rank(model)
        else:  # calibrated whole: the same channels on every rank
            outliers = calibrate(model, self.cfg, tok)
            model = apply_expert_parallel(model, topology.ep.communicator())
            modes = quantize_served(model, self.cfg, outliers)
        # the expert ranks run their own sequences and stand in for each other's passes;
        # the tensor-parallel ranks all run the same ones, and so find the same prompts in
        # their prefix caches (each of its own shards' keys and values)
        mb = self.cfg.prefix_cache_mb if topology.tp is not None else 0
        self.batcher = ContinuousBatcher(model, tok.eos_id, self.cfg.limits.max_batch,
                                         lockstep=topology.tp is None, tokenizer=tok.hf,
                                         prefix_cache=PrefixCache(int(mb * 2**20)) if mb
                                         else None)
        return RankModel(model.cfg.seq_len, weight_bytes(model), modes, model.cfg.vocab_size)

    @dispatch(Dispatch.ALL)
    def step(self, work: tuple[list, list]) -> list[Event]:
        """Take new sequences (seq_id, prompt, SamplingParams) and cancellations, then one
        lockstep step; returns its events (give each rank its own work with PerRank)."""
        adds, cancels = work
        for seq_id, prompt, params in adds:
            if params.constraint is not None and self.batcher.grammars is None:
                # tensor-parallel ranks mask the same tokens: the same grammar, the same
                # whole logits (the replica checked the constraint compiles)
                self.batcher.grammars = Grammars(self.tok.hf, self.batcher.cfg.vocab_size,
                                                 self.tok.eos_id)
            self.batcher.add(seq_id, prompt, params)
        for seq_id in cancels:
            self.batcher.cancel(seq_id)
        return self.batcher.step()


class RankBatcher:
    """The ContinuousBatcher interface over a graph of ServeRank actors: every step runs on all
    ranks at once (one Ray call each, carrying that rank's new sequences and cancellations).
    Expert-parallel, new sequences go to the rank with the fewest; ``replicated``
    (tensor-parallel), every rank gets every sequence and rank 0's events are the replica's.
    ``lost`` says why the gang is broken, once a rank has died: the others cannot step
    without it."""

    adapters = prefix_cache = None  # the serving Batcher protocol: none here (the
    # tensor-parallel ranks keep their own prefix caches)
    prefill_tokens = 0
    speculation = {"passes": 0, "proposed": 0, "accepted": 0}  # none: a lockstep engine

    def __init__(self, graph: Graph, replicated: bool = False):
        self.graph, self.ranks, self.replicated = graph, graph[ROLE], replicated
        # constraints: checked by the replica (``grammars``, made there at the first one),
        # sampled by each tensor-parallel rank; the expert ranks' lockstep passes take none
        self.structured_outputs, self.grammars = replicated, None
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
            r = 0 if self.replicated else min(range(P), key=load.__getitem__)
            self.where[seq[0]] = r
            load[r] += 1
            work[r][0].append(seq)
        for seq_id in cancels:
            r = self.where.pop(seq_id, None)
            if r is not None:
                work[r][1].append(seq_id)
        if self.replicated:  # every rank the same work
            work = [work[0]] * P
        try:
            stepped = self.ranks.invoke(ServeRank.step, PerRank(work))
        except WorkerDiedError as e:
            self._lose(e)
            raise
        events = (stepped[0] if self.replicated
                  else [e for rank_events in stepped for e in rank_events])
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
        kind = "tensor" if self.replicated else "expert"
        self.lost = f"{kind}-parallel rank {e.rank} died: {e.cause}".split("\n")[0]

    def shutdown(self) -> None:
        self.graph.shutdown()


class RankedReplica(ServeReplica):
    """A ServeReplica whose model lives in ``expert_parallel`` or ``tensor_parallel``
    ServeRank actors. Should
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
        cfg = self.cfg
        P = max(cfg.expert_parallel, cfg.tensor_parallel)
        g = ActorGraph(f"serve-{uuid.uuid4().hex[:8]}")
        gpus = cfg.num_gpus if cfg.device == "cuda" else 0.0
        g.role(ROLE, ServeRank, P, num_cpus=cfg.num_cpus, num_gpus=gpus,
               config=cfg.model_dump())
        topology = ServingTopology.of(cfg)
        topology.declare(g)
        graph = g.build(timeout_s=300, call_timeout_s=300)
        try:
            infos = graph[ROLE].invoke(ServeRank.setup, topology)
        except BaseException:
            graph.shutdown()
            raise
        return RankBatcher(graph, replicated=topology.tp is not None), {
            "seq_len": infos[0].seq_len, "vocab_size": infos[0].vocab_size,
            "expert_parallel": cfg.expert_parallel, "tensor_parallel": cfg.tensor_parallel,
            "weight_bytes": [i.weight_bytes for i in infos], "quantized": infos[0].quantized}
