"""What a training rank will hold, planned from the model's shapes before anything is
allocated, and the per-worker memory budget it is checked against (``memory_per_worker``).

A GPU has a fixed amount of memory; a CPU worker has what the machine gives it. The budget
makes the second behave like the first: a run whose plan exceeds it is refused at once, with
both figures, instead of swapping or being killed halfway. Activations are not planned (they
follow the batch and sequence length, and activation checkpointing); the plan is the part
that follows the model and the ZeRO stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from troupe.config import ConfigError
from troupe.optim import OptimizerConfig, padded_size
from troupe.parallel.partition import kept_bytes, transient_bytes, unit_parameters

GIB = 1 << 30


class MemoryBudgetError(ConfigError):
    """A rank's planned bytes exceed ``memory_per_worker``; the message has both figures (a
    recipe's error: the apps plan it before Ray starts and refuse it in one line)."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one rank keeps between steps (parameters, gradients, optimizer state) and, for
    zero_stage 2 and 3, the transient peak of the blocks gathered while the model runs."""

    zero_stage: int
    params: int
    grads: int
    optimizer: int
    gathered: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered

    def bytes(self) -> dict[str, int]:
        """The plan's figures, for a metrics record."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "gathered": self.gathered}

    def describe(self) -> str:
        parts = [f"parameters {size(self.params)}", f"gradients {size(self.grads)}",
                 f"optimizer state {size(self.optimizer)}"]
        if self.gathered:
            parts.append(f"gathered blocks {size(self.gathered)}")
        return f"{size(self.total)} ({', '.join(parts)})"


def size(nbytes: int) -> str:
    """Bytes for a person: GiB down to a tenth of one, MiB below."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):.1f} MiB"


def plan(model: nn.Module, cfg: OptimizerConfig, world: int, zero_stage: int = 1,
         prefetch: int = 1, ep_size: int = 1, offload: bool = False,
         blocks: nn.ModuleList | None = None, tp: int = 1) -> MemoryPlan:
    """The plan of one of ``world`` data-parallel ranks training ``model`` (built whole,
    e.g. on the meta device: only shapes are read; tensor-parallel, one rank's shards)
    with ``cfg`` at ``zero_stage`` (3: ``prefetch`` blocks gathered ahead; 2: every block
    kept gathered through the step); experts are split
    over ``ep_size`` ranks and their state over the ranks that hold the same ones, world /
    ep_size of each of the ``tp`` tensor-parallel ranks. ``blocks``: the model's decoder
    blocks (default ``model.blocks``), the units of stages 2 and 3."""
    units = unit_parameters(model, blocks)
    edp = world * tp // ep_size
    dense = [[p.numel() for p in u if not getattr(p, "expert", False)] for u in units]
    expert = [[p.numel() // ep_size for p in u if getattr(p, "expert", False)] for u in units]
    if zero_stage in (2, 3):
        shards = [padded_size(d, world) // world for d in dense if d]
        shards += [padded_size(e, edp) // edp for e in expert if e]
        n = sum(shards)
        full = [4 * (padded_size(d, world) if d else 0) + 4 * (padded_size(e, edp) if e else 0)
                for d, e in zip(dense, expert)]
        gathered = (transient_bytes(max(full[1:], default=0), full[0], prefetch)
                    if zero_stage == 3 else kept_bytes(full[1:], full[0]))
        return MemoryPlan(zero_stage, 4 * n, 4 * n, 8 * n, gathered)
    P_dense, P_expert = sum(map(sum, dense)), sum(map(sum, expert))
    local = P_dense + P_expert
    if offload:
        state = 8 * padded_size([P_expert], edp) // edp if P_expert else 0
    elif cfg.sharded:  # ZeRO-1: m and v of 1/W
        state = 8 * (padded_size([P_dense], world) // world
                     + (padded_size([P_expert], edp) // edp if P_expert else 0))
    else:  # the 1-bit family: momentum and error feedback whole, variance whole or 1/W
        variance = 4 * local // world if cfg.shard_state else 4 * local
        state = 8 * local + variance
    return MemoryPlan(1, 4 * local, 4 * local, state)


def device_budget_gib(device: torch.device, memory_per_worker: float | None) -> float | None:
    """The budget in GiB: ``memory_per_worker`` when set, else on CUDA the device's memory,
    else none (a CPU worker takes what the machine gives)."""
    if memory_per_worker is not None:
        return memory_per_worker
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    return None


def check_budget(planned: MemoryPlan, budget_gib: float | None, who: str,
                 alternative: MemoryPlan | None = None) -> None:
    """MemoryBudgetError when ``planned`` exceeds ``budget_gib`` (None: no budget), in one
    line naming ``who`` (a rank, a role), both figures and, when given, what the other ZeRO
    stage would plan."""
    if budget_gib is None or planned.total <= budget_gib * GIB:
        return
    hint = ""
    if alternative is not None and alternative.zero_stage != planned.zero_stage:
        fits = "fits" if alternative.total <= budget_gib * GIB else "does not fit either"
        hint = (f"; zero_stage {alternative.zero_stage} would plan "
                f"{size(alternative.total)} ({fits})")
    raise MemoryBudgetError(f"{who}: zero_stage {planned.zero_stage} plans "
                            f"{planned.describe()} a worker, over memory_per_worker="
                            f"{budget_gib:g} GiB{hint}")
