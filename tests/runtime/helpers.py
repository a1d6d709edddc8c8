"""Helpers shared by the runtime tests."""

import os
import time

from typing import Callable

import ray


def kill_worker(actor: ray.actor.ActorHandle, restart: bool, timeout_s: float = 30) -> None:
    """Kill a worker's process and return once it is gone.

    ray.kill is asynchronous: a call sent right after it can still run on the old process,
    so a test that expects the next call to see the death must wait for it.
    """
    pid = ray.get(actor.ready.remote(), timeout=timeout_s)["pid"]
    ray.kill(actor, no_restart=not restart)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"worker pid {pid} still runs {timeout_s} s after ray.kill")


def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 15) -> None:
    """Wait until ``condition()`` holds (Ray applies removals and deaths asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still not so after {timeout_s} s")
        time.sleep(0.1)


def live_placement_groups(name: str) -> list[dict]:
    """Placement groups called ``name`` that Ray has not removed."""
    return [pg for pg in ray.util.placement_group_table().values()
            if pg["name"] == name and pg["state"] != "REMOVED"]
