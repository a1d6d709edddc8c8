"""The continuous batcher driven from asyncio: requests await their tokens while one worker
thread runs decode steps back to back, and new requests join between two steps."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from troupe.generation import ContinuousBatcher, Event, SamplingParams


class AsyncBatcher:
    """``generate`` yields a sequence's Events as the shared decode loop produces them; a
    caller that stops listening (client gone) cancels its sequence."""

    def __init__(self, batcher: ContinuousBatcher):
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
                    raise ev
                done = ev.finish_reason is not None
                yield ev
        finally:
            self._queues.pop(seq_id, None)
            if not done:
                self.batcher.cancel(seq_id)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.batcher.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                events = await loop.run_in_executor(self._pool, self.batcher.step)
            except Exception as e:  # a failed step fails the sequences in it, not the server
                for seq_id in self.batcher.active_ids():
                    self.batcher.cancel(seq_id)
                    if seq_id in self._queues:
                        self._queues[seq_id].put_nowait(RuntimeError(f"decode step failed: {e!r}"))
                await loop.run_in_executor(self._pool, self.batcher.step)  # drop them
                continue
            self.steps += 1
            for ev in events:
                queue = self._queues.get(ev.seq_id)
                if queue is not None:
                    queue.put_nowait(ev)
