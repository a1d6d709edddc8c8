"""Environments for multi-turn (agentic) rollouts, run in a sandboxed process pool.

``env.function`` names a class, ``module:Class``, with two methods:

    reset(row) -> messages                     the conversation's opening (chat messages)
    step(messages, assistant) -> (messages, reward, done)

``row`` is the data row (its prompt and fields); ``messages`` is the conversation so far and
``assistant`` the model's new turn, ``{"role": "assistant", "content": ..., "tool_calls": [...]}``
with its tool calls parsed as the server parses them (troupe.generation.tools); ``step`` answers
with the messages that follow (tool results, a user's reply), a reward (a number, or None: none
this turn) and whether the trajectory is over. An instance keeps its state between turns: every
request of a trajectory goes to the one process that holds it, from reset to close.

The pool is the one reward functions use (troupe.rlhf.sandbox): processes of their own, each
under an address-space limit, killed with whatever they started when a request runs past
``timeout_s``, JSON lines both ways (troupe/rlhf/sandbox/child.py; no pickle). A request that
raises, returns something malformed, runs out of time or kills its process ends its trajectory
as a failure with its cause, counted by kind. The other trajectories of a process that had to be
replaced are replayed on the new one: their reset and every step so far sent again in order, the
replies dropped, so that their instances reach the state they had (for an environment whose
answers depend only on what it is sent; one whose replay fails is lost, a failure saying so).
Nothing stops the run.

``submit``/``poll`` let the caller generate while environments work: requests queue per
process, ``poll`` sends, collects and times them out.
"""

from __future__ import annotations

import itertools
import selectors
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from troupe.rlhf.sandbox.pool import MAX_ERROR, ProtocolBreach, SandboxProcess


@dataclass
class EnvReply:
    """The answer to a trajectory's reset or step; ``error`` set: the trajectory failed, and
    ``cause`` says how (raised, timeout, exited, lost, protocol)."""

    traj: str
    op: str
    messages: list = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    error: str | None = None
    cause: str | None = None


