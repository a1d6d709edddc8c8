"""The continuous batcher driven from asyncio: requests await their tokens while one worker
thread runs decode steps back to back, and new requests join between two steps.

A sequence the engine cannot go on with (non-finite logits, a sampler error, a step that
raised) ends with SequenceFailed; the others go on. Should a batcher's step itself raise (the
expert-parallel one, whose ranks are Ray actors), its running sequences fail, and after a second
failure in a row the batcher is reset and everything it held fails. The decode loop runs under
a supervisor that restarts it should it ever raise, so no request waits on a loop that is
gone."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Protocol

from troupe.generation import Event, SamplingParams

log = logging.getLogger(__name__)


class Batcher(Protocol):
    """What a replica decodes with: troupe.generation.ContinuousBatcher, or the expert-parallel
    batcher over rank actors (troupe.serving.ranks). The attributes say what the
    engine offers beyond decoding: per-row LoRA adapters (``adapters``, None: none), a prefix
    cache (``prefix_cache``, None: none), structured outputs (``structured_outputs``; then
    ``grammars`` is made at the first constrained request)."""

    adapters: Any
    prefix_cache: Any
    grammars: Any
    structured_outputs: bool
    prefill_tokens: int
    speculation: dict[str, int]  # speculative decoding's passes, proposed, accepted

    def add(self, seq_id: str, prompt: list[int], params: SamplingParams) -> None: ...
    def cancel(self, seq_id: str) -> None: ...
    def step(self) -> list[Event]: ...
    def has_work(self) -> bool: ...
    def reset(self) -> list[str]: ...
    def active_ids(self) -> list[str]: ...
    def waiting(self) -> int: ...
    def kv_usage(self) -> tuple[int, int]: ...


class SequenceFailed(RuntimeError):
    """The engine could not finish this sequence (its own logits, or a failed step)."""


class AsyncBatcher:
    """``generate`` yields a sequence's Events as the shared decode loop produces them; a
    caller that stops listening (client gone) cancels its sequence."""

    def __init__(self, batcher: Batcher):
        self.batcher = batcher
        self._queues: dict[str, asyncio.Queue] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="decode")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.steps = 0

    async def generate(self, seq_id: str, prompt: list[int],
                       params: SamplingParams) -> AsyncIterator[Event]:
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[seq_id] = queue
        done = False
        try:
            self.batcher.add(seq_id, prompt, params)  # ValueError: the request does not fit
            self._start()
            self._wake.set()
            while not done:
                ev = await queue.get()
                if isinstance(ev, BaseException):
                    done = True
                    raise ev
                if ev.error is not None:
                    done = True
                    raise SequenceFailed(ev.error)
                done = ev.finish_reason is not None
                yield ev
        finally:
            self._queues.pop(seq_id, None)
            if not done:
                self.batcher.cancel(seq_id)

    async def between_steps(self, fn, *args):
        """``fn(*args)`` on the decode thread, between two steps (what must not change while a
        step runs: the adapters' stacks)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        """Run the decode loop; should it ever raise, fail what the engine held, reset it and
        run the loop again."""
        while True:
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.exception("the decode loop failed; restarting it")
                self._fail(self.batcher.reset(), f"the decode loop failed: {e!r}")

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        failed_in_a_row = 0
        while True:
            if not self.batcher.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                events = await loop.run_in_executor(self._pool, self.batcher.step)
            except Exception as e:  # a failed step fails the sequences in it, not the server
                failed_in_a_row += 1
                if failed_in_a_row >= 2:
                    self._fail(self.batcher.reset(), f"decode step failed: {e!r}")
                    continue
                failed = self.batcher.active_ids()
                for seq_id in failed:
                    self.batcher.cancel(seq_id)  # dropped by the next step
                self._fail(failed, f"decode step failed: {e!r}")
                continue
            failed_in_a_row = 0
            self.steps += 1
            for ev in events:
                queue = self._queues.get(ev.seq_id)
                if queue is not None:
                    queue.put_nowait(ev)

    def _fail(self, seq_ids: list[str], message: str) -> None:
        for seq_id in seq_ids:
            queue = self._queues.get(seq_id)
            if queue is not None:
                queue.put_nowait(SequenceFailed(message))
