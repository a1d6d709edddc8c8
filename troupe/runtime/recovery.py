"""The one failure policy and the one step loop of a troupe run (pretraining and RLHF's step 3
alike).

A failure is a fault or an error, told apart by the cause's type. A fault is what the
cluster did to the run: a worker or node lost (WorkerDiedError, Ray's actor, node, object and
out-of-memory errors), a call or a collective that timed out (a stalled or cut link surfaces as
CollectiveTimeoutError), a weight sync that did not arrive whole, torch.distributed's own
network and backend errors. Anything else a worker raised (a ValueError of troupe's code or of
the user's reward function, say) is an error, unless a worker of the graph died or was
restarted meanwhile (its process is no longer the one it was: the error was the death's echo
in a peer). An error ends the run at once: the same inputs would raise it again after every
restart.

After a fault, Ray restarts the lost worker (its role's ``max_restarts``), the policy waits
until every worker of the graph answers, rebuilds every collective group under a new
generation, and hands back to the application, which sets its roles up again and loads its
last complete checkpoint; the run goes on from there. After ``max_restarts`` faults, after an
error, or when a worker cannot come back, the run stops with RunFailedError, and
out_dir/failure.json names each failure's role, rank, node, cause, step and whether it was a
fault.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Collection, NoReturn, TypeVar

import ray
import torch.distributed
from ray import exceptions as ray_errors

from troupe.errors import (CallTimeoutError, CollectiveError, RunFailedError, WorkerCallError,
                           WorkerDiedError, failure_record)
from troupe.parallel.weight_sync import WeightSyncError
from troupe.runtime.graph import rewire
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog

log = logging.getLogger(__name__)

T = TypeVar("T")

FAULTS: tuple[type[BaseException], ...] = (
    WorkerDiedError, CallTimeoutError, CollectiveError, WeightSyncError,
    ray_errors.RayActorError, ray_errors.NodeDiedError, ray_errors.ObjectLostError,
    ray_errors.OutOfMemoryError, ray_errors.WorkerCrashedError, ray_errors.LocalRayletDiedError,
    ray_errors.ObjectFetchTimedOutError, ray_errors.GetTimeoutError,
    torch.distributed.DistError)


class FailurePolicy:
    """Restart-and-resume for ``run`` (a name for messages), up to ``max_restarts`` times.

        policy = FailurePolicy("rlhf", graph, cfg.max_restarts, out_dir)
        try:
            ...one step...
        except (WorkerDiedError, WorkerCallError) as e:
            step = policy.recover(e, step, restore)   # or RunFailedError
    """

    def __init__(self, run: str, graph: Graph, max_restarts: int, out_dir: str | Path,
                 timeout_s: float = 300.0, collective_timeout_s: float | None = None):
        self.run, self.graph, self.max_restarts = run, graph, max_restarts
        self.out_dir, self.timeout_s = Path(out_dir), timeout_s
        # how long the rebuilt groups' operations wait (the recipe's collective_timeout_s)
        self.collective_timeout_s = collective_timeout_s or timeout_s
        self.failures: list[dict] = []
        self.processes = self._processes()  # who each worker is, to see a restart by

    @property
    def restarts(self) -> int:
        return len(self.failures)

    def recover(self, error: WorkerDiedError | WorkerCallError, step: int,
                restore: Callable[[], T]) -> T:
        """Account for ``error`` (raised during ``step``) and bring the graph back; then
        ``restore()`` sets the roles up and puts them at their last checkpoint, and what it
        returns (where the run stands) is returned. Raises RunFailedError once the restarts
        are used up."""
        fault = self.is_fault(error)
        self.failures.append(failure_record(self._dead_rank(error), step=step, fault=fault))
        if not fault:
            log.error("%s: an error, not a fault, at step %d: not retried", self.run, step)
            self._give_up()
        if sum(f["fault"] for f in self.failures) > self.max_restarts:
            self._give_up()
        f = self.failures[-1]
        log.warning("%s: role %r rank %s on node %s %s at step %d; restart %d of %d from the "
                    "last checkpoint", self.run, f["role"], f["rank"], f["node_id"], f["cause"],
                    step, len(self.failures), self.max_restarts)
        try:
            for group in self.graph.roles.values():
                group.wait_ready(self.timeout_s)
            rewire(self.graph, generation=len(self.failures),
                   timeout_s=self.collective_timeout_s)
            where = restore()
        except (WorkerDiedError, WorkerCallError) as e:  # a worker that cannot come back
            self.failures.append(failure_record(e, step=step, during="recovery",
                                                fault=self.is_fault(e)))
            self._give_up()
        self.processes = self._processes()
        return where

    def is_fault(self, error: BaseException) -> bool:
        """Whether ``error`` is a fault (retried) rather than an error (see the module's
        docstring)."""
        if isinstance(error, FAULTS):
            return True
        if isinstance(error, WorkerCallError):
            if isinstance(error.cause, FAULTS):
                return True
            if error.cause is None:  # not rebuilt on the driver: its type is in the text
                last = (error.remote_traceback.strip().splitlines()[-1:] or [""])[0]
                name = last.partition(":")[0].rpartition(".")[2]
                if name in _fault_names():
                    return True
        return self._processes() != self.processes  # a peer died: the error is its echo

    def _processes(self) -> dict[tuple[str, int], tuple[str, int] | None]:
        """Each worker's node and process id (None: it does not answer)."""
        out: dict[tuple[str, int], tuple[str, int] | None] = {}
        for name, group in self.graph.roles.items():
            refs = [a.ready.remote() for a in group.actors]
            for rank, ref in enumerate(refs):
                try:
                    info = ray.get(ref, timeout=30)
                    out[name, rank] = (info["node_id"], info["pid"])
                except Exception:  # noqa: BLE001 -- dead, restarting or unreachable alike
                    out[name, rank] = None
        return out

    def _dead_rank(self, error: WorkerDiedError | WorkerCallError
                   ) -> WorkerDiedError | WorkerCallError:
        """The death behind ``error`` when there is one: a call that failed because a peer
        died names the peer's role, not its own. Only asked when no restart is left."""
        if isinstance(error, WorkerDiedError) or len(self.failures) < self.max_restarts:
            return error
        try:
            self.graph[error.role].wait_ready(60)
        except WorkerDiedError as died:
            return died
        except Exception:  # a worker still restarting: the call's own error stands
            pass
        return error

    def _give_up(self) -> NoReturn:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "failure.json").write_text(json.dumps({"failures": self.failures},
                                                              indent=1))
        raise RunFailedError(self.run, len(self.failures) - 1, self.failures)


