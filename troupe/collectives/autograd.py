"""all_to_all that autograd can differentiate: the backward pass is the all_to_all with the
input and output splits swapped."""

from __future__ import annotations

from typing import Sequence

import torch

from troupe.collectives.base import Communicator, even_splits


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Communicator, output_splits: list[int],
                input_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return group.all_to_all(x, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = ctx.group.all_to_all(grad.contiguous(), ctx.input_splits, ctx.output_splits)
        return grad_x, None, None, None


def all_to_all(x: torch.Tensor, group: Communicator, output_splits: Sequence[int] | None = None,
               input_splits: Sequence[int] | None = None) -> torch.Tensor:
    """Differentiable all_to_all along dim 0 (see Communicator.all_to_all for the splits)."""
    if input_splits is None and output_splits is None:
        input_splits = output_splits = even_splits(x.shape[0], group.world_size)
    elif output_splits is None:
        output_splits = group.exchange_splits(list(input_splits))
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))
