"""Typed errors of troupe; each names the role, rank, node, group or resource at fault.

A leaf module: every layer may raise these."""

from __future__ import annotations

from typing import Any


class TroupeError(Exception):
    """Base class of troupe's runtime errors."""

    def __reduce__(self):  # keep the typed fields when Ray ships an error between processes
        return (self.__class__._rebuild, (self.__dict__, str(self)))

    @classmethod
    def _rebuild(cls, fields: dict[str, Any], message: str) -> "TroupeError":
        err = cls.__new__(cls)
        Exception.__init__(err, message)
        err.__dict__.update(fields)
        return err


class DataError(ValueError):
    """A data file, or a row of one, that cannot be used as it is; the message names the
    file, the row and the field (or the setting it does not fit). The apps report it in one
    line and exit 2."""


class ClusterConnectionError(TroupeError):
    """troupe.init could not join the cluster at the given address."""


class PlacementTimeoutError(TroupeError):
    """A role's placement group was not placed within the build timeout."""

    def __init__(self, role: str, bundle: dict[str, float], num_bundles: int,
                 timeout_s: float, cluster: dict[str, float], autoscaler: bool,
                 never: str | None = None):
        self.role, self.bundle, self.num_bundles = role, bundle, num_bundles
        self.timeout_s, self.cluster = timeout_s, cluster
        missing = {k: v for k, v in bundle.items() if v > 0 and cluster.get(k, 0) < v}
        need = ", ".join(f"{k}={v:g}" for k, v in bundle.items() if v > 0)
        have = ", ".join(f"{k}={cluster.get(k, 0):g}" for k in bundle if bundle[k] > 0)
        if never is not None:  # known at once: no wait would place it
            super().__init__(f"role {role!r}: {num_bundles} bundle(s) of {{{need}}} cannot be "
                             f"placed: {never} (lower workers or num_cpus/num_gpus, or join a "
                             "cluster with RAY_ADDRESS)")
            return
        msg = (f"role {role!r}: could not place {num_bundles} bundle(s) of {{{need}}} within "
               f"{timeout_s:g}s; the cluster has {{{have}}} in total")
        if missing:
            msg += f"; no node offers enough of: {', '.join(sorted(missing))}"
        if autoscaler:
            msg += ("; they were requested from the Ray autoscaler: a cluster without one "
                    "needs the nodes added, one with one may need a longer timeout while nodes "
                    "start")
        super().__init__(msg)


class WorkerError(TroupeError):
    """Something went wrong in one worker of a role."""

    def __init__(self, message: str, role: str, rank: int, node_id: str | None):
        self.role, self.rank, self.node_id = role, rank, node_id
        super().__init__(message)


class WorkerDiedError(WorkerError):
    """A worker process died (killed, out of memory, node lost)."""

    def __init__(self, role: str, rank: int, node_id: str | None, cause: str):
        self.cause = cause
        super().__init__(f"role {role!r} rank {rank} on node {node_id} died: {cause}",
                         role, rank, node_id)


class WorkerCallError(WorkerError):
    """A method raised inside a worker; ``remote_traceback`` holds the worker's traceback."""

    def __init__(self, role: str, rank: int, node_id: str | None, method: str,
                 remote_traceback: str, cause: BaseException | None = None):
        self.method, self.remote_traceback, self.cause = method, remote_traceback, cause
        super().__init__(
            f"role {role!r} rank {rank} on node {node_id} raised in {method}():\n{remote_traceback}",
            role, rank, node_id)


class RunFailedError(TroupeError):
    """A run gave up after its failure policy's restarts; ``failures`` lists each failure
    (role, rank, node, cause) in order, the last one being why it stopped."""

    def __init__(self, run: str, restarts: int, failures: list[dict[str, Any]]):
        self.run, self.restarts, self.failures = run, restarts, failures
        last = failures[-1]
        why = (f"{run} failed after {restarts} restart(s)" if last.get("fault", True) else
               f"{run} stopped at step {last.get('step')} by an error, not retried (the same "
               "inputs raise it again)")
        lines = [f"{why}: role {last['role']!r} rank {last['rank']} on node "
                 f"{last['node_id']}: {last['cause']}"]
        for i, f in enumerate(failures[:-1], 1):
            lines.append(f"  earlier failure {i} (step {f.get('step')}): role {f['role']!r} rank "
                         f"{f['rank']} on node {f['node_id']}: {f['cause']}")
        super().__init__("\n".join(lines))


