"""The asyncio side of the engine never dies silently: a failed step fails its sequences, a
failed recovery resets the engine, and the requests after it are served."""

import asyncio

import pytest

from tests.generation.test_engine import EOS, alone, tiny
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.serving.runner import AsyncBatcher, SequenceFailed


class Faulty(ContinuousBatcher):
    """A batcher whose next ``fail`` steps raise."""

    fail = 0

    def step(self):
        if self.fail:
            self.fail -= 1
            raise RuntimeError("injected step failure")
        return super().step()


async def collect(runner, sid, prompt, n):
    try:
        return [ev.token async for ev in runner.generate(sid, prompt, SamplingParams(max_tokens=n))]
    except SequenceFailed as e:
        return e


@pytest.mark.parametrize("failures", [1, 2, 5])  # 2 and more in a row: the batcher is reset
def test_failed_steps_fail_their_sequences_and_the_server_goes_on(failures):
    model = tiny()
    engine = Faulty(model, EOS, max_batch=4)
    runner = AsyncBatcher(engine)

    async def scenario():
        first = asyncio.gather(*(collect(runner, f"a{i}", [3 + i, 4], 20) for i in range(3)))
        while runner.steps < 2:  # running, with tokens out
            await asyncio.sleep(0.001)
        engine.fail = failures
        got = await asyncio.wait_for(first, 30)
        # the first failure ends the three sequences; the loop then steps once more to drop
        # them, which fails again (and resets the batcher) while failures are left. A request
        # sent before that step could be dropped by the reset: wait until the loop is idle.
        while engine.has_work():
            await asyncio.sleep(0.001)
        assert engine.fail == max(failures - 2, 0)
        engine.fail = 0  # the fault is over: the next request is served
        after = await asyncio.wait_for(collect(runner, "b", [9, 8, 7], 6), 30)
        return got, after

    got, after = asyncio.run(scenario())
    assert all(isinstance(g, SequenceFailed) for g in got), got
    assert "injected step failure" in str(got[0])
    assert after == alone(model, [9, 8, 7], 6)
    assert not engine.has_work()


def test_a_step_that_raises_inside_the_engine_ends_only_its_sequences():
    model = tiny()
    engine = ContinuousBatcher(model, EOS, max_batch=4)
    engine.add("a", [3, 4], SamplingParams(max_tokens=6))
    engine.step()
    forward, calls = model.hidden, []

    def broken_once(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected forward failure")
        return forward(*args, **kwargs)

    model.hidden = broken_once
    engine.add("b", [5, 6], SamplingParams(max_tokens=6))
    events = engine.step()
    assert {(e.seq_id, e.finish_reason) for e in events} == {("a", "error"), ("b", "error")}
    assert "injected forward failure" in events[0].error
    engine.add("c", [9, 8, 7], SamplingParams(max_tokens=6))
    got = []
    while engine.has_work():
        got += [e.token for e in engine.step()]
    assert got == alone(tiny(), [9, 8, 7], 6)
