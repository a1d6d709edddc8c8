"""Worker processes kept between graphs, for drivers that build many graphs in turn.

Starting a role worker costs about 2 s of CPU before the role's own code runs (a Ray worker
process, then torch and troupe imported), and a Ray actor lives and dies with the placement
group it was placed in. A driver that builds graph after graph (a test suite, a notebook, a
sweep) can instead keep its workers' processes: with ``reuse_workers()``, a graph's CPU roles
are hosted by idle pooled workers (troupe.actors.worker: ``adopt``), and its shutdown gives
them back (``release``) instead of ending them.

    troupe.init()
    reuse_workers()             # from here on, graphs of this driver share worker processes
    graph = ActorGraph("x").role("w", W, 2).build()
    graph.shutdown()            # the two processes wait for the next graph

What stays the same: each role still gets its placement group, which holds the role's CPUs
and custom resources on the nodes it places (the pooled worker, built with no resources of its
own, runs on the bundle's node), so placement, SPREAD, autoscaling and what the cluster says is
free are as without the pool; Ray restarts a lost worker up to the role's ``max_restarts``,
and the restarted process takes up its role again as it starts (the role is kept for it in
Ray's key-value store: troupe.actors.worker). What differs: a pooled worker is not
inside its bundle (Ray's state API shows it outside any placement group); torch's threads
follow the role's CPUs as Ray's OMP_NUM_THREADS rule would; a worker is tied to its node, so
one whose node is lost is not restarted on another (a bundle is): reuse suits one machine, or
nodes that stay. Roles that ask for GPUs (Ray gives each GPU worker its devices when it
starts) or for a runtime environment always get workers of their own. A role's child
processes end with it; a worker whose role left threads running, that Ray restarted, or that
did not answer its release in time is ended, as without the pool.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from troupe.actors.worker import RemoteRoleWorker

log = logging.getLogger(__name__)


class WorkerPool:
    """Idle pooled workers of one Ray session, by node (at most ``max_idle`` in all)."""

    def __init__(self, max_idle: int = 8, release_timeout_s: float = 10.0):
        self.max_idle, self.release_timeout_s = max_idle, release_timeout_s
        self.idle: dict[str, list[ray.actor.ActorHandle]] = {}  # by node
        self.job: str | None = None  # the Ray session the idle workers belong to
        self.counts = {"started": 0, "reused": 0, "ended": 0}  # workers, since the pool began

    def adopt(self, node_id: str, role_args: tuple, num_cpus: float, max_restarts: int = 0
              ) -> tuple[ray.actor.ActorHandle, ray.ObjectRef]:
        """An idle worker on ``node_id`` (or a new one) taking up the role that
        ``RoleWorker(*role_args)`` would host, brought back by up to ``max_restarts`` of Ray's
        restarts; returns the worker and the ref of its ``adopt``, whose value is its
        ``ready()``."""
        workers = self.idle.get(node_id, [])
        self.counts["reused" if workers else "started"] += 1
        worker = workers.pop() if workers else RemoteRoleWorker.options(
            num_cpus=0, max_restarts=-1,  # the role's own count is kept by the worker
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote()
        return worker, worker.adopt.remote(*role_args, max(math.floor(num_cpus), 1),
                                           max_restarts)

    def give_back(self, workers: list[tuple[str, Any]]) -> None:
        """Release each (node id, worker): those that come back fit wait for the next graph;
        the others (busy in a call, leftovers, no answer within ``release_timeout_s``,
        dead) are ended."""
        free = []
        for (node, worker), (busy, failed) in zip(workers, self._answers(
                [w.in_flight_call.remote() for _, w in workers])):
            if busy or failed:
                self._end(worker, failed or f"busy in {busy}")
            else:
                free.append((node, worker))
        for (node, worker), (leftovers, failed) in zip(free, self._answers(
                [w.release.remote() for _, w in free])):
            if leftovers or failed:
                self._end(worker, failed or ", ".join(leftovers))
            elif sum(map(len, self.idle.values())) >= self.max_idle:
                self._end(worker, None)
            else:
                self.idle.setdefault(node, []).append(worker)

    def _answers(self, refs: list[ray.ObjectRef]) -> list[tuple[Any, str | None]]:
        """Each ref's (value, None), or (None, why there is none), waiting
        ``release_timeout_s`` for all."""
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.release_timeout_s)
        out: list[tuple[Any, str | None]] = []
        for ref in refs:
            try:
                out.append((ray.get(ref), None) if ref in done
                           else (None, f"no answer in {self.release_timeout_s:g} s"))
            except Exception as e:  # noqa: BLE001 -- dead or broken: not reused either way
                out.append((None, f"{type(e).__name__}"))
        return out

    def _end(self, worker: ray.actor.ActorHandle, why: str | None) -> None:
        """End ``worker``; ``why``: logged (None: the pool is full)."""
        if why:
            log.info("a pooled worker is ended, not reused: %s", why)
        self.counts["ended"] += 1
        ray.kill(worker, no_restart=True)

    def close(self) -> None:
        """End every idle worker (gone already with their session when Ray is not up)."""
        if ray.is_initialized():
            for workers in self.idle.values():
                for worker in workers:
                    ray.kill(worker, no_restart=True)
        self.idle = {}


def may_host(spec: Any) -> bool:
    """Whether pooled workers may host a role (a RoleSpec): CPU only, no runtime environment
    of its own (see the module doc)."""
    return spec.num_gpus == 0 and not spec.runtime_env


_pool: WorkerPool | None = None


def reuse_workers(enabled: bool = True, max_idle: int = 8) -> None:
    """Whether graphs this driver builds from now on reuse worker processes (see the module
    doc; it may be called before ``troupe.init``); off ends the idle ones."""
    global _pool
    if _pool is not None:
        _pool.close()
    _pool = WorkerPool(max_idle) if enabled else None


def current() -> WorkerPool | None:
    """The driver's pool when reuse is on and belongs to the Ray session connected now."""
    if _pool is None or not ray.is_initialized():
        return None
    job = ray.get_runtime_context().get_job_id()
    if _pool.job != job:  # the first graph, or a new session: the idle ones are gone
        _pool.idle, _pool.job = {}, job
    return _pool
