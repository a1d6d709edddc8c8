"""Collectives that autograd can differentiate.

``all_to_all``: the backward pass is the all_to_all with the input and output splits swapped.
Tensor parallelism's (troupe.parallel.tensor), each pair the other's transpose: ``copy_in``
(identity; gradients all-reduced) and ``reduce_out`` (all-reduced; gradient passed through);
``split_rows`` (this rank's share of the rows; gradients gathered) and ``gather_rows``
(every rank's rows; this rank's share of the gradient).

``all_to_all(..., int8=True)`` carries each row (a token's activations; in backward, its
gradient) as int8 with a scale of its own: absmax / 127, sent as 4 bytes after the row's M
bytes, so a row of M fp32 values costs M + 4 bytes instead of 4M (0.27x at M = 64, 0.25x as
M grows). A value is rounded to the nearest step, an error of at most absmax / 254 (rounding
the gradients stochastically instead, unbiased but noisier, did worse on moe-tiny:
benchmarks/RESULTS.md). The rows a rank sends to itself never leave it and stay exact. A
``Meter`` counts the bytes a rank sent to the others."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from troupe.collectives.base import Communicator, even_splits


@dataclass
class Meter:
    """Bytes this rank's all_to_alls sent to the other ranks, forward and backward."""

    bytes: int = 0

    def add(self, group: Communicator, input_splits: list[int], row_bytes: int) -> None:
        self.bytes += (sum(input_splits) - input_splits[group.rank]) * row_bytes


def pack_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """(R, M) floats as (R, M + 4) bytes: each row's int8 values, then its fp32 scale."""
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-30)
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1)


def unpack_int8_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``pack_int8_rows``'s inverse (up to the rounding): (R, M) of ``dtype``."""
    q = packed[:, :-4].contiguous().view(torch.int8)
    scale = packed[:, -4:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return (q.float() * scale).to(dtype)


def _exchange(x: torch.Tensor, group: Communicator, output_splits: list[int],
              input_splits: list[int], int8: bool, meter: Meter | None) -> torch.Tensor:
    if not int8:
        if meter is not None:
            meter.add(group, input_splits, x[:1].numel() * x.element_size())
        return group.all_to_all(x, output_splits, input_splits)
    width = math.prod(x.shape[1:])  # a rank may send no rows at all
    packed = pack_int8_rows(x.reshape(x.shape[0], width))
    if meter is not None:
        meter.add(group, input_splits, packed.shape[1])
    got = group.all_to_all(packed, output_splits, input_splits)
    out = unpack_int8_rows(got, x.dtype).view(got.shape[0], *x.shape[1:])
    r = group.rank  # this rank's rows to itself, as they were
    src, dst = sum(input_splits[:r]), sum(output_splits[:r])
    out[dst:dst + input_splits[r]] = x[src:src + input_splits[r]]
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Communicator, output_splits: list[int],
                input_splits: list[int], int8: bool, meter: Meter | None) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        ctx.int8, ctx.meter = int8, meter
        return _exchange(x, group, output_splits, input_splits, int8, meter)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = _exchange(grad.contiguous(), ctx.group, ctx.input_splits, ctx.output_splits,
                           ctx.int8, ctx.meter)
        return grad_x, None, None, None, None, None


def all_to_all(x: torch.Tensor, group: Communicator, output_splits: Sequence[int] | None = None,
               input_splits: Sequence[int] | None = None, int8: bool = False,
               meter: Meter | None = None) -> torch.Tensor:
    """Differentiable all_to_all along dim 0 (see Communicator.all_to_all for the splits);
    ``int8``: every row carried as int8 with its own scale, both ways (see the module's
    docstring); ``meter`` counts the bytes sent."""
    if input_splits is None and output_splits is None:
        input_splits = output_splits = even_splits(x.shape[0], group.world_size)
    elif output_splits is None:
        output_splits = group.exchange_splits(list(input_splits))
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits), int8, meter)


class _Copy(torch.autograd.Function):
    """Identity forward; gradients summed over the group backward (a column-parallel input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Communicator) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.all_reduce(grad.contiguous().clone()), None


class _Reduce(torch.autograd.Function):
    """Summed over the group forward (a row-parallel output); the gradient passes through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Communicator) -> torch.Tensor:
        return group.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _rows(n: int, group: Communicator) -> tuple[int, int, int]:
    """This rank's rows [lo, hi) of n split in chunks of ceil(n / T), and the chunk."""
    chunk = -(-n // group.world_size)
    lo = min(group.rank * chunk, n)
    return lo, min(lo + chunk, n), chunk


def _gather_rows(x: torch.Tensor, group: Communicator, n: int) -> torch.Tensor:
    """Every rank's rows (dim 0, each padded to the chunk) laid end to end: the n rows."""
    chunk = -(-n // group.world_size)
    if x.shape[0] < chunk:
        x = torch.cat([x, x.new_zeros(chunk - x.shape[0], *x.shape[1:])])
    return group.all_gather(x.contiguous()).reshape(-1, *x.shape[1:])[:n]


class _Split(torch.autograd.Function):
    """This rank's rows forward; every rank's gradient rows gathered backward (TED's tokens)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Communicator) -> torch.Tensor:
        ctx.group, ctx.n = group, x.shape[0]
        lo, hi, _ = _rows(x.shape[0], group)
        return x[lo:hi].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_rows(grad, ctx.group, ctx.n), None


class _Gather(torch.autograd.Function):
    """Every rank's rows gathered forward; this rank's gradient rows backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Communicator, n: int) -> torch.Tensor:
        ctx.group, ctx.n = group, n
        return _gather_rows(x, group, n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo, hi, _ = _rows(ctx.n, ctx.group)
        return grad[lo:hi], None, None


def copy_in(x: torch.Tensor, group: Communicator) -> torch.Tensor:
    """``x`` as it is, its gradient all-reduced over ``group`` (a column-parallel layer's input,
    or a replicated weight each rank uses for part of the work)."""
    return _Copy.apply(x, group)


def reduce_out(x: torch.Tensor, group: Communicator) -> torch.Tensor:
    """``x`` summed over ``group`` (a row-parallel layer's partial products)."""
    return _Reduce.apply(x, group)


def split_rows(x: torch.Tensor, group: Communicator) -> torch.Tensor:
    """This rank's contiguous share of ``x``'s rows (chunks of ceil(n / T); the last ones may
    be short or empty); ``gather_rows`` is its inverse."""
    return _Split.apply(x, group)


def gather_rows(x: torch.Tensor, group: Communicator, n: int) -> torch.Tensor:
    """The n rows that ``split_rows`` shared out, from every rank's share."""
    return _Gather.apply(x, group, n)


def gather_vocab(logits: torch.Tensor, group: Communicator, vocab: int) -> torch.Tensor:
    """Whole logits (..., vocab) from each rank's vocabulary shard (..., Vp / T), for
    sampling; no gradient."""
    parts = group.all_gather(logits.detach().contiguous())  # (T, ..., Vp / T)
    return torch.cat(list(parts.unbind(0)), dim=-1)[..., :vocab]
