"""Programmatic rewards: the user's ``module:function`` run in a pool of separate processes
(troupe.rlhf.sandbox), so that a call can be time-limited and a hung one killed.

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

import selectors
import time
from dataclasses import dataclass, field

from troupe.rlhf.sandbox.pool import MAX_ERROR, ProtocolBreach, SandboxProcess


@dataclass
class Rewards:
    """A batch's scores (failures at failure_score) and its failures as (index, message)."""

    values: list[float]
    failures: list[tuple[int, str]] = field(default_factory=list)


class RewardFunction:
    """``spec`` = "module:function", called as fn(prompt, response, **fields) in ``workers``
    processes, each call limited to ``timeout_s``."""

    def __init__(self, spec: str, timeout_s: float = 10.0, workers: int = 2,
                 failure_score: float = 0.0, start_timeout_s: float = 120.0,
                 memory_mb: int = 4096):
        self.spec, self.timeout_s, self.failure_score = spec, timeout_s, failure_score
        self.start_timeout_s, self.memory_mb = start_timeout_s, memory_mb
        self.workers = [SandboxProcess(spec, start_timeout_s, memory_mb) for _ in range(workers)]
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

    def _send(self, w: SandboxProcess, request: dict, out: Rewards, values: list, sel) -> None:
        try:
            w.send(request)
        except (BrokenPipeError, OSError):
            w.task = request["i"]
            self._fail(w, f"the reward process had exited (code {w.proc.poll()})", out,
                       values, sel)

    def _receive(self, w: SandboxProcess, out: Rewards, values: list, sel) -> None:
        try:
            reply = w.read_line(0.0)
            if reply is not None and reply.get("id") != w.task_id:
                raise ProtocolBreach(f"a reply to another request ({str(reply.get('id'))[:40]!r})")
            if reply is not None and "error" not in reply and not isinstance(
                    reply.get("value"), float):
                raise ProtocolBreach(f"a reply without a value: {str(reply)[:80]!r}")
        except ProtocolBreach as e:
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

    def _fail(self, w: SandboxProcess, why: str, out: Rewards, values: list, sel) -> None:
        """The sample ``w`` was scoring fails; ``w``'s process is replaced by a fresh one."""
        out.failures.append((w.task, why))
        sel.unregister(w.proc.stdout)
        w.kill()
        fresh = SandboxProcess(self.spec, self.start_timeout_s, self.memory_mb)
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
