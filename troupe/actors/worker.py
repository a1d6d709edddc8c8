"""The Ray actor that hosts one worker of a role.

It sets the worker's context, builds the role object as ``cls(config)``, serves the graph's
calls, and joins collective groups during build. A second concurrency group ("control") answers
stack dumps while a call is stuck, which is how timeouts name what a rank was doing: the
driver's call timeouts, and a collective that timed out inside a worker, which asks its peers
(their actor handles come with ``join_group``) where they are.

A worker built with no role is a pooled one (troupe.runtime.pool): it waits idle, takes up a
role with ``adopt`` and leaves it with ``release``, which puts the process back as ``adopt``
found it (troupe.actors.reuse) or says it cannot.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import threading
import traceback
from typing import Any

import ray
import torch
from ray import cloudpickle
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

from troupe import checkpoint as ckpt
from troupe import collectives
from troupe.actors.reuse import Fresh, reconstructed
from troupe.actors.store import KeyValue, RayStore
from troupe.collectives import straggler
from troupe.context import WorkerContext, _set_context
from troupe.devices import to_host


# The roles pooled workers host, by actor id, in Ray's key-value store (the cluster's GCS, as
# Ray keeps an actor's own arguments): a pooled worker, which Ray restarts whenever it dies, is
# built again with no role (its first arguments) and takes this one up again while the role
# has restarts left, as a worker of its own would be rebuilt; once they are spent, its
# constructor fails, which ends it as Ray ends a worker out of restarts.
_ROLES = "troupe-pooled-roles"


class RoleWorker:
    """Hosts ``cls(config)`` as rank ``rank`` of role ``role``; with no ``cls``, waits idle
    for ``adopt``."""

    def __init__(self, cls: type | None = None, config: Any = None, graph: str = "",
                 role: str = "", rank: int = 0, world_size: int = 1) -> None:
        self.impl: Any = None
        self.in_flight: str | None = None
        self.peers: dict[str, list[ray.actor.ActorHandle]] = {}  # group -> actors, group rank order
        self.places: dict[str, list[str]] = {}  # group -> where each rank is, for errors
        self.keys = KeyValue()  # rendezvous keys of the groups this worker is rank 0 of
        self.fresh = Fresh.take() if cls is None else None
        self._take_up(cls, config, graph, role, rank, world_size)
        if self.fresh is not None and reconstructed():
            kept = _internal_kv_get(self._key(), namespace=_ROLES)
            if kept:  # Ray restarted a pooled worker: the role it hosted, as a restart builds
                *role_args, threads, restarts = cloudpickle.loads(kept)
                if restarts == 0:
                    raise RuntimeError(f"role {role_args[3]!r} rank {role_args[4]}: its worker "
                                       "died, and the role's restarts are spent")
                self.adopt(*role_args, threads, restarts - 1 if restarts > 0 else restarts)

    def _take_up(self, cls: type | None, config: Any, graph: str, role: str, rank: int,
                 world_size: int) -> None:
        rt = ray.get_runtime_context()
        self.context = WorkerContext(
            graph=graph, role=role, rank=rank, world_size=world_size,
            node_id=rt.get_node_id(), node_ip=ray.util.get_node_ip_address(),
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
        )
        if cls is None:
            return
        _set_context(self.context)
        straggler.set_probe(self._probe)
        self.impl = cls(config) if config is not None else cls()

    def adopt(self, cls: type, config: Any, graph: str, role: str, rank: int, world_size: int,
              threads: int, max_restarts: int) -> dict[str, Any]:
        """Take up a role, as a worker built for it would (torch's threads: ``threads``, what
        Ray gives a worker of its CPUs; ``max_restarts``: how often Ray's restarts of this
        process bring the role back, -1 always); returns ``ready()``."""
        if self.fresh is None or self.impl is not None:
            raise RuntimeError(f"adopt: this worker hosts role {self.context.role!r}; only an "
                               "idle pooled worker takes up a role")
        _internal_kv_put(self._key(), cloudpickle.dumps(
            (cls, config, graph, role, rank, world_size, threads, max_restarts)),
            namespace=_ROLES)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        self._take_up(cls, config, graph, role, rank, world_size)
        return self.ready()

    @staticmethod
    def _key() -> str:
        return ray.get_runtime_context().get_actor_id()

    def release(self) -> list[str]:
        """Leave the role: its groups destroyed, its object dropped, the process state put
        back, its child processes ended (troupe.actors.reuse). Returns what could not be put
        back (threads the role left running): empty when the worker may host another role."""
        if self.fresh is None:
            raise RuntimeError("release: only a pooled worker leaves its role")
        _internal_kv_del(self._key(), namespace=_ROLES)
        for name in collectives.list_groups():
            collectives.destroy_group(name)
        self.impl, self.peers, self.places, self.keys = None, {}, {}, KeyValue()
        _set_context(None)
        straggler.set_probe(None)
        gc.collect()
        return_free_memory()
        self.fresh.end_children()
        self.fresh.restore()
        self._take_up(None, None, "", "", 0, 1)
        if reconstructed():
            return ["restarted by Ray (the next role would take itself for restarted)"]
        return self.fresh.leftovers()

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        fn = getattr(self.impl, method, None) if not method.startswith("_") else None
        if not callable(fn):
            raise AttributeError(f"role {self.context.role!r} ({type(self.impl).__name__}) has "
                                 f"no public method {method!r}")
        self.in_flight = method
        try:
            return to_host(fn(*args, **kwargs))  # the driver may have no GPU
        finally:
            self.in_flight = None
            return_free_memory()

    def ready(self) -> dict[str, Any]:
        """The worker's context, process and the resources Ray assigned it (bundle names
        included)."""
        return {"node_id": self.context.node_id, "node_ip": self.context.node_ip,
                "pid": os.getpid(),
                "gpu_ids": list(self.context.gpu_ids),
                "resources": ray.get_runtime_context().get_assigned_resources()}

    def check_file(self, path: str, nbytes: int, sha256: str) -> str | None:
        """Whether a checkpoint file is intact, read from this worker's node (see
        troupe.checkpoint.check_file); the driver spreads a checkpoint's files over the
        workers before any of them loads, so a damaged file cannot leave its peers waiting
        in a collective."""
        return ckpt.check_file(path, nbytes, sha256)

    def join_group(self, name: str, backend: str, rank: int, world_size: int,
                   store_host: ray.actor.ActorHandle, timeout_s: float, generation: int,
                   peers: list[ray.actor.ActorHandle] | None = None,
                   one_node: bool = False, places: list[str] | None = None) -> None:
        """Join collective group ``name``; its rendezvous keys live in ``store_host`` (the
        group's rank-0 worker, see troupe.actors.store). gloo binds 127.0.0.1 when every
        member is on this node (``one_node``), else this node's address; never a wildcard."""
        self.in_flight = f"join_group({name!r})"
        self.peers[name], self.places[name] = peers or [], places or []
        try:
            collectives.init_group(name, backend, rank, world_size,
                                   RayStore(store_host, timeout_s), timeout_s, generation,
                                   local_ip="127.0.0.1" if one_node else self.context.node_ip)
        finally:
            self.in_flight = None

    @ray.method(concurrency_group="store")
    def kv(self, op: str, *args: Any) -> Any:
        """One operation on the rendezvous keys this worker hosts (troupe.actors.store)."""
        if op not in KeyValue.OPS:
            raise ValueError(f"kv: no operation {op!r}; the store has {KeyValue.OPS}")
        return getattr(self.keys, op)(*args)

    def leave_group(self, name: str) -> None:
        collectives.destroy_group(name)

    def _probe(self, group: str, ranks: list[int]) -> dict[int, dict[str, Any]]:
        """Where ranks of ``group`` are (see troupe.collectives.straggler)."""
        peers, places = self.peers.get(group, []), self.places.get(group, [])
        refs = {r: peers[r].collective_state.remote(group) for r in ranks if r < len(peers)}
        out = {}
        for r in ranks:
            try:
                out[r] = ray.get(refs[r], timeout=10)
            except Exception as e:  # a dead or unreachable peer is a missing one
                where = places[r] if r < len(places) else f"rank {r}"
                out[r] = {"seq": -1, "in_op": None, "answered": False, "where": where,
                          "report": f"<no answer from {where}: {type(e).__name__}>"}
        return out

    @ray.method(concurrency_group="control")
    def collective_state(self, group: str) -> dict[str, Any]:
        """This worker's position in ``group`` and what it is doing."""
        comm = collectives.find_group(group)
        c = self.context
        return {"seq": getattr(comm, "seq", -1), "in_op": getattr(comm, "in_op", None),
                "where": place(c.role, c.rank, c.node_ip),
                "report": f"role {c.role!r} rank {c.rank} on node {c.node_id} ({c.node_ip}), "
                          f"{self._stacks()}"}

    @ray.method(concurrency_group="control")
    def in_flight_call(self) -> str | None:
        """The call this worker is serving now, if any (answered while it is busy)."""
        return self.in_flight

    @ray.method(concurrency_group="control")
    def stacks(self) -> str:
        return self._stacks()

    def _stacks(self) -> str:
        """Python stacks of every thread, and the call in flight."""
        names = {t.ident: t.name for t in threading.enumerate()}
        out = [f"in flight: {self.in_flight or 'nothing'}"]
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            out.append(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
        return "\n".join(out)


RemoteRoleWorker = ray.remote(concurrency_groups={"control": 1, "store": 2})(RoleWorker)


_libc = None


def place(role: str, rank: int, address: str) -> str:
    """How errors name a rank of a role and where it runs: "rank 1 ('trainer') on 10.0.0.3"."""
    return f"rank {rank} ({role!r}) on {address}"


def return_free_memory() -> None:
    """Give the OS back the pages of what glibc's heaps hold free (``malloc_trim``), after
    each call a worker serves. Between calls a step's activations and temporaries are free,
    but glibc keeps them for reuse: a worker training a 135M-parameter model held 0.4 GB more
    than it used. Trimming once per call returns them without the cost of serving every
    allocation by its own mmap (fresh pages fault on first touch: a 113 MB gradient took
    28 ms to zero instead of 2). No effect off glibc."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else False
            _libc.malloc_trim  # noqa: B018 (musl has no malloc_trim)
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)
