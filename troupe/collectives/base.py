"""The Communicator protocol that every backend implements, over torch tensors."""

from __future__ import annotations

from typing import Callable, Iterable, Literal, Protocol, Sequence, runtime_checkable

import torch

ReduceOp = Literal["sum", "mean", "max", "min", "prod"]
REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min", "prod")


@runtime_checkable
class Communicator(Protocol):
    """A group of ranks exchanging torch tensors. Collectives are called by every rank."""

    name: str
    backend: str
    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``x`` over all ranks in place; returns ``x``."""

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``x`` (dim 0 divisible by world_size) and return this rank's chunk of dim 0."""

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``x`` stacked along a new dim 0: shape (world_size, *x.shape); into
        ``out`` (contiguous, of that shape and x's dtype) when given, with no second copy."""

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``x`` in place with rank ``src``'s; returns ``x``."""

    def all_to_all(self, x: torch.Tensor, output_splits: Sequence[int] | None = None,
                   input_splits: Sequence[int] | None = None) -> torch.Tensor:
        """Send rows ``input_splits[r]`` of ``x`` (along dim 0) to rank r; receive
        ``output_splits[r]`` rows from rank r, concatenated in rank order. Even splits when both
        are None; when only ``input_splits`` is given, the output splits are exchanged first."""

    def exchange_splits(self, input_splits: Sequence[int]) -> list[int]:
        """Tell each rank r that it gets ``input_splits[r]`` rows from this one; returns the
        rows this rank gets from each rank."""

    def send(self, x: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``x`` to rank ``dst``; blocks until handed to the transport."""

    def recv(self, x: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into ``x`` from rank ``src``; returns ``x``."""

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    def destroy(self) -> None:
        """Release the group's connections."""


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")


def check_splits(x: torch.Tensor, splits: Sequence[int], world_size: int, which: str) -> list[int]:
    splits = [int(s) for s in splits]
    if len(splits) != world_size or any(s < 0 for s in splits):
        raise ValueError(f"{which} must be {world_size} non-negative ints, got {splits}")
    return splits


def even_splits(rows: int, world_size: int) -> list[int]:
    if rows % world_size:
        raise ValueError(f"dim 0 of size {rows} does not split evenly over {world_size} ranks")
    return [rows // world_size] * world_size


def reduce_in_place(x: torch.Tensor, op: str, world_size: int,
                    reduce: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """Run a backend's in-place sum/max/min/prod ``reduce`` on a contiguous copy if needed;
    'mean' is a sum divided by world_size. Returns ``x``, updated."""
    check_op(op)
    if op == "mean" and not x.is_floating_point():
        raise ValueError(f"op 'mean' needs a floating-point tensor, got {x.dtype}")
    buf = x if x.is_contiguous() else x.contiguous()
    reduce(buf)
    if op == "mean":
        buf.div_(world_size)
    if buf is not x:
        x.copy_(buf)
    return x


def resolve_splits(comm: "Communicator", x: torch.Tensor, output_splits: Sequence[int] | None,
                   input_splits: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """Validated (output_splits, input_splits) of an all_to_all along dim 0 of ``x``."""
    if input_splits is None and output_splits is None:
        even = even_splits(x.shape[0], comm.world_size)
        return even, even
    if input_splits is None:
        raise ValueError("output_splits given without input_splits")
    input_splits = check_splits(x, input_splits, comm.world_size, "input_splits")
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"input_splits {input_splits} do not sum to dim 0 = {x.shape[0]}")
    if output_splits is None:
        output_splits = comm.exchange_splits(input_splits)
    return check_splits(x, output_splits, comm.world_size, "output_splits"), input_splits


def gather_output(x: torch.Tensor, out: torch.Tensor | None, world_size: int) -> torch.Tensor:
    """The (world_size, *x.shape) buffer an all_gather of ``x`` writes: ``out`` checked, or new."""
    shape = (world_size, *x.shape)
    if out is None:
        return x.new_empty(shape)
    if tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"all_gather out: {tuple(out.shape)} {out.dtype}, needs a contiguous "
                         f"{shape} {x.dtype}")
    return out


def seconds_in_operations(groups: Iterable["Communicator | None"]) -> float:
    """The seconds ``groups`` (each counted once; None skipped) have spent in operations:
    their ``wait_s``, 0 for a communicator that keeps none."""
    unique = {id(g): g for g in groups if g is not None}
    return sum(getattr(g, "wait_s", 0.0) for g in unique.values())
