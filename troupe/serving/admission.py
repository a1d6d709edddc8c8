"""Admission: which requests a replica takes, and in what order, so that no client can game
its limits.

A request passes three gates:

1. **Its body.** A body that comes with its headers (every ordinary request) is read at once
   and needs nothing. A longer one takes one of ``limits.max_receiving`` places (beyond them:
   429) and must keep arriving: 3 seconds after its first part, at ``limits.min_body_rate``
   bytes per second at least, and whole within ``limits.body_timeout_s`` (else 408). A client
   that trickles its body a byte at a time is dropped within seconds rather than holding a
   place, and never delays a request that sent its body whole. One that sends its headers
   and nothing more holds no place either, and is dropped after ``body_timeout_s``.
2. **Its preparation** (JSON, chat template, tokenizer) runs on one thread at a lower CPU
   priority, not on the event loop (ServeReplica does this), so that one huge request delays
   no stream.
3. **A place in flight.** At most ``limits.max_concurrent`` requests are generating. One that
   finds them all taken waits, first come first served, up to ``limits.queue_timeout_s`` for
   a place, while at most ``limits.max_queued`` others wait; beyond those: 429 with
   Retry-After, answered before the body is read when the queue is full already. A waiting
   request costs no CPU, where an immediate 429 invites an eager client to retry at once:
   with no queue, 64 clients retrying every 429 against 32 places kept 0.36x the goodput of
   32 clients that never retry (benchmarks/hostile_load.py).

The counts and the check happen with no ``await`` between them, so requests arriving together
cannot all pass a check before any of them is counted."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque

from troupe.serving.config import Limits
from troupe.serving.protocol import RequestError

GRACE_S = 3.0  # a body's first seconds are not held to limits.min_body_rate


class Admission:
    def __init__(self, limits: Limits):
        self.limits = limits
        self.in_flight = 0  # requests holding a place (generating, or handing back an answer)
        self.receiving = 0  # requests whose bodies are still arriving past their headers
        self._queue: deque[asyncio.Future] = deque()  # requests waiting for a place

    @property
    def queued(self) -> int:
        return sum(not f.done() for f in self._queue)

    # ---- gate 1: the body --------------------------------------------------------------------
    def refuse_if_full(self) -> None:
        """429 at once, before the body is read, when every place and every queue seat is
        taken."""
        if self.in_flight >= self.limits.max_concurrent and self.queued >= self.limits.max_queued:
            raise self._full()

    def _full(self) -> RequestError:
        return RequestError(429, f"{self.in_flight} requests in flight and {self.queued} "
                            "waiting, the limits of this replica; retry later",
                            type="rate_limit_error")

    async def body(self, receive) -> bytes:
        """The request body from the ASGI ``receive`` callable, under gate 1's rules."""
        lim, start = self.limits, time.monotonic()
        body, held, paced = bytearray(), False, None  # paced: (first message's time, bytes)
        try:
            while True:
                message = await self._next(receive, start, len(body), paced)
                if message["type"] == "http.disconnect":
                    raise RequestError(400, "the client closed the connection before its body "
                                       "arrived")
                body += message.get("body", b"")
                if len(body) > lim.max_body_bytes:
                    raise RequestError(413, f"request body exceeds the limit of "
                                       f"{lim.max_body_bytes} bytes")
                if not message.get("more_body", False):
                    return bytes(body)
                if not held:  # the body did not come whole with its headers: it takes a place
                    paced = (time.monotonic(), len(body))
                    if self.receiving >= lim.max_receiving:
                        raise RequestError(429, f"{self.receiving} requests are still sending "
                                           "their bodies, the limit of this replica; retry "
                                           "later", type="rate_limit_error")
                    self.receiving += 1
                    held = True
        finally:
            if held:
                self.receiving -= 1

    async def _next(self, receive, start: float, received: int,
                    paced: tuple[float, int] | None) -> dict:
        """The next ASGI message, or 408 once the body falls behind its deadline: the whole
        body within body_timeout_s of the start and, from its first part on (``paced``: when
        it came and its bytes), the bytes after it at min_body_rate after GRACE_S. The first
        part is not paced: it waits on the proxy as much as on the client, and under load it
        took over a second to reach the replica."""
        lim = self.limits
        deadline = whole = start + lim.body_timeout_s
        if paced is not None:
            deadline = min(whole, paced[0] + GRACE_S + (received - paced[1]) / lim.min_body_rate)
        try:
            return await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            if deadline < whole:
                raise RequestError(408, f"the request body arrived at under "
                                   f"{lim.min_body_rate} bytes/s ({received} bytes in "
                                   f"{time.monotonic() - start:.1f}s)") from None
            raise RequestError(408, f"the request body did not arrive within "
                               f"{lim.body_timeout_s:g}s") from None

    # ---- gate 3: a place in flight -------------------------------------------------------------
    async def place(self) -> "Place":
        """A place among ``limits.max_concurrent``: at once when one is free and nobody waits,
        else after the requests queued before this one, within ``limits.queue_timeout_s``
        (429 after it, or at once when ``limits.max_queued`` already wait)."""
        lim = self.limits
        if self.in_flight < lim.max_concurrent and not self.queued:
            return Place(self)
        if self.queued >= lim.max_queued:
            raise self._full()
        waiter = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), lim.queue_timeout_s)
        except asyncio.TimeoutError:
            if waiter.done():  # a place was handed over as the wait ended: keep it
                return waiter.result()
            waiter.cancel()
            raise RequestError(429, f"no place came free within {lim.queue_timeout_s:g}s "
                               f"({self.in_flight} requests in flight); retry later",
                               type="rate_limit_error") from None
        except asyncio.CancelledError:  # the client went away while waiting
            if waiter.done() and not waiter.cancelled():
                waiter.result().release()
            else:
                waiter.cancel()
            raise
        finally:
            if waiter in self._queue and waiter.done():
                self._queue.remove(waiter)
        return waiter.result()

    def _give_back(self) -> None:
        """A place came free: hand it to the first request still waiting, else count it
        free."""
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():
                self.in_flight -= 1
                waiter.set_result(Place(self))  # counts itself back in
                return
        self.in_flight -= 1


class Place:
    """A request's place among ``limits.max_concurrent``, held from admission until its answer
    is done. ``release`` is idempotent; once a stream has taken the place over
    (``handed_over``), only the stream's own release (``final``) or the stream being dropped
    gives it back."""

    def __init__(self, admission: Admission):
        self._admission, self._held, self.handed_over = admission, True, False
        admission.in_flight += 1

    def release(self, final: bool = False) -> None:
        if self._held and (final or not self.handed_over):
            self._held = False
            self._admission._give_back()


def lower_priority(niceness: int = 10) -> None:
    """Lower the calling thread's CPU priority (Linux schedules threads apart; elsewhere this
    does nothing)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass
