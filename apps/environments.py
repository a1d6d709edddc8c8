"""Environments for multi-turn RL, `env.function=apps.environments:NAME` (run from the
repository root, or put your own module on PYTHONPATH). troupe constructs the class in its
sandboxed environment processes (troupe.rlhf.agents.environments), one instance per trajectory:
``reset(row)`` returns the opening messages, ``step(messages, assistant)`` the messages that
follow the model's turn, a reward (or None) and whether the trajectory is over. ``row`` is the
data row: its prompt and other fields.

Standard library only, as apps/rewards.py: every environment process imports this module.

- ``Calculator``: multi-digit arithmetic the model should not do in its head. It may call the
  ``calculator`` tool (``CALCULATOR_TOOL``, rendered by the chat template) with an expression;
  the result comes back as a tool message. Its final answer (a turn without a tool call) is
  rewarded 1 when its last number is the row's ``answer``, else 0. ``problems(n, seed)``
  makes rows.
- ``PythonTests``: the model writes a Python function; its code runs on the row's unit tests in
  a child process (time- and memory-limited); reward = the share of tests passed. A failing
  attempt gets the test output back and may try again (``attempts``).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
import subprocess
import sys

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly (integers; + - * / // % **).",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string",
                                                     "description": "e.g. 4821 * 37"}},
                       "required": ["expression"]},
    },
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.Div: operator.truediv}


def evaluate(expression: str):
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses
    (nothing else is evaluated: no names, calls or attributes); ValueError says what is not
    allowed. Powers and results are bounded (exponent at most 64, 4096 bits), and so is the
    text (200 characters)."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or isinstance(left, int) and
                                                 left.bit_length() * abs(right) > 4096):
                raise ValueError("a power too large")
            out = _OPS[type(node.op)](left, right)
            if isinstance(out, int) and out.bit_length() > 4096:
                raise ValueError("a result larger than 4096 bits")
            return out
        raise ValueError(f"{type(node).__name__} is not allowed in an expression")

    result = value(tree.body)
    return int(result) if isinstance(result, float) and result.is_integer() else result


def problems(n: int, seed: int = 0, digits: tuple[int, int] = (3, 4)) -> list[dict]:
    """``n`` rows of multi-digit arithmetic: {"prompt": question, "answer": "<integer>"}."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randrange(10 ** (digits[0] - 1), 10 ** digits[0])
        b = rng.randrange(10 ** (digits[1] - 1), 10 ** digits[1])
        op = rng.choice(["+", "-", "*"])
        rows.append({"prompt": f"What is {a} {op} {b}?", "answer": str(evaluate(f"{a} {op} {b}"))})
    return rows


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d[\d,]*", text or "")
    return found[-1].replace(",", "") if found else None


SYSTEM = "Use the calculator tool for arithmetic, then give the result."


def opening(question: str, system: str | None = SYSTEM) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}]


def demonstrations(rows: list[dict], system: str | None = SYSTEM) -> list[dict]:
    """SFT rows showing the tool in use, two per problem (single-turn demonstrations of each
    of the assistant's turns): the call, and the answer once the result is in. Each keeps the
    problem's ``question`` and ``answer`` (what ``Calculator.reset`` reads)."""
    out = []
    for row in rows:
        q, a = row["prompt"], row["answer"]
        expression = q.removeprefix("What is ").removesuffix("?")
        args = json.dumps({"expression": expression})
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calculator", "arguments": args}}
        wrong = str(int(a) + 10 ** (len(a.lstrip("-")) - 1))  # a plausible mistake
        fields = {"question": q, "answer": a}
        out.append({"prompt": opening(q, system),
                    "chosen": f'<tool_call>\n{{"name": "calculator", "arguments": {args}}}\n'
                              "</tool_call>",
                    "rejected": f"{expression} = {wrong}.", **fields})
        out.append({"prompt": opening(q, system) + [
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "content": a, "tool_call_id": "call_0"}],
                    "chosen": f"{expression} = {a}.", "rejected": f"{expression} = {wrong}.",
                    **fields})
    return out


