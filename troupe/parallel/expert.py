"""Expert parallelism applied to a built model, as torchtitan's ``parallelize`` functions do:
models are constructed whole and without process groups; this keeps one rank's experts."""

from __future__ import annotations

import torch
from torch import nn

from troupe.collectives import Communicator
from troupe.models.moe import MoE
from troupe.models.moe.experts import Experts


def apply_expert_parallel(model: nn.Module, group: Communicator | None) -> nn.Module:
    """Make every MoE layer of ``model`` hold only group rank r's contiguous slice of its
    experts (experts r*n .. (r+1)*n - 1, n = num_experts / group size) and exchange tokens
    with the other ranks over ``group``; dense weights are untouched. In place; returns
    ``model``. A group of one (or None) leaves the model as it is.

    The slice keeps the whole layer's values, so an expert-parallel model built this way from
    a seeded (or loaded) model is the same model, split.
    """
    if group is None or group.world_size == 1:
        return model
    P, r = group.world_size, group.rank
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        if moe.group is not None:
            raise ValueError(f"{name}: the MoE layer is already expert-parallel")
        if moe.num_experts % P:
            raise ValueError(f"{name}: {moe.num_experts} experts do not split over "
                             f"expert-parallel size {P}")
        n = moe.num_experts // P
        moe.experts = _slice(moe.experts, r * n, n)
        moe.num_local, moe.group = n, group
    return model


def _slice(whole: Experts, first: int, n: int) -> Experts:
    """Experts ``first`` .. ``first + n - 1`` of ``whole`` as a module of their own."""
    with torch.device(whole.w1.device):
        part = Experts(n, whole.first + first, whole.w1.shape[1], whole.d_ff, whole.mlp,
                       whole.bias).to(whole.w1.dtype)
    with torch.no_grad():
        for mine, theirs in zip(part.parameters(), whole.parameters()):
            mine.copy_(theirs[first:first + n])
            mine.requires_grad_(theirs.requires_grad)
    return part
