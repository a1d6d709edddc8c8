"""What a worker process must look like again before a second role may use it.

A pooled worker (troupe.runtime.pool) hosts one role after another in one process, which saves
each graph the start of its processes (a Ray worker, torch and troupe imported: about 2 s of
CPU each). A role must then find the process as a fresh one would be, so a worker records
its state when it goes idle (``Fresh.take``) and puts it back when a role leaves
(``Fresh.restore``): the environment variables, torch's default RNG seed, default dtype,
grad mode and thread count. The child processes the role started are ended, as they would be
once the process that holds their pipes is gone (a sandboxed reward function's, say:
troupe.rlhf.sandbox). What cannot be put back is checked (``Fresh.leftovers``): threads the
role left running. A worker with leftovers is not reused; the pool ends it, as a graph's
shutdown ends a worker that is not pooled.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field

import psutil
import ray
import torch

# Threads a process keeps for good once a module starts them, shared by every role it hosts:
# ZeRO-3's gather thread (troupe.parallel.partition).
PROCESS_THREADS = ("zero3",)


@dataclass
class Fresh:
    """A worker process's state between roles."""

    environ: dict[str, str]
    seed: int
    dtype: torch.dtype
    threads: int
    grad: bool
    threads_then: set[threading.Thread] = field(default_factory=set)
    children_then: set[int] = field(default_factory=set)

    @classmethod
    def take(cls) -> "Fresh":
        return cls(environ=dict(os.environ), seed=torch.initial_seed(),
                   dtype=torch.get_default_dtype(), threads=torch.get_num_threads(),
                   grad=torch.is_grad_enabled(), threads_then=set(threading.enumerate()),
                   children_then={p.pid for p in psutil.Process().children(recursive=True)})

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        torch.manual_seed(self.seed)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(self.grad)

    def end_children(self) -> None:
        """Kill the processes the role started (and theirs), and reap them."""
        started = [p for p in psutil.Process().children(recursive=True)
                   if p.pid not in self.children_then]
        for proc in started:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(started, timeout=5)  # reaps this process's own children

    def leftovers(self, wait_s: float = 2.0) -> list[str]:
        """Threads started since ``take`` that are still running after ``wait_s`` (a pool
        whose owner is gone ends its threads soon after; one a module keeps for the process,
        PROCESS_THREADS, is not the role's), and child processes that outlived
        ``end_children``: what makes the process unfit for another role. Empty when it is
        fit."""
        deadline = time.monotonic() + wait_s
        while True:
            threads = [t.name for t in threading.enumerate()
                       if t not in self.threads_then and t.is_alive()
                       and not isinstance(t, threading._DummyThread)  # Ray's own, seen from C++
                       and not t.name.startswith(PROCESS_THREADS)]
            children = [f"child process {p.pid}" for p in psutil.Process().children(True)
                        if p.pid not in self.children_then and _running(p)]
            if not (threads or children) or time.monotonic() > deadline:
                return [f"thread {name!r}" for name in threads] + children
            time.sleep(0.05)


def reconstructed() -> bool:
    """Whether Ray restarted this actor's process (Ray's own check warns of a deprecated
    attribute it reads itself)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.get_runtime_context().was_current_actor_reconstructed


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
