"""Rendezvous: every member announces its arrival in the group's store and waits for the others;
members that do not arrive within the timeout are named in the error.

troupe's graphs keep the store's keys in the rank-0 worker and reach them over Ray
(troupe.actors.store: no port of its own). ``create_store``/``connect`` are the standalone
alternative outside Ray: a TCPStore on a port the OS picks, which listens on every interface
and asks nothing of its clients, so use it only on a trusted network."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore

from troupe.errors import CollectiveTimeoutError

_served: dict[tuple[str, int], TCPStore] = {}  # stores this process serves, kept alive here


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int


def create_store(host: str, timeout_s: float = 300.0, port: int = 0) -> StoreAddress:
    """Open a TCPStore served by this process on ``host`` (port 0: one the OS picks)."""
    store = TCPStore(host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    addr = StoreAddress(host, store.port)
    _served[(addr.host, addr.port)] = store
    return addr


def release_store(addr: StoreAddress) -> None:
    _served.pop((addr.host, addr.port), None)


def connect(addr: StoreAddress, timeout_s: float) -> Store:
    """A new client of the store at ``addr`` (also in the process that serves it)."""
    return TCPStore(addr.host, addr.port, None, False, timedelta(seconds=timeout_s))


def local_ip_towards(host: str) -> str:
    """The address of this machine's interface on the route to ``host``."""
    if host.startswith("127."):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP connect sends nothing; it only selects the route
        return s.getsockname()[0]


def arrive(store: Store, prefix: str, rank: int, world_size: int, timeout_s: float,
           group: str) -> PrefixStore:
    """Announce this rank and wait for all others; returns the group's prefixed store."""
    pstore = PrefixStore(prefix, store)
    pstore.set(f"arrived/{rank}", socket.gethostname())
    keys = [f"arrived/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while not pstore.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not pstore.check([k])]
            raise CollectiveTimeoutError(group, missing, world_size, timeout_s)
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
    return pstore
