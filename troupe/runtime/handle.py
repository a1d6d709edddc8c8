"""The built graph: role groups of Ray actors, called in rank order with typed errors."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from troupe.actors.dispatch import Dispatch, PerRank, mode_of, per_rank_args, results_of
from troupe.errors import CallTimeoutError, WorkerCallError, WorkerDiedError

_POLL_S = 1.0  # how often a long call checks its finished ranks for errors
_GRACE_S = 5.0  # after one rank fails, how long to look for a dead rank behind the failure
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class RoleGroup:
    """The workers of one role, built from ``cls``. ``invoke`` calls a method of ``cls`` by
    reference with the dispatch it declares (troupe.actors.dispatch); ``call``, ``call_rank``
    and ``scatter`` are the same by name, for a method that declares none. ``tensor_parallel``:
    how many consecutive ranks hold one model between them (SHARD calls go by data-parallel
    rank: troupe.actors.dispatch)."""

    def __init__(self, name: str, actors: list[ray.actor.ActorHandle], node_ids: list[str],
                 call_timeout_s: float | None, cls: type | None = None,
                 tensor_parallel: int = 1, pool: Any = None):
        self.name = name
        self.pool = pool  # the WorkerPool its workers go back to (troupe.runtime.pool), or None
        self.actors = actors
        self.node_ids = node_ids
        self.call_timeout_s = call_timeout_s
        self.cls = cls
        self.tensor_parallel = tensor_parallel

    def invoke(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` (a function of the role's class, e.g. ``PolicyActor.generate``)
        on the ranks its dispatch mode names and wait: a list in rank order, or rank 0's
        result for RANK0."""
        return self.invoke_async(method, *args, **kwargs).result()

    def invoke_async(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> "Call":
        """``invoke`` without waiting: start the calls and return them (``Call.result``), so
        that several roles can work at once."""
        return self._start(self._method_name(method), mode_of(method), args, kwargs)

    def invoke_on(self, rank: int, method: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> "Call":
        """``invoke_async`` on worker ``rank`` alone, with the arguments its dispatch gives
        that rank (a SHARD method gets its slice of the batch): for a driver that follows
        each worker's work apart, e.g. to redo one worker's share after it restarts."""
        return self._start(self._method_name(method), mode_of(method), args, kwargs, rank=rank)

    def _start(self, name: str, mode: Dispatch, args: tuple, kwargs: dict,
               rank: int | None = None) -> "Call":
        """The one way a call leaves the driver: ``name`` on the ranks ``mode`` names (or on
        ``rank`` alone), each with its arguments (troupe.actors.dispatch.per_rank_args)."""
        if rank is not None:
            if not 0 <= rank < self.world_size:
                raise ValueError(f"role {self.name!r} has ranks 0..{self.world_size - 1}, "
                                 f"not {rank}")
            calls = per_rank_args(mode, args, kwargs, self.world_size,
                                  self.tensor_parallel)[rank:rank + 1]
            ranks = [rank]
        else:
            calls = per_rank_args(mode, args, kwargs, self.world_size, self.tensor_parallel)
            ranks = list(range(len(calls)))
        refs = [self.actors[r].call.remote(name, a_args, a_kwargs)
                for r, (a_args, a_kwargs) in zip(ranks, calls)]
        return Call(self, name, mode, refs, ranks)

    def _method_name(self, method: Callable[..., Any]) -> str:
        name = getattr(method, "__name__", None)
        if name is None or name.startswith("_") or not callable(method):
            raise TypeError(f"role {self.name!r}: invoke takes a public method of the role's "
                            f"class (e.g. {getattr(self.cls, '__name__', 'Role')}.step), "
                            f"got {method!r}")
        if self.cls is not None and not any(vars(k).get(name) is method
                                            for k in self.cls.__mro__):
            raise TypeError(f"role {self.name!r} runs {self.cls.__name__}, which has no method "
                            f"{getattr(method, '__qualname__', name)}")
        return name

    @property
    def world_size(self) -> int:
        return len(self.actors)

    # By name: for a class whose methods declare no dispatch, or a caller without the class at
    # hand. Each is ``invoke`` with the dispatch its name says.
    def call_async(self, method: str, *args: Any, **kwargs: Any) -> "Call":
        """Start ``method`` on every worker with the same arguments (Dispatch.ALL)."""
        return self._start(method, Dispatch.ALL, args, kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every worker and wait; results in rank order."""
        return self.call_async(method, *args, **kwargs).result()

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on one worker only."""
        return self._start(method, Dispatch.ALL, args, kwargs, rank=rank).result()[0]

    def scatter_async(self, method: str, batch: Any, *args: Any, **kwargs: Any) -> "Call":
        """Start ``method(slice, *args, **kwargs)``, worker r receiving slice r of ``batch``
        (Dispatch.SHARD; a list of exactly world_size items gives item r to rank r)."""
        if isinstance(batch, list) and len(batch) == self.world_size:
            batch = PerRank(batch)
        return self._start(method, Dispatch.SHARD, (batch, *args), kwargs)

    def scatter(self, method: str, batch: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """``scatter_async`` and wait; results in rank order."""
        return self.scatter_async(method, batch, *args, **kwargs).result()

    def get(self, refs: "Sequence[ray.ObjectRef] | Call", method: str = "call",
            timeout_s: float | None = None) -> list[Any]:
        """Wait for Ray refs of this role's workers' calls, one per rank in rank order, raising
        typed errors (``Call.result`` for the calls troupe starts; a Call given here is waited
        for the same way)."""
        if isinstance(refs, Call):
            return refs.result(timeout_s)
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        return self.gather(list(refs), list(range(len(refs))), method, timeout)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Return once every worker answers, waiting out workers that Ray is restarting;
        raises WorkerDiedError for a worker that is gone for good (restarts used up), and
        CallTimeoutError if one is still restarting after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for rank, actor in enumerate(self.actors):
            while True:
                try:
                    info = ray.get(actor.ready.remote(),
                                   timeout=max(deadline - time.monotonic(), 0.1))
                    if rank < len(self.node_ids):  # a restarted worker may be on another node
                        self.node_ids[rank] = info["node_id"]
                    break
                except ActorUnavailableError:
                    if time.monotonic() > deadline:
                        raise self._timeout("ready", [rank], timeout_s) from None
                    time.sleep(0.2)
                except GetTimeoutError:
                    raise self._timeout("ready", [rank], timeout_s) from None
                except RayActorError as e:
                    raise self.died(rank, e) from None

    def gather(self, refs: list[ray.ObjectRef], ranks: list[int], method: str,
               timeout_s: float | None) -> list[Any]:
        """Results of ``refs`` (one per rank in ``ranks``); the first failure is raised as
        WorkerDiedError or WorkerCallError, a timeout as CallTimeoutError with stacks."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        errors: list[Exception] = []
        while pending:
            if errors:  # a peer's error often follows a death: give the dead rank time to show
                wait = min(_POLL_S, grace - time.monotonic())
                if wait <= 0:
                    break
            else:
                wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
                if wait <= 0:
                    raise self._timeout(method, sorted(pending.values()), timeout_s)
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = self._result(ref, rank, method)
                except (WorkerCallError, WorkerDiedError) as e:
                    if not errors:
                        grace = time.monotonic() + _GRACE_S
                    errors.append(e)
        if errors:  # the death, rather than the errors it caused in its peers
            raise next((e for e in errors if isinstance(e, WorkerDiedError)), errors[0])
        return [results[r] for r in ranks]

    def _result(self, ref: ray.ObjectRef, rank: int, method: str) -> Any:
        node = self.node_ids[rank] if rank < len(self.node_ids) else None
        try:
            return ray.get(ref)
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else None
            text = _ANSI.sub("", str(e))
            raise WorkerCallError(self.name, rank, node, method, text, cause) from None
        except RayActorError as e:
            raise self.died(rank, e) from None

    def died(self, rank: int, e: RayActorError) -> WorkerDiedError:
        """The typed error for rank ``rank``'s death that Ray reported as ``e``."""
        node = self.node_ids[rank] if rank < len(self.node_ids) else None
        return WorkerDiedError(self.name, rank, node, _death_cause(e))

    def _timeout(self, method: str, ranks: list[int], timeout_s: float) -> CallTimeoutError:
        refs = {r: self.actors[r].stacks.remote() for r in ranks}
        stacks = {}
        for r, ref in refs.items():
            try:
                stacks[r] = ray.get(ref, timeout=10)
            except (GetTimeoutError, RayActorError) as e:
                stacks[r] = f"<no stack: {type(e).__name__}>"
        return CallTimeoutError(self.name, method, ranks, timeout_s, stacks)


class Call:
    """Calls started by ``RoleGroup.invoke_async`` (on ``ranks``); ``result()`` waits for
    them."""

    def __init__(self, group: RoleGroup, method: str, mode: Dispatch,
                 refs: list[ray.ObjectRef], ranks: list[int] | None = None):
        self.group, self.method, self.mode, self.refs = group, method, mode, refs
        self.ranks = list(range(len(refs))) if ranks is None else ranks

    def result(self, timeout_s: float | None = None) -> Any:
        """The results in rank order (rank 0's alone for RANK0; for SHARD on a role split by
        tensor parallelism, one per data-parallel rank), or the first failure as a typed
        error (see ``RoleGroup.gather``)."""
        timeout = self.group.call_timeout_s if timeout_s is None else timeout_s
        out = self.group.gather(self.refs, self.ranks, self.method, timeout)
        if self.mode is Dispatch.RANK0:
            return out[0]
        if len(self.ranks) < self.group.world_size:  # invoke_on: the rank's own
            return out
        return results_of(self.mode, out, self.group.tensor_parallel)


def _death_cause(e: RayActorError) -> str:
    """Ray's account of the death (the creation task's traceback when __init__ raised)."""
    return _ANSI.sub("", str(e)).strip() or type(e).__name__


@dataclass
class Wiring:
    """How a collective group was wired: its backend and its parts, each a list of members
    (role, rank) in group-rank order (one part unless the group was declared with parts)."""

    backend: str
    parts: list[list[tuple[str, int]]]

    @property
    def roles(self) -> set[str]:
        return {role for part in self.parts for role, _ in part}


class Graph:
    """A built ActorGraph: ``graph[role]`` is a RoleGroup; ``shutdown()`` frees everything."""

    def __init__(self, name: str, roles: dict[str, RoleGroup], placement_groups: list,
                 collectives: dict[str, Wiring]):
        self.name = name
        self.roles = roles
        self.placement_groups = placement_groups
        self.collectives = collectives  # group name -> Wiring
        self.closed = False

    def __getitem__(self, role: str) -> RoleGroup:
        if self.closed:
            raise RuntimeError(f"graph {self.name!r} was shut down: its workers are gone")
        try:
            return self.roles[role]
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no role {role!r}; roles: {list(self.roles)}")

    def shutdown(self) -> None:
        """End every worker (a pooled one goes back to its pool: troupe.runtime.pool) and
        remove the placement groups."""
        pooled = [g for g in self.roles.values() if g.pool is not None]
        for group in self.roles.values():
            if group.pool is None:
                for actor in group.actors:
                    ray.kill(actor, no_restart=True)
        if pooled:  # one pool per driver: released together, one wait for all
            pooled[0].pool.give_back([w for g in pooled for w in zip(g.node_ids, g.actors)])
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)
        self.roles, self.placement_groups, self.closed = {}, [], True

    def placement(self, roles: Sequence[str] | None = None, timeout_s: float = 30.0
                  ) -> dict[str, list[str | None]]:
        """Each role's (of ``roles``; None: all) ranks' node addresses, in rank order (None: a
        rank that does not answer within ``timeout_s``: dead or restarting)."""
        out: dict[str, list[str | None]] = {}
        for name in roles or list(self.roles):
            group = self.roles[name]
            refs = [a.ready.remote() for a in group.actors]
            out[name] = []
            for ref in refs:
                try:
                    out[name].append(ray.get(ref, timeout=timeout_s)["node_ip"])
                except Exception:  # noqa: BLE001 -- dead, restarting or unreachable alike
                    out[name].append(None)
        return out

    def __enter__(self) -> "Graph":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
