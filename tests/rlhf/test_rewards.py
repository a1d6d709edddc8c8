"""Reward functions in their process pool: values, fields, per-sample failures (a raise, a hang,
a non-number, a dead process) that are counted and do not stop the batch, and a function that
cannot be imported stopping before any work; chat-message rows with fields."""

import os
import textwrap
import time

import psutil
import pytest

from apps.rewards import sort_digits
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.datasets import SortTask, prompt_text, read_jsonl
from troupe.rlhf.pipeline.rewards import RewardFunction
from troupe.rlhf.sandbox.pool import SandboxError

MODULE = """
import os, subprocess, sys, time

def length(prompt, response, bonus=0, **fields):
    print("a print goes to stderr, not into the protocol")
    return len(response) + bonus

def moody(prompt, response, **fields):
    if response == "raise":
        raise ValueError("boom")
    if response == "hang":
        time.sleep(60)
    if response == "text":
        return "0.5"
    if response == "nan":
        return float("nan")
    if response == "bool":
        return True
    if response == "exit":
        os._exit(3)
    return 1.0


def forks(prompt, response, **fields):
    if os.fork() == 0:  # the copy returns too, later, with another score
        time.sleep(0.3)
        return 100.0
    return float(len(response))


def spawns(prompt, response, **fields):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.environ["SPAWNED"], "a") as f:
        f.write(f"{child.pid}\\n")
    if response == "hang":
        time.sleep(120)
    return 1.0


def hog(prompt, response, **fields):
    return float(len(bytearray(3 << 30)))


def long_error(prompt, response, **fields):
    raise ValueError("x" * (100 << 20))


def stray(prompt, response, **fields):
    if response == "stray":
        os.write(3, b"this is not JSON\\n")  # the protocol's pipe (stdout is stderr here)
    return 1.0
"""


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return "user_rewards"


def test_values_and_fields(rewards_module):
    with RewardFunction(f"{rewards_module}:length", workers=2) as fn:
        got = fn(["p"] * 3, ["ab", "abcd", ""], [{"bonus": 10}, {}, {"bonus": 1}])
    assert got.values == [12.0, 4.0, 1.0] and got.failures == []


def test_failures_are_per_sample_and_counted(rewards_module):
    responses = ["ok", "raise", "hang", "text", "nan", "bool", "exit", "ok"]
    with RewardFunction(f"{rewards_module}:moody", timeout_s=1.0, workers=2,
                        failure_score=-1.0) as fn:
        t0 = time.monotonic()
        got = fn(["p"] * len(responses), responses)
        took = time.monotonic() - t0
        assert got.values == [1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0]
        why = dict(got.failures)
        assert "ValueError: boom" in why[1] and "user_rewards.py" in why[1]
        assert "no result within 1 s" in why[2]
        assert "'0.5' (str), not a number" in why[3]
        assert "nan, not a finite number" in why[4]
        assert "(bool), not a number" in why[5]
        assert "exited (code 3)" in why[6]
        assert took < 10  # the hang cost its time limit, not 60 s
        # the pool replaced its hung and dead processes and goes on
        again = fn(["p", "p"], ["ok", "ok"])
        assert again.values == [1.0, 1.0] and fn.failures == 6


@pytest.mark.parametrize("spec, message", [
    ("no_such_module:f", "No module named 'no_such_module'"),
    ("user_rewards:nope", "has no attribute 'nope'"),
    ("os:sep", "not a function"),
])
def test_unusable_function_fails_at_start(rewards_module, spec, message):
    with pytest.raises(SandboxError, match=message):
        RewardFunction(spec)


def test_recipe_checks_the_function_spec():
    with pytest.raises(ValueError, match="module:function"):
        RLHFConfig(reward={"function": "no_colon"})
    with pytest.raises(ValueError, match="no reward"):
        RLHFConfig(algorithm="grpo", reward={"model_coef": 0})
    cfg = RLHFConfig(algorithm="grpo", reward={"function": "m:f"})
    assert not cfg.uses_reward_model() and not cfg.uses_critic() and cfg.kl_in_loss()
    assert RLHFConfig(algorithm="rloo", reward={"function": "m:f", "model_coef": 0.5}
                      ).uses_reward_model()


