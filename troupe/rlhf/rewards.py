"""Programmatic rewards: the user's ``module:function`` run in a pool of separate processes
(troupe/rlhf/sandbox_child.py), so that a call can be time-limited and a hung one killed.

A call that raises, runs past the time limit, kills its process or returns something other
than a finite number is a per-sample failure: it scores ``failure_score``, is counted and
described, and the batch goes on (the process is replaced when it hung or died). Requests and
replies are JSON lines (no pickle); the function must be importable from the working directory
or PYTHONPATH, and one that cannot be imported stops the run before step 3 starts.

The pool does not trust the function: each process runs in its own process group, under an
address-space limit (``memory_mb``), and the whole group (whatever the function started) is
killed on a timeout and at ``close``; a reply must echo its request's random id, be JSON and
fit in ``MAX_REPLY`` bytes, and anything else (a reply to another request, as a function that
forks can send, a stray line, an oversized one) is a protocol breach: the sample fails with a
message saying so and the process is replaced, never a misattributed score or an exception.
Error texts come back cut to ``MAX_ERROR`` characters.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_CHILD = Path(__file__).with_name("sandbox_child.py")
MAX_REPLY = 1 << 16   # bytes of one reply line
MAX_ERROR = 1000      # characters of an error text kept


class _Breach(Exception):
    """A reward process broke the reply protocol."""


class RewardFunctionError(RuntimeError):
    """The reward function cannot be used at all (not importable, or its processes exit)."""


@dataclass
class Rewards:
    """A batch's scores (failures at failure_score) and its failures as (index, message)."""

    values: list[float]
    failures: list[tuple[int, str]] = field(default_factory=list)


class _Worker:
    """One sandboxed process (troupe/rlhf/sandbox_child.py) serving ``spec`` as ``kind``
    ("function" or "environment", constructed with ``kwargs``); ``setting`` names the
    config key in errors."""

    def __init__(self, spec: str, start_timeout_s: float, memory_mb: int,
                 kind: str = "function", kwargs: dict | None = None,
                 setting: str = "reward.function"):
        self.proc = subprocess.Popen([sys.executable, str(_CHILD), spec, str(memory_mb), kind,
                                      json.dumps(kwargs or {})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=os.getcwd(), start_new_session=True)
        self.buf, self.task, self.started, self.eof = b"", None, 0.0, False
        self.task_id = ""
        try:
            reply = self.read_line(start_timeout_s)
        except _Breach as e:
            reply = {"fatal": f"protocol breach at start: {e}"}
        if reply is None or "fatal" in reply:
            self.kill()
            why = reply["fatal"] if reply else f"no answer within {start_timeout_s:.0f} s"
            raise RewardFunctionError(f"{setting} {spec!r}: {str(why)[:MAX_ERROR]}")

    def read_line(self, timeout_s: float) -> dict | None:
        """The next reply, or None after ``timeout_s`` (0: what has arrived) or at the end of
        the process's output (then ``eof`` is set)."""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self.buf:
                if len(self.buf) > MAX_REPLY:
                    raise _Breach(f"a reply longer than {MAX_REPLY} bytes")
                if not sel.select(max(deadline - time.monotonic(), 0)):
                    return None
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    self.eof = True
                    return None
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        if len(line) > MAX_REPLY:
            raise _Breach(f"a reply longer than {MAX_REPLY} bytes")
        try:
            reply = json.loads(line)
        except ValueError:
            raise _Breach(f"a line that is not JSON: {line[:80]!r}") from None
        if not isinstance(reply, dict):
            raise _Breach(f"a reply that is not an object: {line[:80]!r}")
        return reply

    def send(self, request: dict) -> None:
        self.task, self.started = request["i"], time.monotonic()
        self.task_id = request["id"] = secrets.token_hex(8)
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        """Kill the process and everything it started (its process group)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.wait()


class RewardFunction:
    """``spec`` = "module:function", called as fn(prompt, response, **fields) in ``workers``
    processes, each call limited to ``timeout_s``."""

    def __init__(self, spec: str, timeout_s: float = 10.0, workers: int = 2,
                 failure_score: float = 0.0, start_timeout_s: float = 120.0,
                 memory_mb: int = 4096):
        self.spec, self.timeout_s, self.failure_score = spec, timeout_s, failure_score
        self.start_timeout_s, self.memory_mb = start_timeout_s, memory_mb
        self.workers = [_Worker(spec, start_timeout_s, memory_mb) for _ in range(workers)]
        self.failures = 0  # over the pool's life

    def __call__(self, prompts: list, responses: list[str],
                 fields: list[dict] | None = None) -> Rewards:
        fields = fields or [{}] * len(prompts)
        todo = [{"i": i, "prompt": p, "response": r, "fields": f}
                for i, (p, r, f) in enumerate(zip(prompts, responses, fields))][::-1]
        values: list[float | None] = [None] * len(todo)
        out = Rewards([])
        with selectors.DefaultSelector() as sel:
            for w in self.workers:
                sel.register(w.proc.stdout, selectors.EVENT_READ, w)
            while todo or any(w.task is not None for w in self.workers):
                for w in self.workers:
                    if w.task is None and todo:
                        self._send(w, todo.pop(), out, values, sel)
                busy = [w for w in self.workers if w.task is not None]
                if not busy:
                    continue
                wait = min(w.started + self.timeout_s for w in busy) - time.monotonic()
                ready = {key.data for key, _ in sel.select(max(wait, 0))} if wait > 0 else set()
                for w in busy:
                    if w in ready or b"\n" in w.buf:
                        self._receive(w, out, values, sel)
                    elif time.monotonic() - w.started > self.timeout_s:
                        self._fail(w, f"no result within {self.timeout_s:g} s", out, values,
                                   sel)
        out.values = [v if v is not None else self.failure_score for v in values]
        self.failures += len(out.failures)
        return out

    def _send(self, w: _Worker, request: dict, out: Rewards, values: list, sel) -> None:
        try:
            w.send(request)
        except (BrokenPipeError, OSError):
            w.task = request["i"]
            self._fail(w, f"the reward process had exited (code {w.proc.poll()})", out,
                       values, sel)

    def _receive(self, w: _Worker, out: Rewards, values: list, sel) -> None:
        try:
            reply = w.read_line(0.0)
            if reply is not None and reply.get("id") != w.task_id:
                raise _Breach(f"a reply to another request ({str(reply.get('id'))[:40]!r})")
            if reply is not None and "error" not in reply and not isinstance(
                    reply.get("value"), float):
                raise _Breach(f"a reply without a value: {str(reply)[:80]!r}")
        except _Breach as e:
            self._fail(w, f"protocol breach by the reward process: {e}", out, values, sel)
            return
        if reply is None:
            if w.eof:
                self._fail(w, f"the reward process exited (code {w.proc.wait()})", out,
                           values, sel)
            return
        i, w.task = w.task, None
        if "error" in reply:
            out.failures.append((i, str(reply["error"])[:MAX_ERROR]))
        else:
            values[i] = reply["value"]

    def _fail(self, w: _Worker, why: str, out: Rewards, values: list, sel) -> None:
        """The sample ``w`` was scoring fails; ``w``'s process is replaced by a fresh one."""
        out.failures.append((w.task, why))
        sel.unregister(w.proc.stdout)
        w.kill()
        fresh = _Worker(self.spec, self.start_timeout_s, self.memory_mb)
        self.workers[self.workers.index(w)] = fresh
        sel.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []

    def __enter__(self) -> "RewardFunction":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
