"""ActorGraph: declare roles and collective groups, then build them on the cluster.

    g = ActorGraph("rlhf")
    g.role("actor", PolicyActor, num_workers=2, num_gpus=0.5, config=actor_cfg)
    g.role("reference", ReferenceActor, num_workers=2, colocate_with="actor", num_gpus=0.25)
    g.collective("dp", roles=["actor"], backend="auto")
    graph = g.build(timeout_s=300)
    graph["actor"].invoke(PolicyActor.train_step, batch)

Each role gets one placement group of ``num_workers`` bundles; a role colocated with another
places worker r on the other role's bundle r, whose resources cover both.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

import ray
from pydantic import ConfigDict, Field, field_validator, model_validator
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from troupe.actors.worker import RemoteRoleWorker, place
from troupe.collectives.groups import BACKENDS, resolve_backend
from troupe.config import Config, validate
from troupe.errors import (CollectiveTimeoutError, PlacementTimeoutError, WorkerCallError,
                           WorkerDiedError)
from troupe.runtime import pool as pooling
from troupe.runtime.cluster import init
from troupe.runtime.handle import Graph, RoleGroup, Wiring

log = logging.getLogger(__name__)

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class RoleSpec(Config):
    """One role: ``num_workers`` actors of ``cls``, each built as ``cls(config)``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str = Field(min_length=1)
    cls: Any
    num_workers: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None
    strategy: Strategy = "PACK"
    colocate_with: str | None = None
    max_restarts: int = Field(0, ge=-1)
    config: Any = None
    tensor_parallel: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _whole_groups(self) -> "RoleSpec":
        if self.num_workers % self.tensor_parallel:
            raise ValueError(f"tensor_parallel={self.tensor_parallel} must divide "
                             f"num_workers={self.num_workers}")
        return self

    @field_validator("resources")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: x for k, x in v.items() if x <= 0}
        if bad:
            raise ValueError(f"custom resources must be > 0, got {bad}")
        if {"CPU", "GPU"} & set(v):
            raise ValueError("give CPU and GPU as num_cpus and num_gpus, not in resources")
        return v

    def worker_resources(self) -> dict[str, float]:
        return {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}


class CollectiveSpec(Config):
    """A communication group over the workers of ``roles`` (ranks in role order, then rank)."""

    name: str = Field(min_length=1)
    roles: list[str] = Field(min_length=1)
    backend: Literal["gloo", "nccl", "ucc", "auto"] = "auto"
    parts: list[list[int]] | None = None

    @model_validator(mode="after")
    def _partition(self) -> "CollectiveSpec":
        if self.parts is not None:
            flat = sorted(i for part in self.parts for i in part)
            if any(not part for part in self.parts) or flat != list(range(len(flat))):
                raise ValueError(f"parts must split member indices 0..n-1 into non-empty "
                                 f"disjoint lists, got {self.parts}")
        return self