def exception_line(e: "WorkerCallError") -> str:
    """The line that names a worker's exception: its type and its message's first line (an
    exception whose message goes on, with the ranks' stacks, say, does not end its remote
    traceback with it); the traceback's last line when the exception was not rebuilt here."""
    if e.cause is not None:
        text = next((ln.strip() for ln in str(e.cause).splitlines() if ln.strip()), "")
        name = type(e.cause).__name__
        return f"{name}: {text}" if text else name
    lines = [ln.strip() for ln in e.remote_traceback.splitlines() if ln.strip()]
    return lines[-1] if lines else "an exception"


def failure_record(e: "WorkerError", **extra: Any) -> dict[str, Any]:
    """A JSON-ready account of a worker failure: role, rank, node, kind and first line."""
    if isinstance(e, WorkerDiedError):
        kind = "died"
        cause = next((ln.strip() for ln in str(e.cause).splitlines() if ln.strip()),
                     type(e).__name__)
    else:
        kind, cause = f"raised in {e.method}()", exception_line(e)
    return {"role": e.role, "rank": e.rank, "node_id": e.node_id, "kind": kind,
            "cause": f"{kind}: {cause}"[:2000], **extra}


class CallTimeoutError(TroupeError):
    """A call did not return in time; ``stacks`` maps each pending rank to its Python stacks."""

    def __init__(self, role: str, method: str, ranks: list[int], timeout_s: float,
                 stacks: dict[int, str]):
        self.role, self.method, self.ranks, self.timeout_s, self.stacks = (
            role, method, ranks, timeout_s, stacks)
        detail = "\n".join(f"--- rank {r} ---\n{s}" for r, s in sorted(stacks.items()))
        super().__init__(f"role {role!r}: {method}() did not return within {timeout_s:g}s on "
                         f"rank(s) {ranks}; their stacks:\n{detail}")


class CollectiveError(TroupeError):
    """A collective group could not be formed or an operation on it failed."""


class CollectiveTimeoutError(CollectiveError):
    """Members of a group did not arrive in time; ``missing`` lists their ranks and
    ``stacks`` what each was doing (when the runtime could ask them)."""

    def __init__(self, group: str, missing: list[int], world_size: int, timeout_s: float,
                 what: str = "join", stacks: dict[int, str] | None = None, cause: str = ""):
        self.group, self.missing, self.world_size, self.timeout_s = (
            group, missing, world_size, timeout_s)
        self.stacks, self.cause = stacks or {}, cause
        who = f"rank(s) {missing} of {world_size} " if missing else ""
        msg = f"group {group!r}: {who}did not {what} within {timeout_s:g}s"
        if cause:
            msg += f" [{cause}]"
        for r, report in sorted(self.stacks.items()):
            msg += f"\n--- group rank {r} ---\n{report}"
        super().__init__(msg)


class PeerLostError(CollectiveError):
    """A member of a group went away in the middle of an operation: its connection closed or
    was reset (its process or its host died). ``missing`` lists the ranks that did not answer
    when asked where they were, ``stacks`` what the others were doing."""

    def __init__(self, group: str, missing: list[int], world_size: int, op: str,
                 stacks: dict[int, str] | None = None, cause: str = ""):
        self.group, self.missing, self.world_size = group, missing, world_size
        self.stacks, self.cause = stacks or {}, cause
        who = f"rank(s) {missing} of {world_size}" if missing else "a peer"
        msg = f"group {group!r}: {who} went away during {op} [{cause}]"
        for r, report in sorted(self.stacks.items()):
            msg += f"\n--- group rank {r} ---\n{report}"
        super().__init__(msg)


def one_line(e: BaseException) -> str:
    """What a user reads of ``e`` on the terminal: one line naming the setting, file, rank or
    role at fault (a worker's exception by its last line, not its remote traceback; a timeout
    or a failed run without the stacks and earlier failures its message goes on with)."""
    if isinstance(e, WorkerCallError):
        return (f"role {e.role!r} rank {e.rank} on node {e.node_id} raised in {e.method}(): "
                f"{exception_line(e)}")
    text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    if isinstance(e, (TroupeError, ValueError, FileNotFoundError)):
        return text or type(e).__name__
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
