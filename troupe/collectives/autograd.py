"""Collectives that autograd can differentiate.

``all_to_all``: the backward pass is the all_to_all with the input and output splits swapped.
Tensor parallelism's (troupe.parallel.tensor), each pair the other's transpose: ``copy_in``
(identity; gradients all-reduced) and ``reduce_out`` (all-reduced; gradient passed through);
``split_rows`` (this rank's share of the rows; gradients gathered) and ``gather_rows``
(every rank's rows; this rank's share of the gradient).

``all_to_all(..., bits=8)`` carries each row (a token's activations; in backward, its
gradient) as integers with a scale of its own, absmax / (2^(bits-1) - 1), sent as 4 bytes
after the row's values. A value is rounded to the nearest step, an error of at most half a
step. 8 bits: one int8 a value, M + 4 bytes for a row of M fp32 values instead of 4M (0.27x at
M = 64, 0.25x as M grows). 9 bits: the value plus 255 (0..510), its low 8 bits a byte and the
9th bits packed eight to a byte after them, M + M/8 + 4 bytes (0.30x at M = 64, 0.29x at 128,
0.28x as M grows), each step half as wide as int8's. On moe-tiny over seven seeds int8
cost 6.3% of the validation loss on average, 9 bits 1.4%, bf16 rounding -1.0%; with a
top-2 dropless gate int8's median was +0.4% but single seeds still moved by up to 13%
(benchmarks/RESULTS.md). Rounding the gradients stochastically instead, unbiased but
noisier, did worse. The rows a rank sends to itself never leave it and stay exact. A
``Meter`` counts the bytes a rank sent to the others."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from troupe.collectives.base import Communicator, even_splits
from troupe.kernels.lowbit import pack_sign_rows, unpack_sign_rows


@dataclass
class Meter:
    """Bytes this rank's all_to_alls sent to the other ranks, forward and backward."""

    bytes: int = 0

    def add(self, group: Communicator, input_splits: list[int], row_bytes: int) -> None:
        self.bytes += (sum(input_splits) - input_splits[group.rank]) * row_bytes


def _steps(bits: int) -> int:
    if bits not in (8, 9):
        raise ValueError(f"a row's values go as 8 or 9 bits, not {bits}")
    return 2 ** (bits - 1) - 1


def pack_rows(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """(R, M) floats as (R, row_bytes(M, bits)) bytes: each row's values as ``bits``-bit
    integers (the module's docstring), then its fp32 scale."""
    n = _steps(bits)
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / n).clamp_min(1e-30)
    q = torch.round(x / scale).clamp_(-n, n)
    if bits == 8:
        values = q.to(torch.int8).view(torch.uint8)
    else:
        u = (q + n).to(torch.int32)  # 0..510: the 9th bit packed as a sign, set for 1
        values = torch.cat([(u & 255).to(torch.uint8),
                            pack_sign_rows(((u >> 8) * 2 - 1).to(torch.int8))], dim=1)
    return torch.cat([values, scale.view(torch.uint8)], dim=1)


def unpack_rows(packed: torch.Tensor, width: int, bits: int = 8,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``pack_rows``'s inverse (up to the rounding): (R, width) of ``dtype``."""
    n = _steps(bits)
    scale = packed[:, -4:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    if bits == 8:
        q = packed[:, :width].contiguous().view(torch.int8).float()
    else:
        high = unpack_sign_rows(packed[:, width:-4], width) > 0
        q = packed[:, :width].float() + 256 * high.float() - n
    return (q * scale).to(dtype)


def row_bytes(width: int, bits: int) -> int:
    """Bytes ``pack_rows`` makes of a row of ``width`` values."""
    return width + (-(-width // 8) if bits == 9 else 0) + 4


def _exchange(x: torch.Tensor, group: Communicator, output_splits: list[int],
              input_splits: list[int], bits: int | None, meter: Meter | None) -> torch.Tensor:
    if bits is None:
        if meter is not None:
            meter.add(group, input_splits, x[:1].numel() * x.element_size())
        return group.all_to_all(x, output_splits, input_splits)
    width = math.prod(x.shape[1:])  # a rank may send no rows at all
    packed = pack_rows(x.reshape(x.shape[0], width), bits)
    if meter is not None:
        meter.add(group, input_splits, packed.shape[1])
    got = group.all_to_all(packed, output_splits, input_splits)
    out = unpack_rows(got, width, bits, x.dtype).view(got.shape[0], *x.shape[1:])
    r = group.rank  # this rank's rows to itself, as they were
    src, dst = sum(input_splits[:r]), sum(output_splits[:r])
    out[dst:dst + input_splits[r]] = x[src:src + input_splits[r]]
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Communicator, output_splits: list[int],
                input_splits: list[int], bits: int | None, meter: Meter | None) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        ctx.bits, ctx.meter = bits, meter
        return _exchange(x, group, output_splits, input_splits, bits, meter)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = _exchange(grad.contiguous(), ctx.group, ctx.input_splits, ctx.output_splits,
                           ctx.bits, ctx.meter)
        return grad_x, None, None, None, None, None


def all_to_all(x: torch.Tensor, group: Communicator, output_splits: Sequence[int] | None = None,
               input_splits: Sequence[int] | None = None, bits: int | None = None,
               meter: Meter | None = None) -> torch.Tensor:
    """Differentiable all_to_all along dim 0 (see Communicator.all_to_all for the splits);
    ``bits`` (8 or 9): every row carried as integers of that many bits with its own scale,
    both ways (see the module's docstring); ``meter`` counts the bytes sent."""
    if input_splits is None and output_splits is None:
        input_splits = output_splits = even_splits(x.shape[0], group.world_size)
    elif output_splits is None:
        output_splits = group.exchange_splits(list(input_splits))
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits), bits, meter)


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
