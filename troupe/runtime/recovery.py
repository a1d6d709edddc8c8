"""The one failure policy and the one step loop of a troupe run (pretraining and RLHF's step 3
alike).

When a worker dies or a call raises, Ray restarts the lost worker (its role's
``max_restarts``), the policy waits until every worker of the graph answers, rebuilds every
collective group under a new generation, and hands back to the application, which sets its
roles up again and loads its last complete checkpoint; the run goes on from there. After
``max_restarts`` failures, or when a worker cannot come back, the run stops with
RunFailedError, and out_dir/failure.json names each failure's role, rank, node, cause and step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Collection, NoReturn, TypeVar

from troupe.errors import RunFailedError, WorkerCallError, WorkerDiedError, failure_record
from troupe.runtime.graph import rewire
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog

log = logging.getLogger(__name__)

T = TypeVar("T")


class FailurePolicy:
    """Restart-and-resume for ``run`` (a name for messages), up to ``max_restarts`` times.

        policy = FailurePolicy("rlhf", graph, cfg.max_restarts, out_dir)
        try:
            ...one step...
        except (WorkerDiedError, WorkerCallError) as e:
            step = policy.recover(e, step, restore)   # or RunFailedError
    """

    def __init__(self, run: str, graph: Graph, max_restarts: int, out_dir: str | Path,
                 timeout_s: float = 300.0):
        self.run, self.graph, self.max_restarts = run, graph, max_restarts
        self.out_dir, self.timeout_s = Path(out_dir), timeout_s
        self.failures: list[dict] = []

    @property
    def restarts(self) -> int:
        return len(self.failures)

    def recover(self, error: WorkerDiedError | WorkerCallError, step: int,
                restore: Callable[[], T]) -> T:
        """Account for ``error`` (raised during ``step``) and bring the graph back; then
        ``restore()`` sets the roles up and puts them at their last checkpoint, and what it
        returns (where the run stands) is returned. Raises RunFailedError once the restarts
        are used up."""
        self.failures.append(failure_record(self._dead_rank(error), step=step))
        if len(self.failures) > self.max_restarts:
            self._give_up()
        f = self.failures[-1]
        log.warning("%s: role %r rank %s on node %s %s at step %d; restart %d of %d from the "
                    "last checkpoint", self.run, f["role"], f["rank"], f["node_id"], f["cause"],
                    step, len(self.failures), self.max_restarts)
        try:
            for group in self.graph.roles.values():
                group.wait_ready(self.timeout_s)
            rewire(self.graph, generation=len(self.failures), timeout_s=self.timeout_s)
            return restore()
        except (WorkerDiedError, WorkerCallError) as e:  # a worker that cannot come back
            self.failures.append(failure_record(e, step=step, during="recovery"))
            self._give_up()

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
    step (again for a redone one); ``bar`` is a tqdm bar to keep in step."""
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
            if bar is not None:
                bar.reset(total=bar.total)
                bar.update(done)
            n = done + 1
            continue
        if bar is not None:
            bar.update(1)
        n += 1