class Calculator:
    """See the module's docstring. ``system``: the opening's system message (None: none).
    A row's question is its ``question`` field, else its prompt (a string)."""

    def __init__(self, system: str | None = SYSTEM):
        self.system = system

    def reset(self, row: dict) -> list[dict]:
        self.answer = str(row["answer"])
        return opening(row.get("question") or row["prompt"], self.system)

    def step(self, messages: list[dict], assistant: dict):
        calls = assistant.get("tool_calls") or []
        if not calls:  # the final answer
            return [], float(_last_number(assistant.get("content")) == self.answer), True
        out = []
        for call in calls:
            fn = call.get("function", {})
            try:
                if fn.get("name") != "calculator":
                    raise ValueError(f"no tool named {fn.get('name')!r}")
                args = json.loads(fn.get("arguments") or "{}")
                result = str(evaluate(str(args["expression"])))
            except (ValueError, KeyError, TypeError, ZeroDivisionError, OverflowError) as e:
                result = f"error: {e}"
            out.append({"role": "tool", "content": result, "tool_call_id": call.get("id")})
        return out, None, False


_HARNESS = """
import json, sys
ns = {}
source, tests = json.loads(sys.stdin.read())
try:
    exec(compile(source, "<solution>", "exec"), ns)
except BaseException as e:
    print(json.dumps({"passed": 0, "errors": [f"the code does not run: {type(e).__name__}: {e}"]}))
    sys.exit(0)
passed, errors = 0, []
for test in tests:
    try:
        exec(compile(test, "<test>", "exec"), dict(ns))
        passed += 1
    except BaseException as e:
        errors.append(f"{test.strip()}: {type(e).__name__}: {e}"[:200])
print(json.dumps({"passed": passed, "errors": errors}))
"""


class PythonTests:
    """See the module's docstring. A row: {"prompt": task, "tests": ["assert f(1) == 2", ...]}.
    ``timeout_s`` and ``memory_mb`` limit each run of the model's code (a child process of
    this one, itself already sandboxed); ``attempts``: turns the model gets."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, attempts: int = 2):
        self.timeout_s, self.memory_mb, self.attempts = timeout_s, memory_mb, attempts

    def reset(self, row: dict) -> list[dict]:
        self.tests, self.turn = list(row["tests"]), 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages: list[dict], assistant: dict):
        self.turn += 1
        passed, errors = self.run(_code(assistant.get("content") or ""))
        share = passed / max(len(self.tests), 1)
        if share == 1.0 or self.turn >= self.attempts:
            return [], share, True
        feedback = "\n".join(errors[:5])
        return [{"role": "user", "content": f"{passed} of {len(self.tests)} tests pass:\n"
                                            f"{feedback}\nFix the code."}], None, False

    def run(self, source: str) -> tuple[int, list[str]]:
        """(tests passed, what failed) for ``source``, run in a fresh interpreter."""
        limit = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({self.memory_mb << 20},) * 2)\n"
        try:
            done = subprocess.run([sys.executable, "-c", limit + _HARNESS],
                                  input=json.dumps([source, self.tests]), capture_output=True,
                                  text=True, timeout=self.timeout_s)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            return int(result["passed"]), list(result["errors"])
        except subprocess.TimeoutExpired:
            return 0, [f"the code ran past {self.timeout_s:g} s"]
        except (ValueError, IndexError, KeyError):
            return 0, ["the code crashed the interpreter"]


def _code(text: str) -> str:
    """The last fenced code block of ``text`` (```python ... ```), else all of it."""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", text, re.S)
    return blocks[-1] if blocks else text


def main() -> None:
    """``python apps/environments.py calculator DIR``: DIR/demos.jsonl (SFT demonstrations of the
    tool, on one set of problems) and DIR/problems.jsonl (other problems, for RL and its
    held-out evaluation)."""
    import argparse
    from pathlib import Path
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("task", choices=["calculator"])
    p.add_argument("out", type=Path)
    p.add_argument("--demos", type=int, default=400, help="problems shown in SFT")
    p.add_argument("--problems", type=int, default=600, help="problems for RL and evaluation")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    demos = problems(a.demos, a.seed)
    seen = {r["prompt"] for r in demos}
    fresh = [r for r in problems(a.problems * 2, a.seed + 1) if r["prompt"] not in seen]
    for name, rows in (("demos", demonstrations(demos)), ("problems", fresh[:a.problems])):
        with open(a.out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{a.out / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
