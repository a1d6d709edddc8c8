"""The sandboxed process pool that reward functions (troupe.rlhf.pipeline.rewards) and agent
environments (troupe.rlhf.agents.environments) share: each ``SandboxProcess`` runs the user's
code in a process of its own (troupe/rlhf/sandbox/child.py, run by path so that it imports the
standard library and the user's module only), in its own process group, under an address-space
limit, speaking JSON lines both ways (no pickle).

A reply must be one JSON object on one line of at most ``MAX_REPLY`` bytes; anything else is a
``ProtocolBreach``, which the caller turns into a failed request and a replaced process, never
a misattributed answer. Error texts are cut to ``MAX_ERROR`` characters. A process that cannot
start (the name does not import, no answer in time) raises ``SandboxError`` naming the setting
and the spec.
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
from pathlib import Path

CHILD = Path(__file__).with_name("child.py")
MAX_REPLY = 1 << 16   # bytes of one reply line
MAX_ERROR = 1000      # characters of an error text kept


class ProtocolBreach(Exception):
    """A sandboxed process broke the reply protocol."""


class SandboxError(RuntimeError):
    """The user's function or class cannot be used at all (not importable, or its processes
    exit)."""


class SandboxProcess:
    """One sandboxed process (troupe/rlhf/sandbox/child.py) serving ``spec`` as ``kind``
    ("function" or "environment", constructed with ``kwargs``); ``setting`` names the
    config key in errors."""

    def __init__(self, spec: str, start_timeout_s: float, memory_mb: int,
                 kind: str = "function", kwargs: dict | None = None,
                 setting: str = "reward.function"):
        self.proc = subprocess.Popen([sys.executable, str(CHILD), spec, str(memory_mb), kind,
                                      json.dumps(kwargs or {})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=os.getcwd(), start_new_session=True)
        self.buf, self.task, self.started, self.eof = b"", None, 0.0, False
        self.task_id = ""
        try:
            reply = self.read_line(start_timeout_s)
        except ProtocolBreach as e:
            reply = {"fatal": f"protocol breach at start: {e}"}
        if reply is None or "fatal" in reply:
            self.kill()
            why = reply["fatal"] if reply else f"no answer within {start_timeout_s:.0f} s"
            raise SandboxError(f"{setting} {spec!r}: {str(why)[:MAX_ERROR]}")

    def read_line(self, timeout_s: float) -> dict | None:
        """The next reply, or None after ``timeout_s`` (0: what has arrived) or at the end of
        the process's output (then ``eof`` is set)."""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self.buf:
                if len(self.buf) > MAX_REPLY:
                    raise ProtocolBreach(f"a reply longer than {MAX_REPLY} bytes")
                if not sel.select(max(deadline - time.monotonic(), 0)):
                    return None
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    self.eof = True
                    return None
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        if len(line) > MAX_REPLY:
            raise ProtocolBreach(f"a reply longer than {MAX_REPLY} bytes")
        try:
            reply = json.loads(line)
        except ValueError:
            raise ProtocolBreach(f"a line that is not JSON: {line[:80]!r}") from None
        if not isinstance(reply, dict):
            raise ProtocolBreach(f"a reply that is not an object: {line[:80]!r}")
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
