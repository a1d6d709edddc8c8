"""How a worker method's arguments go out to a role's ranks and how its results come back.

A role class declares it on the method, and the driver calls the method by reference:

    class PolicyActor:
        @dispatch(Dispatch.SHARD)
        def generate(self, request: RolloutRequest) -> Rollout: ...

        @dispatch(Dispatch.RANK0)
        def tokenizer_name(self) -> str: ...

    rollouts = graph["policy"].invoke(PolicyActor.generate, request)  # one Rollout per rank
    graph["policy"].invoke(PolicyActor.tokenizer_name)               # rank 0's result

ALL (the default for an undeclared method): every rank gets the same arguments; the results
come back as a list in rank order. SHARD: the first argument is split into one slice per rank
(``split``), the other arguments go to every rank as they are; results in rank order. RANK0:
only rank 0 runs the call, and its result alone comes back. In every mode an argument wrapped
as ``PerRank(items)`` gives item r to rank r.

A role split by tensor parallelism (``tensor_parallel`` T: ranks dT..dT+T-1 hold one model
between them, data-parallel rank d) is called by data-parallel rank: SHARD splits the batch
into one slice per data-parallel rank, which its T ranks all receive, and the results come
back one per data-parallel rank (its first rank's: the others computed the same); a
``PerRank`` of one item per data-parallel rank gives item d to its T ranks. ALL and RANK0 are
as above, over every rank.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(enum.Enum):
    ALL = "all"
    SHARD = "shard"
    RANK0 = "rank0"


def dispatch(mode: Dispatch) -> Callable[[F], F]:
    """Declare how the decorated worker method is dispatched (see the module doc)."""
    if not isinstance(mode, Dispatch):
        raise TypeError(f"dispatch: mode must be a Dispatch, got {mode!r}")

    def mark(fn: F) -> F:
        fn.__troupe_dispatch__ = mode  # type: ignore[attr-defined]
        return fn
    return mark


def mode_of(method: Callable[..., Any]) -> Dispatch:
    """The dispatch mode declared on ``method`` (ALL when it declares none)."""
    return getattr(method, "__troupe_dispatch__", Dispatch.ALL)


@dataclass(frozen=True)
class PerRank:
    """Arguments already split by the caller: ``items[r]`` goes to rank r."""

    items: list[Any]


def split(batch: Any, n: int) -> list[Any]:
    """Split a batch into ``n`` contiguous, near-even slices along its first dimension.

    A batch is a tensor, a list/tuple, a dict of those (all of the same length), or an object
    with a ``split(n)`` method (the dataclasses that cross between driver and workers).
    """
    if hasattr(batch, "split") and not isinstance(batch, (str, torch.Tensor)):
        return list(batch.split(n))
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(n, dim=0))
    if isinstance(batch, (list, tuple)):
        return [batch[lo:hi] for lo, hi in even_bounds(len(batch), n)]
    if isinstance(batch, dict):
        lengths = {k: len(v) for k, v in batch.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"cannot split a dict batch whose entries differ in length: {lengths}")
        parts = {k: split(v, n) for k, v in batch.items()}
        return [{k: parts[k][r] for k in batch} for r in range(n)]
    raise ValueError(f"cannot split a batch of type {type(batch).__name__}; use a tensor, a "
                     "list/tuple, a dict of them, or an object with a split(n) method")


def even_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """[lo, hi) of ``n`` contiguous parts of ``length`` items, the first ones one longer."""
    base, extra = divmod(length, n)
    bounds, lo = [], 0
    for r in range(n):
        hi = lo + base + (r < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def per_rank_args(mode: Dispatch, args: tuple, kwargs: dict, world_size: int,
                  tensor_parallel: int = 1) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) each rank receives under ``mode`` (``tensor_parallel``: consecutive
    ranks that hold one model, see the module doc)."""
    T = tensor_parallel
    dp = world_size // T

    def pick(value: Any, r: int) -> Any:
        if isinstance(value, PerRank):
            if len(value.items) == world_size:
                return value.items[r]
            if len(value.items) == dp:
                return value.items[r // T]
            per_dp = f" or {dp} data-parallel ranks" if T > 1 else ""
            raise ValueError(f"PerRank holds {len(value.items)} items for {world_size} "
                             f"ranks{per_dp}")
        return value

    args = list(args)
    if mode is Dispatch.SHARD:
        if not args:
            raise ValueError("a SHARD method takes the batch to split as its first argument")
        if not isinstance(args[0], PerRank):
            args[0] = PerRank(split(args[0], dp))
    ranks = [0] if mode is Dispatch.RANK0 else range(world_size)
    return [(tuple(pick(a, r) for a in args), {k: pick(v, r) for k, v in kwargs.items()})
            for r in ranks]


def results_of(mode: Dispatch, results: list[Any], tensor_parallel: int = 1) -> list[Any]:
    """What a call under ``mode`` gives back from every rank's ``results`` (in rank order):
    one per data-parallel rank for SHARD (its first rank's), all of them otherwise."""
    if mode is Dispatch.SHARD and tensor_parallel > 1:
        return results[::tensor_parallel]
    return results
