"""Helpers shared by the runtime tests."""

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import ray

RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_head(proc: subprocess.Popen) -> None:
    """Stop a `ray start --head --block` started in a session of its own."""
    # SIGTERM to `ray start` alone: it stops its processes in order (a SIGTERM to the whole
    # group made it wait ~30 s for processes already gone); then sweep what is left of the group
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def ray_head(tmp: Path, auth_mode: str = "token", num_cpus: int = 2) -> Iterator[dict]:
    """A cluster started with `ray start --head` on 127.0.0.1 (dashboard included), as an
    operator would; with token auth its token is a file of its own, not ~/.ray/auth_token.

    Yields {"address": GCS host:port, "url": dashboard URL, "env": the head's environment,
    "token": the token file}. The head is stopped on exit.
    """
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    (tmp / "home").mkdir(exist_ok=True)
    port, dash = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": auth_mode, "RAY_AUTH_TOKEN_PATH": str(token),
           "HOME": str(tmp / "home")}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [RAY, "start", "--head", f"--port={port}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
         "--block"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{dash}"
        deadline = time.monotonic() + 90
        while subprocess.run([RAY, "job", "list", "--address", url], env=env,
                             capture_output=True).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, "ray start --head failed"
            time.sleep(1)
        yield {"address": f"127.0.0.1:{port}", "url": url, "env": env, "token": token}
    finally:
        stop_head(proc)


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
    """Placement groups of ``name`` (graph/role) that Ray has not removed."""
    return [pg for pg in ray.util.placement_group_table().values()
            if pg["name"].split("@")[0] == name and pg["state"] != "REMOVED"]
