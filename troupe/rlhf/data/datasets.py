"""RLHF data: JSON-lines rows and the bundled task, generated at run time, whose gold reward is
computed by a program that the learned reward model never sees.

Rows come as JSON lines, or as a parquet file with the same columns (with pyarrow installed).
A row's prompt is a string or a list of chat messages ({"role", "content"}), rendered through
the model's chat template. chosen and rejected (DeepSpeed-Chat's format) are optional: rows
with them feed SFT, the reward model and DPO; every row's prompt feeds the online algorithms.
The row's other fields (e.g. ground_truth) are passed to a reward function as keywords."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Callable

from troupe.data.corpus import jsonl_objects, parquet_rows
from troupe.errors import DataError
from troupe.rlhf.config import STEP3, RLHFConfig

Prompt = str | list[dict[str, str]]  # a task's text, or chat messages


@dataclass(frozen=True)
class Example:
    """One prompt, optionally with a preferred and a dispreferred response, and the row's
    other fields."""

    prompt: Prompt
    chosen: str | None = None
    rejected: str | None = None
    fields: dict = dataclass_field(default_factory=dict)


def _check_prompt(prompt, where: str) -> Prompt:
    """A prompt: text, or chat messages with string roles and contents; an assistant message
    may instead carry ``tool_calls`` (content null), as a multi-turn demonstration's earlier
    turns do, and a tool message its ``tool_call_id``."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(map(_message, prompt)):
        return [{k: m[k] for k in ("role", "content", "tool_calls", "tool_call_id") if k in m}
                for m in prompt]
    raise DataError(f"{where}: field prompt must be a string or a non-empty list of "
                     '{"role": ..., "content": ...} messages')


def _message(m) -> bool:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
        return False
    if isinstance(m.get("content"), str):
        return True
    calls = m.get("tool_calls")
    return m["role"] == "assistant" and m.get("content") is None and isinstance(calls, list) \
        and bool(calls) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                for c in calls)


def read_jsonl(path: str | Path) -> list[Example]:
    """Examples from a JSON-lines file, or a parquet file with the same columns (see the
    module's docstring); a bad row raises ValueError naming the file, row and field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"RLHF data file {path} does not exist")
    out = []
    rows = parquet_rows(path) if path.suffix == ".parquet" else jsonl_objects(path)
    for i, row in rows:
        if "prompt" not in row:
            raise DataError(f"{path}:{i}: field prompt missing")
        prompt = _check_prompt(row["prompt"], f"{path}:{i}")
        pair = [row.get(k) for k in ("chosen", "rejected")]
        if pair != [None, None] and not all(isinstance(v, str) for v in pair):
            raise DataError(f"{path}:{i}: fields chosen and rejected must both be strings "
                             "(or both absent)")
        fields = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
        out.append(Example(prompt, pair[0], pair[1], fields))
    if not out:
        raise DataError(f"{path}: no examples")
    return out


def write_jsonl(path: str | Path, examples: list[Example]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": e.prompt, **({"chosen": e.chosen, "rejected": e.rejected}
                                    if e.chosen is not None else {}), **e.fields}
            for e in examples]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompt_text(prompt: Prompt) -> str:
    """The text of a prompt: itself, or its last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"),
                prompt[-1]["content"])


