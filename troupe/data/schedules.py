"""Data-efficiency schedules: curriculum learning by sequence length, and random-LTD's number
of tokens kept in its middle layers."""

from __future__ import annotations

from pydantic import Field, model_validator

from troupe.config import Config


def _linear(step: int, start: int, end: int, total_steps: int, multiple: int) -> int:
    """From ``start`` to ``end`` over ``total_steps``, rounded down to a multiple."""
    if step >= total_steps:
        return end
    value = start + (end - start) * step / max(total_steps, 1)
    return min(max(start, int(value) // multiple * multiple), end)


class CurriculumConfig(Config):
    """Sequence-length curriculum: train on the first ``min_len`` tokens of each window, growing
    linearly (in multiples of ``step_size``) to the full length at ``total_steps``."""

    enabled: bool = False
    min_len: int = Field(default=16, ge=1)
    total_steps: int = Field(default=100, ge=1)
    step_size: int = Field(default=8, ge=1)

    def seq_len_at(self, step: int, full_len: int) -> int:
        if not self.enabled:
            return full_len
        return _linear(step, min(self.min_len, full_len), full_len, self.total_steps,
                       self.step_size)


class RandomLTDConfig(Config):
    """Random layerwise token dropping: in blocks [first_layer, last_layer), only ``keep`` random
    tokens per sequence go through each block, ``keep`` growing from ``min_tokens`` to the full
    length over ``total_steps`` (in multiples of ``step_size``). Evaluation uses every token."""

    enabled: bool = False
    first_layer: int = Field(default=1, ge=0)
    last_layer: int = Field(default=-1)
    min_tokens: int = Field(default=32, ge=1)
    total_steps: int = Field(default=100, ge=1)
    step_size: int = Field(default=8, ge=1)

    @model_validator(mode="after")
    def _order(self) -> "RandomLTDConfig":
        if self.last_layer >= 0 and self.last_layer <= self.first_layer:
            raise ValueError(f"last_layer={self.last_layer} must exceed first_layer="
                             f"{self.first_layer} (or be negative, counting from the end)")
        return self

    def layers(self, n_layer: int) -> range:
        last = self.last_layer if self.last_layer >= 0 else n_layer + self.last_layer
        return range(self.first_layer, max(self.first_layer, last))

    def keep_at(self, step: int, seq_len: int) -> int:
        if not self.enabled:
            return seq_len
        return _linear(step, min(self.min_tokens, seq_len), seq_len, self.total_steps,
                       self.step_size)
