"""Naming the ranks a timed-out operation waited for, and what they were doing.

Every communicator counts the collective operations it starts (``seq``) and marks the one in
flight (``in_op``); ranks at the same operation have the same count. When an operation times
out, the waiting rank asks its peers for their count and Python stacks through a probe that the
runtime installs (it reaches the peers' actors through Ray); the ranks that were not in this
operation are the ones it waited for. Without a probe the error lists every other rank.
"""

from __future__ import annotations

from typing import Any, Callable

from troupe.errors import CollectiveTimeoutError

# probe(group, ranks) -> {rank: {"seq": int, "in_op": str | None, "timed_out_seq": int,
#                                 "report": str}}
Probe = Callable[[str, list[int]], dict[int, dict[str, Any]]]
_probe: Probe | None = None


def set_probe(probe: Probe | None) -> None:
    """Install the function that asks peers of a group where they are (None removes it)."""
    global _probe
    _probe = probe


def timeout_error(comm: Any, op: str, cause: BaseException,
                  peer: int | None = None) -> CollectiveTimeoutError:
    """The error for ``comm``'s operation ``op`` (number ``comm.seq``) that timed out; ``peer``
    is the other rank of a send or recv (the only one that can be missing)."""
    others = [peer] if peer is not None else [r for r in range(comm.world_size) if r != comm.rank]
    states: dict[int, dict[str, Any]] = {}
    if _probe is not None:
        try:
            states = _probe(comm.name, others)
        except Exception as e:  # the diagnosis must not hide the timeout itself
            states = {r: {"seq": -1, "in_op": None, "report": f"<probe failed: {e!r}>"}
                      for r in others}

    def arrived(r: int) -> bool:
        s = states.get(r)
        if s is None:
            return False
        if peer is None and s.get("timed_out_seq") == comm.seq:
            return True  # it waited here too, and gave up first
        if s.get("in_op") is None:
            return False
        return peer is not None or s.get("seq") == comm.seq

    missing = [r for r in others if not arrived(r)] if states else others
    what = f"reach {op} (operation #{comm.seq} on the group; rank {comm.rank} waited there)"
    reports = {r: states[r]["report"] for r in missing if r in states}
    if states and not missing:  # everyone is there: what they send each other did not arrive
        peers = ", ".join(states[r].get("where", f"rank {r}") for r in others)
        what = (f"complete {op} (operation #{comm.seq} on the group): every rank reached it, "
                f"and rank {comm.rank} waited for the data of {peers}: a stalled or cut link")
    return CollectiveTimeoutError(comm.name, missing, comm.world_size, comm.timeout_s, what,
                                  stacks=reports, cause=str(cause).splitlines()[0])