class SortTask:
    """"sort 7391:" -> "1379": sort a few digits. The gold reward of a response is 1 for the
    exact answer, else the fraction of positions that match it, minus a length penalty.
    ``template`` phrases the prompt (for chat models, e.g. "Sort these digits: {digits}");
    the digits are the only ones in it.

    Demonstrations for SFT are noisy (``noise`` of them carry one mistake), so the SFT policy
    inherits mistakes that the reward model and PPO can remove. Preference pairs put the exact
    answer (or the better of two flawed ones) first.
    """

    def __init__(self, min_digits: int = 3, max_digits: int = 5, noise: float = 0.5,
                 template: str = "sort {digits}:"):
        self.min_digits, self.max_digits, self.noise = min_digits, max_digits, noise
        self.template = template

    def prompt(self, rng: random.Random) -> str:
        n = rng.randint(self.min_digits, self.max_digits)
        return self.template.format(digits="".join(rng.choice("0123456789") for _ in range(n)))

    @staticmethod
    def answer(prompt: str) -> str:
        return "".join(sorted(c for c in prompt if c.isdigit()))

    def gold(self, prompt: str, response: str) -> float:
        want = self.answer(prompt)
        if response == want:
            return 1.0
        hits = sum(a == b for a, b in zip(response, want))
        return hits / max(len(want), len(response)) - 0.25

    def corrupt(self, answer: str, rng: random.Random) -> str:
        """One mistake: swap two neighbours that differ, change a digit, drop or add one."""
        s = list(answer)
        kind = rng.choice(["swap", "change", "drop", "add"])
        i = rng.randrange(len(s))
        swappable = [k for k in range(len(s) - 1) if s[k] != s[k + 1]]
        if kind == "swap" and swappable:
            j = rng.choice(swappable)
            s[j], s[j + 1] = s[j + 1], s[j]
        elif kind == "drop" and len(s) > 1:
            del s[i]
        elif kind == "add":
            s.insert(i, rng.choice("0123456789"))
        else:
            s[i] = rng.choice([d for d in "0123456789" if d != s[i]])
        out = "".join(s)
        return out if out != answer else self.corrupt(answer, rng)

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            p = self.prompt(rng)
            a = self.answer(p)
            out.append((p, self.corrupt(a, rng) if rng.random() < self.noise else a))
        return out

    def preferences(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            p = self.prompt(rng)
            a = self.answer(p)
            x, y = self.corrupt(a, rng), self.corrupt(a, rng)
            if rng.random() < 0.7 or self.gold(p, x) == self.gold(p, y):
                out.append(Example(p, a, x))
            else:
                hi, lo = (x, y) if self.gold(p, x) > self.gold(p, y) else (y, x)
                out.append(Example(p, hi, lo))
        return out

    def prompts(self, n: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        return [self.prompt(rng) for _ in range(n)]


@dataclass
class Data:
    """Everything the three steps read: demonstrations, preference pairs (train and held
    out), prompts for step 3 and for evaluation (with each row's fields for a reward
    function), and the task's gold reward when it has one."""

    sft: list[tuple[Prompt, str]]
    pairs: list[tuple[Prompt, str, str]]
    eval_pairs: list[tuple[Prompt, str, str]]
    prompts: list[Prompt]
    eval_prompts: list[Prompt]
    gold: Callable[[Prompt, str], float] | None
    fields: list[dict] | None = None       # per prompt (None: no fields)
    eval_fields: list[dict] | None = None


def check_sizes(cfg: RLHFConfig, data: Data, steps: tuple[str, ...]) -> None:
    """DataError naming the setting and the file when a step's batch asks for more distinct
    examples than the data holds (batches are drawn without repeats)."""
    need = []
    if "sft" in steps:
        need.append(("sft.batch_size", cfg.sft.batch_size, len(data.sft), "demonstrations"))
    if "reward" in steps and cfg.uses_reward_model():
        need.append(("reward.batch_size", cfg.reward.batch_size, len(data.pairs), "pairs"))
    if STEP3 in steps and not cfg.algo().online:
        need.append(("dpo.batch_size", cfg.dpo.batch_size, len(data.pairs), "pairs"))
    elif STEP3 in steps:
        need.append(("step3.prompts_per_iter", cfg.step3.prompts_per_iter, len(data.prompts),
                     "prompts"))
    for key, want, have, what in need:
        if want > have:
            raise DataError(f"{key}={want}, but {cfg.data.path or 'the task'} holds {have} "
                            f"training {what} (after data.eval_fraction): lower {key} or give "
                            "more rows")


def prepare_data(cfg: RLHFConfig) -> Data:
    """The bundled task (generated from the seed) or the JSON-lines file of ``data.path``."""
    if cfg.data.path:
        rows = read_jsonl(cfg.data.path)
        n_eval = max(1, int(len(rows) * cfg.data.eval_fraction))
        if len(rows) <= n_eval:
            raise DataError(f"{cfg.data.path}: {len(rows)} rows leave none for training after "
                             f"holding out data.eval_fraction={cfg.data.eval_fraction}")
        train, held = rows[:-n_eval], rows[-n_eval:]
        paired, held_paired = [e for e in train if e.chosen], [e for e in held if e.chosen]
        return Data([(e.prompt, e.chosen) for e in paired],
                    [(e.prompt, e.chosen, e.rejected) for e in paired],
                    [(e.prompt, e.chosen, e.rejected) for e in held_paired],
                    [e.prompt for e in train], [e.prompt for e in held], None,
                    [e.fields for e in train], [e.fields for e in held])
    t, s = cfg.task, cfg.seed
    task = SortTask(t.min_digits, t.max_digits, t.noise, t.template)
    pairs = [(e.prompt, e.chosen, e.rejected) for e in task.preferences(
        t.preference_examples + t.eval_examples, s + 2)]
    return Data(task.demonstrations(t.sft_examples, s + 1), pairs[:-t.eval_examples],
                pairs[-t.eval_examples:], task.prompts(20000, s + 3),
                task.prompts(t.eval_examples, s + 4), task.gold)
