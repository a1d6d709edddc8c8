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
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Callable

import numpy as np

from troupe.data.corpus import jsonl_objects, parquet_rows
from troupe.data.rows import Rows
from troupe.data.stream import in_val, is_stream
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
        out.append(example(row, f"{path}:{i}"))
    if not out:
        raise DataError(f"{path}: no examples")
    return out


def example(row: dict, where: str) -> Example:
    """A row as an Example (see the module's docstring); DataError naming ``where`` (the file
    and row) and the field at fault."""
    if "prompt" not in row:
        raise DataError(f"{where}: field prompt missing")
    prompt = _check_prompt(row["prompt"], where)
    pair = [row.get(k) for k in ("chosen", "rejected")]
    if pair != [None, None] and not all(isinstance(v, str) for v in pair):
        raise DataError(f"{where}: fields chosen and rejected must both be strings "
                         "(or both absent)")
    fields = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
    return Example(prompt, pair[0], pair[1], fields)


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


def prepare_data(cfg: RLHFConfig, make_tokenizer: Callable | None = None) -> Data:
    """The bundled task (generated from the seed), the JSON-lines (or parquet) file of
    ``data.path``, or, when it is a directory, glob or URL of shards, its rows streamed
    (``streamed_data``: ``make_tokenizer()`` gives the roles' tokenizer, whose lengths the
    plan holds each row to)."""
    if cfg.data.path and is_stream(cfg.data.path):
        return streamed_data(cfg, make_tokenizer)
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


# --- rows streamed from shards ------------------------------------------------------------------

KINDS = ("sft", "pair", "prompt", "fields")


class RowView(Sequence):
    """Rows ``ids`` of a streamed row set (troupe.data.stream.Rows) seen as one of the Data
    lists, read when indexed: "sft" (prompt, chosen), "pair" (prompt, chosen, rejected),
    "prompt" or "fields" (the row's other fields). ``lengths``: each row's tokens as the plan
    measures this kind (None before it is measured); ``keep(mask)`` narrows the view."""

    def __init__(self, rows: Rows, ids: np.ndarray, kind: str,
                 lengths: np.ndarray | None = None):
        self.rows, self.ids, self.kind, self.lengths = rows, ids, kind, lengths

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        e = example(*self.rows[int(self.ids[i])])
        if self.kind == "sft":
            return (e.prompt, e.chosen)
        if self.kind == "pair":
            return (e.prompt, e.chosen, e.rejected)
        return e.prompt if self.kind == "prompt" else e.fields

    def split(self, n: int) -> list[list]:
        """``n`` near-even lists of the rows, read (what crosses Ray to the ranks: the
        evaluation's held-out rows, sharded over a role)."""
        from troupe.actors.dispatch import even_bounds
        return [self[lo:hi] for lo, hi in even_bounds(len(self), n)]

    def keep(self, mask: np.ndarray) -> "RowView":
        return RowView(self.rows, self.ids[mask], self.kind,
                       None if self.lengths is None else self.lengths[mask])

    def as_(self, kind: str) -> "RowView":
        """The same rows as another kind (a prompt's fields beside it)."""
        return RowView(self.rows, self.ids, kind, self.lengths)


def _measure_file(path: str, eval_fraction: float,
                  make_tokenizer: Callable | None) -> dict[str, np.ndarray]:
    """One Ray task: one shard's layout (Rows.index) and, for each of its rows, whether it is
    held out (its prompt's hash), whether it has a pair, and (with a tokenizer) the tokens
    of its prompt as the chat template renders it and of its chosen and rejected
    responses."""
    layout = Rows.index(path)
    rows = Rows([path], [layout])
    tok = make_tokenizer() if make_tokenizer else None
    n = len(rows)
    out = {k: np.zeros(n, np.int32) for k in ("prompt_len", "chosen_len", "rejected_len")}
    held, paired = np.zeros(n, bool), np.zeros(n, bool)
    for r in range(n):
        e = example(*rows[r])
        held[r] = in_val(json.dumps(e.prompt, sort_keys=True), eval_fraction)
        paired[r] = e.chosen is not None
        if tok is not None:
            out["prompt_len"][r] = len(tok.prompt(e.prompt))
            if paired[r]:
                out["chosen_len"][r] = len(tok.encode(e.chosen))
                out["rejected_len"][r] = len(tok.encode(e.rejected))
    return {"layout": layout, "held": held, "paired": paired, **out}


def streamed_data(cfg: RLHFConfig, make_tokenizer: Callable | None = None) -> Data:
    """Data whose lists are views of the rows of the shards under ``data.path``, read when a
    step draws them: one Ray task per shard checks every row (DataError naming the file and
    row), holds a row out when its prompt's hash says so (``data.eval_fraction`` of them:
    stable as shards are added) and measures its lengths with ``make_tokenizer()``'s
    tokenizer; the driver keeps 4 integers and 2 flags a row, not the rows."""
    import ray
    files = Rows.shards(cfg.data.path)
    task = ray.remote(num_cpus=1)(_measure_file)
    refs = [task.remote(f, cfg.data.eval_fraction, make_tokenizer) for f in files]
    try:
        parts = ray.get(refs)
    except ray.exceptions.RayTaskError as e:  # a bad row: its own one line
        if isinstance(e.cause, DataError):
            raise DataError(str(e.cause)) from None
        raise
    rows = Rows(files, [p.pop("layout") for p in parts])  # the files indexed once, there
    m = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    m["ids"] = np.arange(len(rows))
    if not len(m["ids"]):
        raise DataError(f"{cfg.data.path}: no rows")
    measured = make_tokenizer is not None
    sft = m["prompt_len"] + m["chosen_len"] + 1
    pair = m["prompt_len"] + np.maximum(m["chosen_len"], m["rejected_len"]) + 1

    def view(mask, kind, lengths):
        return RowView(rows, m["ids"][mask], kind, lengths[mask] if measured else None)
    train, held = ~m["held"], m["held"]
    if not train.any():
        raise DataError(f"{cfg.data.path}: {len(train)} rows leave none for training after "
                        f"holding out data.eval_fraction={cfg.data.eval_fraction}")
    prompts, eval_prompts = (view(train, "prompt", m["prompt_len"]),
                             view(held, "prompt", m["prompt_len"]))
    return Data(view(train & m["paired"], "sft", sft), view(train & m["paired"], "pair", pair),
                view(held & m["paired"], "pair", pair), prompts, eval_prompts, None,
                prompts.as_("fields"), eval_prompts.as_("fields"))
