"""Dynamic loss scaling for fp16 mixed precision (precision=fp16).

fp16 keeps 5 exponent bits: gradients below 6e-8 flush to zero. The loss is multiplied by a
large scale before the backward, so the gradients sit in fp16's range, and the fp32 gradients
are divided by it before the optimizer. A scale too large overflows: then the step is skipped
on every data-parallel rank (they agree through one allreduce of an overflow flag, or their
weights would part) and the scale halves; after ``growth_interval`` clean steps in a row it
doubles. This is the scheme of Micikevicius et al. 2018 and torch.amp.GradScaler; troupe's
gradients live in flat fp32 buffers (FlatParams), so unscaling and the finiteness test are one
pass over each buffer.
"""

from __future__ import annotations

from typing import Sequence

import torch

from troupe.collectives import Communicator
from troupe.optim.flat import FlatParams


class LossScaler:
    """``scale(loss)`` before the backward; ``unscale_(flats, group)`` before the optimizer,
    which says whether to step; the scale adapts itself."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000,
                 backoff: float = 0.5, growth: float = 2.0, min_scale: float = 1.0):
        self.scale_value, self.growth_interval = float(init_scale), growth_interval
        self.backoff, self.growth, self.min_scale = backoff, growth, min_scale
        self.good_steps = 0    # clean steps since the scale last changed
        self.skipped = 0       # steps skipped for overflow, since the start

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, flats: list[FlatParams],
                 group: Communicator | None | Sequence[Communicator | None]) -> bool:
        """Divide the gradients by the scale; True when every rank's are finite (then step),
        False when some rank overflowed (the caller skips the step, the scale has backed off).
        The ranks agree over ``group``, or over several groups that together span them (data
        and tensor parallelism's: a max over one, then over the other, is over the grid)."""
        bad = None
        for flat in flats:
            if flat.grad.numel():
                flat.grad.mul_(1.0 / self.scale_value)
                b = (~torch.isfinite(flat.grad)).any()
                bad = b if bad is None else bad | b
        flag = (bad if bad is not None else torch.zeros((), dtype=torch.bool,
                                                        device=flats[0].device)).float()
        for g in (group if isinstance(group, (list, tuple)) else [group]):
            if g is not None and g.world_size > 1:
                flag = g.all_reduce(flag.reshape(1), op="max")
        overflow = bool(flag.item())
        self._update(overflow)
        return not overflow

    def _update(self, overflow: bool) -> None:
        if overflow:
            self.scale_value = max(self.scale_value * self.backoff, self.min_scale)
            self.good_steps, self.skipped = 0, self.skipped + 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale_value *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])
