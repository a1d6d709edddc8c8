"""The bundled environments (apps/environments.py): the calculator's safe evaluator, its tool
results and exact-answer reward; the Python-tests environment's share of passed tests, its
feedback turn, and a solution that hangs or allocates without bound scored 0 within its limits."""

import json
import time

import pytest

from apps.environments import Calculator, PythonTests, evaluate, problems


def test_evaluate_takes_arithmetic_only():
    assert evaluate("4821 * 37") == 178377 and evaluate("(3 + 4) * 2 - 10 / 4") == 11.5
    assert evaluate("-2 ** 3") == -8 and evaluate("7 // 2 + 7 % 2") == 4
    for bad in ("__import__('os')", "x + 1", "(1).real", "2 ** 100000", "9 ** 64 ** 64",
                "1 +", "'a' * 3"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_calculator_turns_and_reward():
    row = problems(1, seed=3)[0]
    env = Calculator()
    opening = env.reset(row)
    assert opening[-1] == {"role": "user", "content": row["prompt"]}
    expression = row["prompt"].removeprefix("What is ").removesuffix("?")
    call = {"id": "c1", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
    out, reward, done = env.step(opening, {"role": "assistant", "content": None,
                                           "tool_calls": [call]})
    assert out == [{"role": "tool", "content": row["answer"], "tool_call_id": "c1"}]
    assert reward is None and not done
    bad = {**call, "function": {"name": "search", "arguments": "{}"}}
    out, _, _ = env.step(opening, {"role": "assistant", "content": None, "tool_calls": [bad]})
    assert out[0]["content"].startswith("error: no tool named 'search'")
    assert env.step(opening, {"role": "assistant", "content": f"It is {row['answer']}."}) \
        == ([], 1.0, True)
    assert env.step(opening, {"role": "assistant", "content": "It is 12."})[1] == 0.0


def test_python_tests_reward_feedback_and_limits():
    env = PythonTests(timeout_s=2.0, memory_mb=256, attempts=2)
    row = {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
    env.reset(row)
    out, reward, done = env.step([], {"role": "assistant", "content": "def add(a, b):\n    return a * b"})
    assert reward is None and not done and "1 of 2 tests pass" in out[0]["content"]
    assert env.step([], {"role": "assistant",
                         "content": "Here:\n```python\ndef add(a, b):\n    return a + b\n```"}) \
        == ([], 1.0, True)
    t0 = time.monotonic()
    assert env.run("while True:\n    pass") == (0, ["the code ran past 2 s"])
    passed, errors = env.run("x = bytearray(1 << 30)")
    assert passed == 0 and "MemoryError" in errors[0]
    assert time.monotonic() - t0 < 10
