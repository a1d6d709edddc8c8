"""Environments in their sandboxed pool: an instance keeps its state from reset to done on one
process; a hang, an allocation past the memory limit, a crash, a raise and a malformed answer
each end only their trajectory, counted by cause; the others on a replaced process are
replayed on the new one and finish as if nothing happened; the pool goes on serving."""

import os
import textwrap
import time

import pytest

from troupe.rlhf.agents.environments import EnvironmentPool
from troupe.rlhf.sandbox.pool import SandboxError

MODULE = """
import os, time


class Counter:
    '''Counts the assistant's turns; done after row["turns"]; a turn's text may misbehave.'''

    def __init__(self, bonus=0):
        self.turns, self.bonus = 0, bonus

    def reset(self, row):
        self.limit = row["turns"]
        return [{"role": "user", "content": f"count to {self.limit}"}]

    def step(self, messages, assistant):
        self.turns += 1
        text = assistant["content"]
        if text == "hang":
            time.sleep(60)
        if text == "hog":
            return [{"role": "tool", "content": str(len(bytearray(3 << 30)))}], None, False
        if text == "crash":
            os._exit(7)
        if text == "raise":
            raise ValueError("the tool broke")
        if text == "malformed":
            return [{"role": "tool"}], 1.0, False
        if text == "slow":
            time.sleep(0.5)
        done = self.turns >= self.limit
        reward = float(self.turns + self.bonus) if done else None
        return [{"role": "tool", "content": f"turn {self.turns}"}], reward, done


class NoStep:
    def reset(self, row):
        return []
"""


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "user_envs.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return "user_envs"


def _run(pool, script: dict[str, list[str]], turns: dict[str, int], wait_s: float = 30.0):
    """Drive each trajectory through its scripted assistant turns; every reply by trajectory."""
    log = {t: [] for t in script}
    for t in script:
        pool.reset(t, {"turns": turns[t]})
    deadline = time.monotonic() + wait_s
    while pool.pending() and time.monotonic() < deadline:
        for reply in pool.poll(0.5):
            log[reply.traj].append(reply)
            if reply.error is None and not reply.done:
                k = sum(r.op == "step" for r in log[reply.traj])
                pool.step(reply.traj, [], {"role": "assistant", "content": script[reply.traj][k]})
            elif reply.done and reply.error is None:
                pool.close(reply.traj)
    assert not pool.pending()
    return log


def test_state_kept_between_turns_on_one_process(env_module):
    with EnvironmentPool(f"{env_module}:Counter", workers=2, kwargs={"bonus": 10}) as pool:
        script = {f"t{i}": ["ok"] * 4 for i in range(5)}
        log = _run(pool, script, {t: 2 + int(t[1:]) % 3 for t in script})
    for t, replies in log.items():
        n = 2 + int(t[1:]) % 3
        assert [r.op for r in replies] == ["reset"] + ["step"] * n
        assert replies[0].messages == [{"role": "user", "content": f"count to {n}"}]
        assert [r.reward for r in replies[1:]] == [None] * (n - 1) + [n + 10.0]
        assert replies[-1].done and all(r.error is None for r in replies)
    assert not pool.failures


def test_each_failure_ends_its_trajectory_with_its_cause(env_module):
    script = {"hang": ["ok", "hang"], "hog": ["hog"], "crash": ["crash"], "raise": ["raise"],
              "malformed": ["malformed"], "fine": ["slow", "ok", "ok"]}
    with EnvironmentPool(f"{env_module}:Counter", workers=3, timeout_s=2.0,
                         memory_mb=1024) as pool:
        t0 = time.monotonic()
        log = _run(pool, script, {t: 3 for t in script})
        took = time.monotonic() - t0
        errors = {t: r[-1] for t, r in log.items() if r[-1].error}
        assert errors["hang"].cause == "timeout" and "no reply within 2 s" in errors["hang"].error
        assert errors["hog"].cause == "raised" and "MemoryError" in errors["hog"].error
        assert errors["crash"].cause == "exited" and "code 7" in errors["crash"].error
        assert errors["raise"].cause == "raised" and "the tool broke" in errors["raise"].error
        assert "malformed" in errors and "step's messages[0]" in errors["malformed"].error
        # the culprits alone failed: whoever shared a replaced process was replayed there
        assert set(errors) == {"hang", "hog", "crash", "raise", "malformed"}
        assert pool.replayed >= 1
        assert log["fine"][-1].done and log["fine"][-1].reward == 3.0
        assert [r.op for r in log["fine"]] == ["reset", "step", "step", "step"]
        assert sum(pool.failures.values()) == len(errors)
        assert pool.failures["timeout"] == 1 and pool.failures["exited"] == 1
        assert took < 10
        # the pool still serves: a fresh trajectory on the replaced processes
        again = _run(pool, {"after": ["ok"]}, {"after": 1})
        assert again["after"][-1].reward == 1.0


def test_a_class_that_cannot_serve_stops_at_once(env_module):
    with pytest.raises(SandboxError, match="env.function 'user_envs:NoStep'.*step"):
        EnvironmentPool(f"{env_module}:NoStep", workers=1)
    with pytest.raises(SandboxError, match="env.function 'user_envs:Missing'"):
        EnvironmentPool(f"{env_module}:Missing", workers=1)


def test_a_trajectory_on_a_replaced_process_is_replayed_to_its_state(env_module):
    """One process, two trajectories: b kills it after a's first turn; a's reset and first
    step are sent again to the new process, so its count goes on from 1 (a fresh instance
    would end at 2, not 3, turns)."""
    with EnvironmentPool(f"{env_module}:Counter", workers=1) as pool:
        log = _run(pool, {"a": ["ok", "ok", "ok"], "b": ["ok", "crash"]}, {"a": 3, "b": 3})
        assert log["b"][-1].cause == "exited"
        assert log["a"][-1].error is None and log["a"][-1].reward == 3.0
        assert [r.op for r in log["a"]] == ["reset", "step", "step", "step"]  # replies once
        assert pool.replayed == 1 and dict(pool.failures) == {"exited": 1}
