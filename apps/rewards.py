"""Reward functions for `reward.function=apps.rewards:NAME` (run from the repository root, or
put your own module on PYTHONPATH). troupe calls fn(prompt, response, **fields) in separate
processes, each call time-limited (reward.timeout_s); prompt is the row's text or its chat
messages, fields are the row's other columns (e.g. ground_truth). Return a number.

Standard library only: each of the reward processes imports this module, and a light module
keeps them light (importing torch would cost each one a few hundred MB)."""

from __future__ import annotations


def _text(prompt) -> str:
    """A prompt's text: itself, or its last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"),
                prompt[-1]["content"])


def sort_digits(prompt, response: str, **fields) -> float:
    """The bundled sorting task's gold reward (troupe.rlhf.data.datasets.SortTask.gold): 1 for the
    prompt's digits in ascending order, else the share of positions that match minus 0.25.
    The answer is ``fields["ground_truth"]`` when the row has one."""
    want = fields.get("ground_truth") or "".join(sorted(c for c in _text(prompt) if c.isdigit()))
    got = response.strip()
    if got == want:
        return 1.0
    return sum(a == b for a, b in zip(got, want)) / max(len(want), len(got)) - 0.25


def exact_match(prompt, response: str, ground_truth: str, **fields) -> float:
    """1 when the response, stripped, is the row's ground_truth, else 0."""
    return float(response.strip() == str(ground_truth).strip())


def sorted_exactly(prompt, response: str, **fields) -> float:
    """A binary version of ``sort_digits``: 1 for the exactly sorted answer, else 0 (DAPO's
    dynamic sampling then drops the groups whose samples are all right or all wrong)."""
    return float(sort_digits(prompt, response, **fields) == 1.0)