class ActorGraph:
    """A declaration of roles and collective groups; ``build`` starts them (see module doc)."""

    def __init__(self, name: str):
        self.name = name
        self.roles: dict[str, RoleSpec] = {}
        self.collectives: dict[str, CollectiveSpec] = {}

    def role(self, name: str, cls: type, num_workers: int = 1, *, num_cpus: float = 1.0,
             num_gpus: float = 0.0, resources: dict[str, float] | None = None,
             runtime_env: dict[str, Any] | None = None, strategy: Strategy = "PACK",
             colocate_with: str | None = None, max_restarts: int = 0,
             config: Any = None, tensor_parallel: int = 1) -> "ActorGraph":
        """Declare a role; see RoleSpec for the fields (``tensor_parallel``: consecutive ranks
        that hold one model between them, called by data-parallel rank:
        troupe.actors.dispatch). Returns self for chaining."""
        if name in self.roles:
            raise ValueError(f"role: name {name!r} is declared twice")
        if not callable(cls):
            raise ValueError(f"role {name!r}: cls must be a class, got {cls!r}")
        self.roles[name] = validate(RoleSpec, dict(
            name=name, cls=cls, num_workers=num_workers, num_cpus=num_cpus, num_gpus=num_gpus,
            resources=resources or {}, runtime_env=runtime_env, strategy=strategy,
            colocate_with=colocate_with, max_restarts=max_restarts, config=config,
            tensor_parallel=tensor_parallel),
            f"role {name!r}")
        return self

    def collective(self, name: str, roles: list[str], backend: str = "auto",
                   parts: list[list[int]] | None = None) -> "ActorGraph":
        """Declare a communication group among the workers of ``roles``, wired at build.

        Members are numbered in role order, then rank. With ``parts`` (lists of member numbers
        that together cover every member once), each part becomes a group of its own under the
        same name, so each worker finds its own part by ``name``: expert-parallel groups, say.
        """
        if name in self.collectives:
            raise ValueError(f"collective: name {name!r} is declared twice")
        if backend not in BACKENDS:
            raise ValueError(f"collective {name!r}: backend must be one of {BACKENDS}, "
                             f"got {backend!r}")
        self.collectives[name] = validate(CollectiveSpec, dict(name=name, roles=roles,
                                                               backend=backend, parts=parts),
                                          f"collective {name!r}")
        return self

    def _root(self, role: str) -> str:
        seen = [role]
        while self.roles[role].colocate_with is not None:
            role = self.roles[role].colocate_with
            if role in seen:
                raise ValueError(f"colocate_with: roles {seen} form a cycle")
            seen.append(role)
        return role

    def _check(self) -> dict[str, list[str]]:
        """Validate cross-role references; returns root role -> roles placed on its bundles."""
        if not self.roles:
            raise ValueError(f"graph {self.name!r} has no roles")
        for spec in self.roles.values():
            target = spec.colocate_with
            if target is not None and target not in self.roles:
                raise ValueError(f"role {spec.name!r}: colocate_with={target!r} is not a role; "
                                 f"roles: {list(self.roles)}")
        for c in self.collectives.values():
            unknown = [r for r in c.roles if r not in self.roles]
            if unknown:
                raise ValueError(f"collective {c.name!r}: roles {unknown} are not declared")
            n = sum(self.roles[r].num_workers for r in c.roles)
            covered = sum(len(p) for p in c.parts or [])
            if c.parts is not None and covered != n:
                raise ValueError(f"collective {c.name!r}: parts cover {covered} members, "
                                 f"the roles {c.roles} have {n}")
        placed: dict[str, list[str]] = {}
        for name in self.roles:
            placed.setdefault(self._root(name), []).append(name)
        for root, members in placed.items():
            for m in members:
                spec, base = self.roles[m], self.roles[root]
                if spec.num_workers != base.num_workers:
                    raise ValueError(
                        f"role {m!r}: num_workers={spec.num_workers} differs from "
                        f"{base.num_workers} of {root!r}, which it is colocated with")
                if m != root and spec.strategy != "PACK":
                    raise ValueError(f"role {m!r}: strategy comes from {root!r}, which it is "
                                     "colocated with; leave it at the default")
            gpus = sum(self.roles[m].num_gpus for m in members)
            if gpus > 1 and gpus != int(gpus):
                raise ValueError(f"roles {members}: num_gpus per bundle add up to {gpus:g}; "
                                 "shared bundles need a total <= 1 or a whole number")
        return placed

    def build(self, timeout_s: float = 300.0, call_timeout_s: float | None = None,
              collective_timeout_s: float | None = None, reuse_workers: bool = True) -> Graph:
        """Place, start and wire every role; returns the Graph handle. When the driver reuses
        worker processes (troupe.runtime.pool), the roles it may host take pooled workers;
        ``reuse_workers=False`` gives this graph workers of its own regardless.

        Raises PlacementTimeoutError (a role could not be placed in ``timeout_s``),
        WorkerCallError / WorkerDiedError (a worker failed to start), CollectiveTimeoutError
        (a group member did not join). Nothing is left running when it raises.
        """
        placed = self._check()
        info = init()
        deadline = time.monotonic() + timeout_s
        pgs, roles, started = {}, {}, {}
        pool = pooling.current() if reuse_workers else None
        try:
            for root, members in placed.items():
                pgs[root] = self._placement_group(root, members)
            self._wait_placed(pgs, placed, timeout_s, deadline, can_grow=not info.embedded)
            for root, members in placed.items():
                for m in members:
                    roles[m], started[m] = self._start_role(self.roles[m], pgs[root],
                                                            call_timeout_s, pool)
            for name, group in roles.items():
                infos = _started(group, started[name], max(deadline - time.monotonic(), 1.0))
                group.node_ids[:] = [i["node_id"] for i in infos]
            graph = Graph(self.name, roles, list(pgs.values()), {})
            for spec in self.collectives.values():
                self._wire(graph, spec, collective_timeout_s or max(deadline - time.monotonic(), 5))
            return graph
        except BaseException:
            Graph(self.name, roles, list(pgs.values()), {}).shutdown()
            raise

    def _placement_group(self, root: str, members: list[str]):
        bundle: dict[str, float] = {}
        for m in members:
            for k, v in self.roles[m].worker_resources().items():
                bundle[k] = bundle.get(k, 0.0) + v
        bundle = {k: v for k, v in bundle.items() if v > 0}
        spec = self.roles[root]
        # names are unique in a namespace: two graphs of one name (two jobs running the same
        # app on one cluster) each get their own
        return ray.util.placement_group([dict(bundle)] * spec.num_workers, strategy=spec.strategy,
                                        name=f"{self.name}/{root}@{uuid.uuid4().hex[:8]}")

    def _wait_placed(self, pgs: dict, placed: dict[str, list[str]], timeout_s: float,
                     deadline: float, can_grow: bool = True) -> None:
        """Wait until every placement group is placed. Groups that do not fit at once are
        asked of the autoscaler (``request_resources``, besides the pending groups themselves)
        and waited for until ``deadline``, saying what is missing every few seconds. A
        cluster that cannot grow (troupe's embedded one) and holds less than the graph asks
        in all refuses at once: no wait would place it."""
        waiting = {pgs[root].ready(): root for root in pgs}
        ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=1.0)
        for ref in ready:
            waiting.pop(ref)
        if not waiting:
            return
        total = ray.cluster_resources()
        demand: dict[str, float] = {}
        for root in pgs:
            for bundle in pgs[root].bundle_specs:
                for k, v in bundle.items():
                    demand[k] = demand.get(k, 0.0) + v
        short = sorted(k for k, v in demand.items() if v > total.get(k, 0.0) + 1e-9)
        if not can_grow and short:
            root = next(iter(waiting.values()))
            raise PlacementTimeoutError(
                root, pgs[root].bundle_specs[0], len(pgs[root].bundle_specs), 0.0, total,
                autoscaler=False,
                never=f"graph {self.name!r} asks for {_amounts(demand, short)} in all, and this "
                      f"local cluster has {_amounts(total, short)}, and cannot grow")
        # imported here, not with the module: every worker process imports this module
        # (through troupe), and the autoscaler's SDK costs each of them 40 ms of CPU
        from ray.autoscaler.sdk import request_resources

        bundles = [b for root in waiting.values() for b in pgs[root].bundle_specs]
        request_resources(bundles=bundles)
        try:
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    root = next(iter(waiting.values()))
                    raise PlacementTimeoutError(
                        root, pgs[root].bundle_specs[0], len(pgs[root].bundle_specs),
                        timeout_s, ray.cluster_resources(), autoscaler=True)
                log.info("graph %r waiting for %s (roles %s); the cluster has %s; %.0fs left",
                         self.name, _describe([pgs[r].bundle_specs for r in waiting.values()]),
                         [placed[r] for r in waiting.values()], _describe_total(), left)
                ready, _ = ray.wait(list(waiting), num_returns=len(waiting),
                                    timeout=min(left, 10))
                for ref in ready:
                    waiting.pop(ref)
        finally:
            # Placed groups hold their nodes from here on; a standing request would keep idle
            # nodes alive after the graph is gone.
            request_resources(bundles=[])

    def _start_role(self, spec: RoleSpec, pg, call_timeout_s: float | None,
                    pool: pooling.WorkerPool | None) -> tuple[RoleGroup, list]:
        """The role's workers, and for each a ref whose value is its ``ready()`` once its role
        object is built: pooled workers when ``pool`` is given and the role may use them
        (troupe.runtime.pool), otherwise actors of its own in the bundles of ``pg``."""
        args = [(spec.cls, spec.config, self.name, spec.name, rank, spec.num_workers)
                for rank in range(spec.num_workers)]
        if pool is not None and pooling.may_host(spec):
            bundles = ray.util.placement_group_table(pg)["bundles_to_node_id"]
            nodes = [bundles[rank] for rank in range(spec.num_workers)]
            adopted = [pool.adopt(node, a, spec.num_cpus, spec.max_restarts)
                       for node, a in zip(nodes, args)]
            group = RoleGroup(spec.name, [a for a, _ in adopted], nodes, call_timeout_s,
                              spec.cls, spec.tensor_parallel, pool=pool)
            return group, [ref for _, ref in adopted]
        actors = []
        for rank in range(spec.num_workers):
            options: dict[str, Any] = dict(
                num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources,
                max_restarts=spec.max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=rank),
            )
            if spec.runtime_env:
                options["runtime_env"] = spec.runtime_env
            actors.append(RemoteRoleWorker.options(**options).remote(*args[rank]))
        group = RoleGroup(spec.name, actors, [""] * spec.num_workers, call_timeout_s,
                          spec.cls, spec.tensor_parallel)
        return group, [a.ready.remote() for a in actors]

    def _wire(self, graph: Graph, spec: CollectiveSpec, timeout_s: float) -> None:
        members = [(r, i) for r in spec.roles for i in range(graph[r].world_size)]
        uses_gpu = any(self.roles[r].num_gpus > 0 for r in spec.roles)
        backend = resolve_backend(spec.backend, uses_gpu)
        parts = [[members[i] for i in part] for part in spec.parts or [range(len(members))]]
        for part in parts:
            connect_group(graph, spec.name, part, backend, timeout_s)
        graph.collectives[spec.name] = Wiring(backend, parts)