class EnvironmentPool:
    def __init__(self, spec: str, workers: int = 2, timeout_s: float = 10.0,
                 memory_mb: int = 4096, start_timeout_s: float = 120.0,
                 kwargs: dict | None = None):
        self.spec, self.timeout_s, self.memory_mb = spec, timeout_s, memory_mb
        self.start_timeout_s, self.kwargs = start_timeout_s, kwargs or {}
        self.workers = [self._start() for _ in range(workers)]
        self.queues: list[deque] = [deque() for _ in range(workers)]
        self.home: dict[str, int] = {}        # trajectory -> the process holding it
        self.lost: dict[str, str] = {}        # trajectory -> why its state is gone
        self.history: dict[str, list] = {}    # trajectory -> its requests answered so far
        self.replayed = 0                     # trajectories moved to a new process
        self.inflight: dict[int, dict] = {}   # request number -> request
        self.ready: list[EnvReply] = []       # replies decided without a process
        self.failures: Counter = Counter()    # cause -> failed trajectories
        self._numbers = itertools.count()

    def _start(self) -> SandboxProcess:
        return SandboxProcess(self.spec, self.start_timeout_s, self.memory_mb, "environment",
                       self.kwargs, setting="env.function")

    # ---- requests ---------------------------------------------------------------------------
    def reset(self, traj: str, row: dict) -> None:
        """Start trajectory ``traj`` on the process holding the fewest."""
        load = Counter(self.home.values())
        w = min(range(len(self.workers)), key=lambda i: (load[i], i))
        self.home[traj] = w
        self.lost.pop(traj, None)
        self.history[traj] = []
        self._queue(w, {"op": "reset", "traj": traj, "row": row})

    def step(self, traj: str, messages: list, assistant: dict) -> None:
        if traj in self.lost or traj not in self.home:
            self._fail(traj, "step", self.lost.pop(traj, "the trajectory was never reset"),
                       "lost")
            return
        self._queue(self.home[traj], {"op": "step", "traj": traj, "messages": messages,
                                      "assistant": assistant})

    def close(self, traj: str) -> None:
        """The trajectory is over: its process drops the instance (no reply)."""
        w = self.home.pop(traj, None)
        self.lost.pop(traj, None)
        self.history.pop(traj, None)
        if w is not None:
            self._queue(w, {"op": "close", "traj": traj})

    def _queue(self, w: int, request: dict) -> None:
        request["i"] = next(self._numbers)
        self.queues[w].append(request)

    def pending(self) -> bool:
        """Whether a reply is still to come."""
        return bool(self.ready) or any(
            any(r["op"] != "close" for r in q) for q in self.queues) or any(
            w.task is not None and self.inflight.get(w.task, {}).get("op") != "close"
            for w in self.workers)

    # ---- the loop ---------------------------------------------------------------------------
    def poll(self, wait_s: float = 0.0) -> list[EnvReply]:
        """Send what is queued to idle processes, then collect the replies that arrive within
        ``wait_s`` (0: those already there; returns at the first), failing requests past
        their time limit."""
        deadline = time.monotonic() + wait_s
        while True:
            self._dispatch()
            for w in list(self.workers):
                if w.task is not None and time.monotonic() - w.started > self.timeout_s:
                    self._replace(w, f"no reply within {self.timeout_s:g} s", "timeout")
            self._dispatch()
            busy = [w for w in self.workers if w.task is not None]
            if busy:
                until = min([deadline] + [w.started + self.timeout_s for w in busy])
                with selectors.DefaultSelector() as sel:
                    for w in busy:
                        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
                    arrived = {key.data for key, _ in
                               sel.select(max(until - time.monotonic(), 0))}
                for w in busy:
                    if w in arrived or b"\n" in w.buf:
                        self._receive(w)
            if self.ready or not busy or time.monotonic() >= deadline:
                break
        out, self.ready = self.ready, []
        return out

    def _dispatch(self) -> None:
        for i, w in enumerate(self.workers):
            while w.task is None and self.queues[i]:
                request = self.queues[i].popleft()
                self.inflight[request["i"]] = request
                try:
                    w.send(dict(request))
                except (BrokenPipeError, OSError):
                    w.task = request["i"]
                    self._replace(w, f"its process had exited (code {w.proc.poll()})",
                                  "exited")

    def _receive(self, w: SandboxProcess) -> None:
        try:
            reply = w.read_line(0.0)
            if reply is not None and reply.get("id") != w.task_id:
                raise ProtocolBreach(f"a reply to another request ({str(reply.get('id'))[:40]!r})")
        except ProtocolBreach as e:
            self._replace(w, f"protocol breach by the environment process: {e}", "protocol")
            return
        if reply is None:
            if w.eof:
                self._replace(w, f"its process exited (code {w.proc.wait()})", "exited")
            return
        request = self.inflight.pop(w.task)
        w.task = None
        if request["op"] == "close":
            return
        traj, op = request["traj"], request["op"]
        if request.get("replay"):  # bringing an instance back: its answer was given before
            if "error" in reply and traj in self.home:
                del self.home[traj]
                self.lost[traj] = f"its replay on a new process failed: {reply['error']}"
                self._fail_queued(self.workers.index(w), traj)
            return
        if "error" in reply:
            home = self.home.pop(traj, None)
            self._fail(traj, op, str(reply["error"])[:MAX_ERROR], "raised")
            if home is not None:
                self._queue(home, {"op": "close", "traj": traj})
            return
        if traj in self.history:
            self.history[traj].append({k: v for k, v in request.items() if k not in ("i", "id")})
        if op == "reset":
            self.ready.append(EnvReply(traj, op, reply["messages"]))
        else:
            self.ready.append(EnvReply(traj, op, reply["messages"], reply["reward"],
                                       reply["done"]))

    def _replace(self, w: SandboxProcess, why: str, cause: str) -> None:
        """``w``'s request fails with ``why``; its process is killed and replaced, and the
        other trajectories it held are replayed on the new one before their queued requests
        (a queued reset just moves: nothing of its trajectory was there yet)."""
        i = self.workers.index(w)
        request = self.inflight.pop(w.task, None)
        w.kill()
        self.workers[i] = self._start()
        culprit = request["traj"] if request else None
        if request is not None and request["op"] != "close":
            self.home.pop(culprit, None)
            self.history.pop(culprit, None)
            self._fail(culprit, request["op"], why, cause)
        queued, self.queues[i] = self.queues[i], deque()
        for traj in [t for t, h in self.home.items() if h == i]:
            for past in self.history.get(traj, []):
                self._queue(i, {**past, "replay": True})
            self.replayed += bool(self.history.get(traj))
        self.queues[i].extend(r for r in queued if r["op"] != "close")  # a new process: no
        # instance of a trajectory closed before it is there

    def _fail_queued(self, i: int, traj: str) -> None:
        """``traj`` is lost: its requests queued on process ``i`` fail (the first says why)."""
        keep = deque()
        for r in self.queues[i]:
            if r["traj"] != traj:
                keep.append(r)
            elif r["op"] != "close" and not r.get("replay") and traj in self.lost:
                self._fail(traj, r["op"], self.lost.pop(traj), "lost")
        self.queues[i] = keep

    def _fail(self, traj: str, op: str, why: str, cause: str) -> None:
        self.failures[cause] += 1
        self.ready.append(EnvReply(traj, op, error=why, cause=cause, done=True))

    def close_all(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []

    def __enter__(self) -> "EnvironmentPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close_all()
