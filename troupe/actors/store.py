"""The rendezvous store of a graph's collective groups, kept by Ray rather than on a port.

torch's TCPStore listens on every interface of its host and asks nothing of its clients, so
anyone who reaches the port can read the group's addresses and write keys. Here the keys live
in the group's rank-0 worker (``KeyValue``, served in its own concurrency group), and members
reach them through Ray calls, which Ray's token authentication covers: the group opens no port
of its own but gloo's pair sockets, which bind the node's address Ray uses (127.0.0.1 on the
embedded cluster).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import ray
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError


class KeyValue:
    """The keys of the stores a worker hosts; safe to use from several threads."""

    OPS = ("set", "get", "add", "check", "compare_set", "delete", "count")

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = value

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._lock:
            current = self._data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._data[key] = desired
                return desired
            return expected if current is None else current

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def count(self) -> int:
        with self._lock:
            return len(self._data)


class RayStore(dist.Store):
    """A c10d Store whose keys live in the ``KeyValue`` of the worker ``host`` (an actor
    handle with a ``kv(op, *args)`` method); a key not there yet is polled for until the
    store's timeout, as TCPStore's clients wait."""

    def __init__(self, host: ray.actor.ActorHandle, timeout_s: float):
        super().__init__()
        self.host, self.timeout_s = host, timeout_s
        self.set_timeout(timedelta(seconds=timeout_s))

    def _call(self, op: str, *args):
        try:
            return ray.get(self.host.kv.remote(op, *args), timeout=self.timeout_s)
        except (RayActorError, GetTimeoutError) as e:  # as TCPStore when its server is gone
            raise RuntimeError(f"the group's store (its rank-0 worker) did not answer: "
                               f"{type(e).__name__}") from None

    def _wait_for(self, keys: list[str]) -> None:
        deadline, delay = time.monotonic() + self.timeout_s, 0.001
        while not self._call("check", keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"store keys {keys} not set within {self.timeout_s:g}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def set(self, key, value):
        self._call("set", key, _bytes(value))

    def get(self, key):
        self._wait_for([key])
        return self._call("get", key)

    def add(self, key, amount):
        return self._call("add", key, int(amount))

    def check(self, keys):
        return self._call("check", list(keys))

    def wait(self, keys, timeout=None):
        self._wait_for(list(keys))

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def delete_key(self, key):
        return self._call("delete", key)

    def num_keys(self):
        return self._call("count")


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