def _started(group: RoleGroup, refs: list, timeout_s: float) -> list[dict[str, Any]]:
    """Each worker's ``ready()`` once its role object is built. A role whose constructor
    raised ends a worker of its own (WorkerDiedError); a pooled worker lives on, and says the
    same by the same error."""
    try:
        return group.get(refs, "__init__", timeout_s)
    except WorkerCallError as e:
        if group.pool is None:
            raise
        raise WorkerDiedError(e.role, e.rank, e.node_id,
                              f"its role's constructor raised:\n{e.remote_traceback}") from None


def _describe(bundle_lists: list[list[dict[str, float]]]) -> str:
    """'2 x {CPU: 1, GPU: 1}, 1 x {CPU: 4}' for lists of identical bundles."""
    return ", ".join(f"{len(b)} x {{{', '.join(f'{k}: {v:g}' for k, v in b[0].items())}}}"
                     for b in bundle_lists)


def _amounts(resources: dict[str, float], keys: list[str]) -> str:
    return ", ".join(f"{k} {resources.get(k, 0.0):g}" for k in keys)


def _describe_total() -> str:
    total = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return f"{nodes} node(s), CPU {total.get('CPU', 0):g}, GPU {total.get('GPU', 0):g}"


def connect_group(graph: Graph, name: str, members: list[tuple[str, int]], backend: str,
                  timeout_s: float, generation: int = 0) -> None:
    """Create collective group ``name`` among ``members`` (role, rank) of a built graph;
    member i becomes group rank i. Its rendezvous goes through member 0's worker over Ray (no
    store port); its gloo sockets bind 127.0.0.1 when all members share a node. Raises
    CollectiveTimeoutError naming absent ranks."""
    actors = [graph[role].actors[rank] for role, rank in members]
    node_ids = [graph[role].node_ids[rank] for role, rank in members]
    one_node = len(set(node_ids)) == 1
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    places = [place(role, rank, ips.get(node, node))
              for (role, rank), node in zip(members, node_ids)]
    refs = [a.join_group.remote(name, backend, i, len(members), actors[0], timeout_s,
                                generation, actors, one_node, places)
            for i, a in enumerate(actors)]
    for i, ((role, rank), ref) in enumerate(zip(members, refs)):
        try:
            graph[role].gather([ref], [rank], f"join_group({name!r})", timeout_s + 30)
        except WorkerCallError as e:
            if isinstance(e.cause, CollectiveTimeoutError):
                raise e.cause from None
            raise


def rewire(graph: Graph, generation: int, timeout_s: float = 300.0,
           roles: set[str] | None = None) -> list[str]:
    """Rebuild the collective groups that have members in ``roles`` (all groups when None)
    under a new ``generation``, after Ray restarted some of their workers; survivors drop
    their old connections. Returns the names of the groups rebuilt."""
    names = [n for n, w in graph.collectives.items() if roles is None or w.roles & roles]
    for name in names:
        wiring = graph.collectives[name]
        for part in wiring.parts:
            connect_group(graph, name, part, wiring.backend, timeout_s, generation)
    return names

