"""RLHF data: DeepSpeed-Chat's JSON-lines format (prompt, chosen, rejected) and the bundled
task, generated at run time, whose gold reward is computed by a program that the learned
reward model never sees."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from troupe.data.corpus import jsonl_objects
from troupe.rlhf.config import RLHFConfig

FIELDS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Example:
    """One prompt with a preferred and a dispreferred response."""

    prompt: str
    chosen: str
    rejected: str


def read_jsonl(path: str | Path) -> list[Example]:
    """Examples from a JSON-lines file with string fields prompt, chosen and rejected; a bad
    line raises ValueError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"RLHF data file {path} does not exist")
    out = []
    for i, row in jsonl_objects(path):
        bad = [k for k in FIELDS if not isinstance(row.get(k), str)]
        if bad:
            raise ValueError(f"{path}:{i}: field(s) {', '.join(bad)} missing or not a string")
        out.append(Example(row["prompt"], row["chosen"], row["rejected"]))
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


def write_jsonl(path: str | Path, examples: list[Example]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": e.prompt, "chosen": e.chosen,
                                        "rejected": e.rejected}) + "\n" for e in examples))
    return path


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
    out), prompts for PPO and for evaluation, and the task's gold reward when it has one."""

    sft: list[tuple[str, str]]
    pairs: list[tuple[str, str, str]]
    eval_pairs: list[tuple[str, str, str]]
    prompts: list[str]
    eval_prompts: list[str]
    gold: Callable[[str, str], float] | None


def prepare_data(cfg: RLHFConfig) -> Data:
    """The bundled task (generated from the seed) or the JSON-lines file of ``data.path``."""
    if cfg.data.path:
        rows = read_jsonl(cfg.data.path)
        n_eval = max(1, int(len(rows) * cfg.data.eval_fraction))
        train, held = rows[:-n_eval], rows[-n_eval:]
        return Data([(e.prompt, e.chosen) for e in train],
                    [(e.prompt, e.chosen, e.rejected) for e in train],
                    [(e.prompt, e.chosen, e.rejected) for e in held],
                    [e.prompt for e in train], [e.prompt for e in held], None)
    t, s = cfg.task, cfg.seed
    task = SortTask(t.min_digits, t.max_digits, t.noise, t.template)
    pairs = [(e.prompt, e.chosen, e.rejected) for e in task.preferences(
        t.preference_examples + t.eval_examples, s + 2)]
    return Data(task.demonstrations(t.sft_examples, s + 1), pairs[:-t.eval_examples],
                pairs[-t.eval_examples:], task.prompts(20000, s + 3),
                task.prompts(t.eval_examples, s + 4), task.gold)
