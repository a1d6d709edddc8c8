"""Decode tokens per second of troupe's engine over the steps where the whole batch decodes:
what the engine benchmarks compare (sequences that end sooner, such as constrained answers,
would otherwise shrink the batch and the rate with it)."""

from __future__ import annotations

import time


def full_batch_rate(engine, batch: int) -> float:
    """Step ``engine`` (its sequences queued) to the end; tokens per second of the steps in
    which all ``batch`` sequences decoded. The first step (the prefill) is not timed."""
    engine.step()
    n, seconds = 0, 0.0
    while engine.has_work():
        t0 = time.perf_counter()
        events = engine.step()
        if len(events) == batch:
            n, seconds = n + batch, seconds + time.perf_counter() - t0
    return n / seconds
