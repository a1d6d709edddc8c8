"""Naming the ranks a timed-out operation waited for, and what they were doing.

Every communicator counts the collective operations it starts (``seq``) and marks the one in
flight (``in_op``); ranks at the same operation have the same count. When an operation times
out, the waiting rank asks its peers for their count and Python stacks through a probe that the
runtime installs (it reaches the peers' actors through Ray); the ranks whose count is behind
this operation's are the ones it waited for, a rank that does not answer named with where it
is. When every rank reached it (some may have finished it and gone on), the data between them
did not arrive: a stalled or cut link. Without a probe the error lists every other rank.
"""

from __future__ import annotations

from typing import Any, Callable

from troupe.errors import CollectiveTimeoutError, PeerLostError

# probe(group, ranks) -> {rank: {"seq": int, "in_op": str | None, "where": str,
#                                 "report": str, "answered": False if it did not}}
Probe = Callable[[str, list[int]], dict[int, dict[str, Any]]]
_probe: Probe | None = None


def set_probe(probe: Probe | None) -> None:
    """Install the function that asks peers of a group where they are (None removes it)."""
    global _probe
    _probe = probe


# what gloo says when the other end of a connection is gone (its process or host died)
_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
         "connection refused", "socket closed")


def peer_lost(cause: BaseException) -> bool:
    """Whether ``cause`` (an operation's error) says a peer's connection went away."""
    text = str(cause).lower()
    return any(phrase in text for phrase in _LOST)


def _states(comm: Any, others: list[int]) -> dict[int, dict[str, Any]]:
    """What the probe says of ``others`` (empty without a probe)."""
    if _probe is None:
        return {}
    try:
        return _probe(comm.name, others)
    except Exception as e:  # the diagnosis must not hide the failure itself
        return {r: {"seq": -1, "in_op": None, "report": f"<probe failed: {e!r}>"}
                for r in others}


def lost_error(comm: Any, op: str, cause: BaseException,
               peer: int | None = None) -> PeerLostError:
    """The error for ``comm``'s operation ``op`` whose connection to a peer went away: the
    ranks that no longer answer are the ones lost (every other rank when none can be asked)."""
    others = [peer] if peer is not None else [r for r in range(comm.world_size) if r != comm.rank]
    states = _states(comm, others)
    missing = [r for r in others if states.get(r, {}).get("seq", -1) < 0] if states else others
    return PeerLostError(comm.name, missing, comm.world_size, op,
                         stacks={r: states[r]["report"] for r in others if r in states
                                 and r not in missing},
                         cause=str(cause).splitlines()[0])


def timeout_error(comm: Any, op: str, cause: BaseException,
                  peer: int | None = None) -> CollectiveTimeoutError:
    """The error for ``comm``'s operation ``op`` (number ``comm.seq``) that timed out; ``peer``
    is the other rank of a send or recv (the only one that can be missing)."""
    others = [peer] if peer is not None else [r for r in range(comm.world_size) if r != comm.rank]
    states = _states(comm, others)

    def arrived(r: int) -> bool:
        s = states.get(r)
        if s is None:
            return False
        if peer is not None:  # a send or recv: the peer is in one, or it is missing
            return s.get("in_op") is not None
        # at this operation, or past it: a rank whose part was sent before a link stalled
        # finishes the operation and goes on (to wait in the next one) while this one waits
        return s.get("seq", -1) >= comm.seq

    missing = [r for r in others if not arrived(r)] if states else others
    waited = f"operation #{comm.seq} on the group; rank {comm.rank} waited there"
    silent = [states[r]["where"] for r in missing if states.get(r, {}).get("answered") is False]
    if silent:  # a probe that gets no answer: the peer's host, or the link to it, is down
        waited += f", and {', '.join(silent)} did not answer: a host or a link down?"
    stuck = []  # behind, inside an operation this rank has finished: waiting for its data
    for r in missing if peer is None else []:
        s = states.get(r, {})
        if s.get("in_op") and 0 <= s.get("seq", -1) < comm.seq:
            stuck.append(f"{s.get('where', f'rank {r}')} is still in {s['in_op']} "
                         f"(operation #{s['seq']})")
    if stuck:
        waited += (f"; {', '.join(stuck)}, which rank {comm.rank} has finished: the data sent "
                   "to it did not arrive, a stalled or cut link")
    what = f"reach {op} ({waited})"
    reports = {r: states[r]["report"] for r in missing if r in states}
    if states and not missing:  # everyone is there: what they send each other did not arrive
        peers = ", ".join(states[r].get("where", f"rank {r}") for r in others)
        what = (f"complete {op} (operation #{comm.seq} on the group): every rank reached it, "
                f"and rank {comm.rank} waited for the data of {peers}: a stalled or cut link")
    return CollectiveTimeoutError(comm.name, missing, comm.world_size, comm.timeout_s, what,
                                  stacks=reports, cause=str(cause).splitlines()[0])


def probe_links(comm: Any, nbytes: int = 4 << 20, device: Any = "cpu") -> list[float]:
    """Seconds for ``nbytes`` to go from each rank r to rank r + 1 (mod world), one pair at a
    time so that no two transfers share a link; every rank returns the same list (index r:
    the pair r -> r + 1). A host whose link is slow is in two slow pairs, as sender and as
    receiver: ``slowest_rank`` finds it. ``device``: where the group's tensors live (cuda for
    NCCL)."""
    import time

    import torch

    W, r = comm.world_size, comm.rank
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    mine = torch.zeros(W, dtype=torch.float64, device=device)
    for k in range(W):
        comm.barrier()
        t0 = time.perf_counter()
        if r == k:
            comm.send(buf, (k + 1) % W)
        elif r == (k + 1) % W:
            comm.recv(buf, k)
            mine[k] = time.perf_counter() - t0  # the receiver times the transfer
    return comm.all_reduce(mine).tolist()  # host: a list of floats


def slowest_rank(seconds: list[float], factor: float = 2.0) -> int | None:
    """The rank in both of the two slowest pairs of ``probe_links`` when both are more than
    ``factor`` times slower than every other pair (None: no link stands out, or fewer than
    3 ranks)."""
    W = len(seconds)
    if W < 3:
        return None
    order = sorted(range(W), key=lambda k: seconds[k], reverse=True)
    a, b = order[0], order[1]
    if seconds[b] < factor * max(seconds[k] for k in order[2:]):
        return None
    common = {a, (a + 1) % W} & {b, (b + 1) % W}
    return common.pop() if len(common) == 1 else None