def test_chat_rows_with_fields(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        '{"prompt": [{"role": "system", "content": "Be brief."}, '
        '{"role": "user", "content": "sort 321"}], "ground_truth": "123"}\n'
        '{"prompt": "sort 54", "chosen": "45", "rejected": "54", "level": 2}\n')
    rows = read_jsonl(path)
    assert rows[0].prompt[1] == {"role": "user", "content": "sort 321"}
    assert rows[0].fields == {"ground_truth": "123"} and rows[0].chosen is None
    assert rows[1].fields == {"level": 2} and rows[1].chosen == "45"
    assert prompt_text(rows[0].prompt) == "sort 321"
    assert sort_digits(rows[0].prompt, " 123\n") == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: field prompt"):
        read_jsonl(bad)
    bad.write_text('{"prompt": "x", "chosen": "y"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: fields chosen and rejected"):
        read_jsonl(bad)


def test_bundled_reward_function_is_the_task_gold():
    import random
    task, rng = SortTask(template="Sort these digits: {digits}"), random.Random(0)
    for _ in range(300):
        p = task.prompt(rng)
        r = task.answer(p) if rng.random() < 0.3 else task.corrupt(task.answer(p), rng)
        assert sort_digits([{"role": "user", "content": p}], r) == task.gold(p, r)


def test_parquet_rows_read_as_json_lines(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    rows = [{"prompt": [{"role": "user", "content": "sort 21"}], "ground_truth": "12"},
            {"prompt": [{"role": "user", "content": "sort 3"}], "ground_truth": "3"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    got = read_jsonl(tmp_path / "rows.parquet")
    assert [(e.prompt, e.fields) for e in got] == [(r["prompt"], {"ground_truth": r["ground_truth"]})
                                                    for r in rows]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_function_that_forks_cannot_answer_for_another_sample(rewards_module):
    with RewardFunction(f"{rewards_module}:forks", timeout_s=5.0, workers=2) as fn:
        got = fn(["p"] * 6, ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"])
        time.sleep(0.5)  # the copies have woken up by now
        again = fn(["p"] * 2, ["gg", "h"])
    assert got.values == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and got.failures == []
    assert again.values == [2.0, 1.0] and again.failures == []


def test_what_a_function_starts_dies_with_it_on_timeout_and_close(rewards_module, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("SPAWNED", str(tmp_path / "spawned"))
    with RewardFunction(f"{rewards_module}:spawns", timeout_s=1.0, workers=1) as fn:
        got = fn(["p", "p"], ["hang", "ok"])
        assert got.values == [0.0, 1.0] and "no result within 1 s" in got.failures[0][1]
        hung, returned = [int(x) for x in (tmp_path / "spawned").read_text().split()]
        time.sleep(0.2)
        assert not _alive(hung)  # killed with the timed-out process's group
        assert _alive(returned)  # the process that returned still lives: so does its child
    time.sleep(0.2)
    assert not _alive(returned)  # close killed the group


def test_memory_is_limited(rewards_module):
    with RewardFunction(f"{rewards_module}:hog", workers=1, memory_mb=1024) as fn:
        got = fn(["p"], ["x"])
    assert got.values == [0.0] and "raised MemoryError" in got.failures[0][1]


def test_a_huge_error_text_comes_back_cut_and_in_time(rewards_module):
    with RewardFunction(f"{rewards_module}:long_error", timeout_s=5.0, workers=1) as fn:
        t0 = time.monotonic()
        got = fn(["p"], ["x"])
        took = time.monotonic() - t0
    [(i, why)] = got.failures
    assert i == 0 and "ValueError: xxx" in why and len(why) <= 1000 and took < 5


def test_a_stray_line_on_the_reply_pipe_fails_its_sample_only(rewards_module):
    with RewardFunction(f"{rewards_module}:stray", workers=1, failure_score=-1.0) as fn:
        got = fn(["p"] * 3, ["ok", "stray", "ok"])
    assert got.values == [1.0, -1.0, 1.0]
    assert "protocol breach" in got.failures[0][1] and "not JSON" in got.failures[0][1]