def run_steps(policy: FailurePolicy, log: MetricsLog, done: int, last: int,
              step: Callable[[int], None], restore: Callable[[], int],
              kinds: Collection[str] | None = None,
              before_step: Callable[[int], None] | None = None, bar: Any = None) -> None:
    """Steps ``done + 1`` to ``last``, each by ``step(n)``, which logs its records and saves
    the checkpoint it is due. A worker that dies, or a call that raises, goes to ``policy``:
    the graph comes back, ``restore()`` puts the roles at their last checkpoint and returns its
    step, the log drops its records of ``kinds`` (None: all) after that step, one ``recovery``
    record (the failure's role, rank, node and cause, the step gone back to and the step that
    failed) is written, and the steps after it are redone. ``before_step(n)`` runs before each
    step (again for a redone one); ``bar`` is a tqdm bar to keep in step. A ``placement``
    record (each role's ranks' node addresses: ``Graph.placement``) opens the steps and follows
    each recovery, which may have moved ranks to other nodes."""
    log.write({"kind": "placement", "step": done, "nodes": policy.graph.placement()})
    n = done + 1
    while n <= last:
        if before_step is not None:
            before_step(n)
        try:
            step(n)
        except (WorkerDiedError, WorkerCallError) as e:
            done = policy.recover(e, n, restore)
            log.truncate_after(done, kinds)
            failure = policy.failures[-1]
            log.write({**failure, "kind": "recovery", "failure": failure["kind"], "step": done,
                       "failed_step": n})
            log.write({"kind": "placement", "step": done, "nodes": policy.graph.placement()})
            if bar is not None:
                bar.reset(total=bar.total)
                bar.update(done)
            n = done + 1
            continue
        if bar is not None:
            bar.update(1)
        n += 1


def _fault_names() -> set[str]:
    """The class names of FAULTS and of their subclasses (CollectiveTimeoutError, say)."""
    names, todo = set(), list(FAULTS)
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names
