"""Driver side of serving: the OpenAI-compatible app on Ray Serve, one ServeReplica per
replica, behind Serve's HTTP proxy. With ``expert_parallel`` > 1 each replica of a MoE model
builds a graph of ServeRank actors that hold its experts between them and decode its
sequences in lockstep, exchanging tokens through all_to_all."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
import time
import urllib.request
import uuid
from dataclasses import asdict
from collections import Counter
from typing import Any

import ray

from troupe.actors import PerRank
from troupe.devices import cluster_device
from troupe.errors import WorkerDiedError
from troupe.generation import Event, SamplingParams
from troupe.runtime.cluster import init
from troupe.runtime.graph import ActorGraph
from troupe.runtime.handle import Graph
from troupe.serving.auth import KeyDigest, take_key
from troupe.serving.model import locate
from troupe.serving.protocol import ServeConfig
from troupe.serving.replica import ServeRank, ServeReplica, ServingTopology

log = logging.getLogger(__name__)

APP = "troupe-openai"


class ExpertParallelBatcher:
    """The ContinuousBatcher interface over a graph of ServeRank actors: new sequences go to
    the rank with the fewest, and every step runs on all ranks at once (one Ray call each,
    carrying that rank's new sequences and cancellations). ``lost`` says why the gang is
    broken, once a rank has died: the others cannot step without it."""

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


def proxy_location(host: str) -> str:
    """Where Serve runs its HTTP proxies: on every node when ``host`` is a wildcard (0.0.0.0,
    ::; a load balancer may reach any node), else on the head alone, the one machine that has
    the address (a proxy elsewhere could not bind it, and Serve retries it forever)."""
    return "EveryNode" if host in ("0.0.0.0", "::", "") else "HeadOnly"


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def deploy(cfg: ServeConfig, name: str = APP, timeout_s: float = 300.0,
           key: KeyDigest | None = None) -> str:
    """Start (or update) the app on the cluster; returns its base URL once it answers.
    The API key reaches the replicas only as a salted digest (troupe.serving.auth): never in a
    runtime environment, which Ray logs. ``key``: its digest, as ``take_key`` took it before
    Ray started (the apps do); else the key is taken from ``cfg.api_key_env`` here."""
    from ray import serve

    locate(cfg.model)  # a missing model fails here, not in a replica's traceback
    info = init()
    needed = cfg.num_replicas * cfg.expert_parallel * cfg.num_gpus
    cfg = cfg.model_copy(update={"device": cluster_device(cfg.device, info.num_gpus, needed,
                                                          info.embedded)})
    serve.start(proxy_location=proxy_location(cfg.host),
                http_options={"host": cfg.host, "port": cfg.port,
                              "request_timeout_s": cfg.limits.request_timeout_s})
    options: dict = {"num_cpus": cfg.num_cpus}
    if cfg.device == "cuda" and cfg.expert_parallel == 1:  # else the expert ranks hold GPUs
        options["num_gpus"] = cfg.num_gpus
    if key is None:
        key = take_key(cfg.api_key_env)[1]
    if key is None and not _loopback(cfg.host):
        log.warning("serving on %s without an API key: anyone who reaches this address can "
                    "use the model (export %s=... to require one)", cfg.host, cfg.api_key_env)
    digest = asdict(key) if key else None
    cls = ExpertParallelReplica if cfg.expert_parallel > 1 else ServeReplica
    # a replica whose expert rank died is replaced within seconds
    health = (dict(health_check_period_s=1.0, health_check_timeout_s=30.0,
                   graceful_shutdown_timeout_s=5.0) if cls is ExpertParallelReplica else {})
    deployment = serve.deployment(cls, name=cls.__name__).options(
        num_replicas=cfg.num_replicas, **health,
        # a stopping replica looks for requests still in flight every 0.25 s (Serve's default,
        # 2 s, made every stop of an idle server take 3 s); it still waits for them all
        graceful_shutdown_wait_loop_s=0.25,
        # above the replica's own limits (in flight, queued, still sending), so that it answers 429
        # rather than Serve queueing
        max_ongoing_requests=(cfg.limits.max_concurrent + cfg.limits.max_queued
                              + cfg.limits.max_receiving + 16),
        ray_actor_options=options)
    serve.run(deployment.bind(cfg.model_dump(), digest), name=name, route_prefix="/",
              blocking=False)
    url = f"http://{cfg.host}:{cfg.port}"
    _wait_healthy(url, timeout_s)
    log.info("serving %s at %s (%d replica(s))", cfg.model.name, url, cfg.num_replicas)
    return url


def shutdown(name: str = APP) -> None:
    from ray import serve

    serve.delete(name)


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                if r.status == 200:
                    return
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the app at {url} did not answer /health within "
                                   f"{timeout_s:g}s: {e}") from None
        time.sleep(0.5)
