"""ZeRO-3's partitions: a unit's parameters that reduce over one group, flat in one fp32 buffer
padded to a multiple of the group's size W, of which rank r keeps elements [r*n/W, (r+1)*n/W)
(``Partition``); and every unit's partition over one group, this rank's shards concatenated,
as the optimizer steps them (``PartitionedBucket``); which parameters make each unit and
their partitions (``unit_parameters``, ``lay_out``), a unit and its state (``Unit``,
``UnitState``), what the gathered units may hold at once (``transient_bytes``, ``kept_bytes``),
and a unit built on the meta device given storage (``materialize``). troupe.parallel.zero3
schedules when a partition is gathered, freed and its gradient reduced;
troupe.parallel.reshard loads a bucket saved by another number of ranks."""

from __future__ import annotations

import enum
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from troupe.collectives import Communicator
from troupe.optim import CommCounter, padded_size, segment_ids
from troupe.parallel.reshard import load_resharded


#: elements of each rank's part reduce-scattered at a time: a whole embedding's gradient at
#: once costs its size again in temporaries (the wire copy, the received parts)
REDUCE_CHUNK = 1 << 22


class Partition:
    """The parameters ``params`` of one unit that reduce over ``group``, flat and split 1/W.
    ``shard``: this rank's [lo, hi) of the padded buffer, a view into its bucket's master
    tensor; ``full``: the whole buffer, storage empty unless gathered."""

    def __init__(self, params: list[nn.Parameter], group: Communicator | None,
                 device: torch.device):
        self.params, self.group = params, group
        self.W = group.world_size if group is not None else 1
        self.rank = group.rank if group is not None else 0
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]  # in the flat buffer
        self.padded = padded_size(self.numels, self.W)
        self.size = self.padded // self.W
        self.lo = self.rank * self.size
        self.device = device
        self.full = torch.empty(0, device=device)    # made by ``build``
        self.shard: torch.Tensor | None = None        # set by the bucket (adopt)
        self.grad_shard: torch.Tensor | None = None

    def build(self) -> None:
        """The full buffer, holding the parameters' values (they must have storage), each
        parameter a view into it from here on."""
        self.full = torch.zeros(self.padded, device=self.device)
        for p, offset, n in zip(self.params, self.offsets, self.numels):
            self.full[offset:offset + n].copy_(p.data.reshape(-1))
        self._point_params()

    def _point_params(self) -> None:
        """Each parameter a view into ``full``."""
        for p, offset, n in zip(self.params, self.offsets, self.numels):
            p.data = self.full[offset:offset + n].view(p.shape)

    def adopt(self, shard: torch.Tensor, grad_shard: torch.Tensor) -> None:
        """Keep this rank's part of the full buffer in ``shard`` (the bucket's), then free it."""
        shard.copy_(self.full[self.lo:self.lo + self.size])
        self.shard, self.grad_shard = shard, grad_shard
        self.free()

    def free(self) -> None:
        if not self.full.untyped_storage().resizable():
            # a numpy view was taken (a checkpoint writer): that storage stays with it, the
            # parameters move to a buffer of their own
            self.full = torch.empty(self.padded, device=self.full.device)
            self._point_params()
        self.full.untyped_storage().resize_(0)

    def allocate(self) -> None:
        """Storage for the full buffer (its values come from ``gather``)."""
        nbytes = self.padded * self.full.element_size()
        if self.full.untyped_storage().nbytes() != nbytes:
            self.full.untyped_storage().resize_(nbytes)

    def gather(self, comm: CommCounter) -> None:
        """Fill the (allocated) full buffer from every rank's shard."""
        out = self.full.view(self.W, self.size)
        if self.group is None or self.W == 1:
            out[0].copy_(self.shard)
        else:
            self.group.all_gather(self.shard, out=out)
            comm.all_gather(self.size * 4, self.W)

    def expect_grads(self) -> None:
        """Before the unit's backward: no gradient may be left from one already reduced."""
        if any(p.grad is not None for p in self.params):
            raise RuntimeError("a gradient arrived after its unit's gradients were reduced: "
                               "run each forward's backward before the next forward")

    def take_grads(self) -> list[torch.Tensor | None]:
        """The parameters' gradients (None where a parameter got none, e.g. an expert that
        received no tokens), the parameters no longer holding them. Autograd made them
        (no buffer is preallocated: its own gradient tensors are kept, not copied)."""
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return grads

    def reduce(self, grads: list[torch.Tensor | None], scale: float, dtype: torch.dtype,
               comm: CommCounter) -> None:
        """Add this rank's part of the group's mean of the flat gradient (times ``scale``)
        into the gradient shard, a chunk at a time; the arithmetic of ZeRO-1's
        reduce-scatter (troupe.optim.sharded)."""
        if self.group is None or self.W == 1:
            for g, start, n in zip(grads, self.offsets, self.numels):
                if g is not None:
                    self.grad_shard[start:start + n].add_(g.reshape(-1), alpha=scale)
            return
        for lo in range(0, self.size, REDUCE_CHUNK):  # temporaries of a chunk, not a unit
            C = min(REDUCE_CHUNK, self.size - lo)
            wire = torch.zeros(self.W, C, dtype=dtype, device=self.device)  # padding: 0
            for r in range(self.W):
                self._copy_range(grads, r * self.size + lo, wire[r])
            part = self.group.reduce_scatter(wire.reshape(-1), op="mean").float()
            comm.reduce_scatter(wire.numel() * wire.element_size(), self.W)
            self.grad_shard[lo:lo + C].add_(part, alpha=scale)

    def _copy_range(self, grads: list[torch.Tensor | None], start: int,
                    out: torch.Tensor) -> None:
        """Elements [start, start + len(out)) of the flat gradient into ``out`` (left as it
        is where a parameter has no gradient or the range runs into padding)."""
        stop = start + len(out)
        for g, offset, n in zip(grads, self.offsets, self.numels):
            a, b = max(start, offset), min(stop, offset + n)
            if g is not None and a < b:
                out[a - start:b - start].copy_(g.reshape(-1)[a - offset:b - offset])


class PartitionedBucket:
    """Every unit's partition over one group, this rank's shards concatenated in unit order:
    the master weights ``data`` and the gradient shard ``grad`` the optimizer steps.
    ``grad_scale`` multiplies the group's mean (for experts, the expert-data-parallel size
    over the whole world, as in ZeRO-1). ``slice``: which expert-parallel slice this rank's
    experts are (0 for dense), so that a checkpoint can be matched across layouts."""

    def __init__(self, name: str, group: Communicator | None, grad_scale: float,
                 partitions: list[Partition], device: torch.device, slice_index: int = 0):
        self.name, self.group, self.grad_scale = name, group, grad_scale
        self.partitions, self.device, self.slice = partitions, device, slice_index
        self.W = group.world_size if group is not None else 1
        self.rank = group.rank if group is not None else 0
        total = sum(p.size for p in partitions)
        self.data = torch.zeros(total, device=device)
        self.grad = torch.zeros(total, device=device)
        self.offsets: list[int] = []
        offset = 0
        for part in partitions:
            self.offsets.append(offset)
            offset += part.size

    def adopt(self, index: int) -> None:
        part, offset = self.partitions[index], self.offsets[index]
        part.adopt(self.data[offset:offset + part.size], self.grad[offset:offset + part.size])

    def segments(self) -> tuple[torch.Tensor, int]:
        """For each element of ``data``: the index of its tensor among ``params`` (their count
        for padding), and that count plus one (LAMB's per-tensor norms)."""
        ids, first = [], 0
        count = sum(len(part.params) for part in self.partitions)
        for part in self.partitions:
            local = segment_ids(part.numels, part.padded, part.lo, part.lo + part.size)
            ids.append(torch.where(local == len(part.numels), count, local + first))
            first += len(part.numels)
        return torch.cat(ids).to(self.device), count + 1

    def layout(self) -> list[list[int]]:
        """[numel, padded] of each partition: with the group's size, where every element of
        ``data`` sits in the model (``load_state_dict`` checks it)."""
        return [[p.numel, p.padded] for p in self.partitions]

    def zero_grad(self) -> None:
        self.grad.zero_()

    def state_dict(self, optimizer) -> dict:
        """This rank's master weights and optimizer state (live tensors, for a checkpoint that
        writes them at once), with what a load needs to place every element on another
        number of ranks."""
        return {"world": self.W, "rank": self.rank, "slice": self.slice,
                "layout": self.layout(), "params": self.data,
                "optimizer": optimizer.state_dict(copy=False)}

    def load_state_dict(self, optimizer, read: Callable[[int], dict], old_world: int,
                        where: str) -> None:
        """Load from a checkpoint written by ``old_world`` ranks of this bucket's group (any
        number: troupe.parallel.reshard cuts the shards again); ``read(k)`` gives the bucket's
        state saved by group rank k."""
        load_resharded(self, optimizer, read, old_world, where)


def unit_parameters(model: nn.Module, blocks=None) -> list[list[nn.Parameter]]:
    """The parameters of each unit, in the order partitions flatten them: the root
    (everything outside ``blocks``, by default ``model.blocks``) first, then block by block."""
    blocks = list(model.blocks if blocks is None else blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [[p for p in model.parameters() if id(p) not in in_blocks]]
    return units + [list(b.parameters()) for b in blocks]


def transient_bytes(largest_block: int, root: int, prefetch: int) -> int:
    """The bound on what a rank holds gathered at once, from the full bytes of the largest
    block and of the root: the block computing, the next ``prefetch`` and one block's
    gradient, plus the root's weights and gradient."""
    return largest_block * (prefetch + 2) + 2 * root


def lay_out(unit_params: list[list[nn.Parameter]], dp: Communicator | None,
            edp: Communicator | None, device: torch.device
            ) -> tuple[list[Partition], list[Partition], list[list[tuple[str, int]]]]:
    """Each unit's parameters cut into a dense partition over ``dp`` and an expert one over
    ``edp`` (where it has them), from their shapes alone: the dense partitions, the expert
    ones, and for each unit its (bucket, index of its partition there)."""
    dense_parts: list[Partition] = []
    expert_parts: list[Partition] = []
    where: list[list[tuple[str, int]]] = []
    for params in unit_params:
        dense = [p for p in params if not getattr(p, "expert", False)]
        expert = [p for p in params if getattr(p, "expert", False)]
        mine = []
        for kind, ps, group, parts in (("dense", dense, dp, dense_parts),
                                       ("expert", expert, edp, expert_parts)):
            if ps:
                mine.append((kind, len(parts)))
                parts.append(Partition(ps, group, device))
        where.append(mine)
    return dense_parts, expert_parts, where


def kept_bytes(blocks: list[int], root: int) -> int:
    """The bound on what a stage-2 rank holds gathered at once, from the full bytes of each
    block and of the root: every unit's weights, two blocks' gradients (one being reduced,
    one waiting for it: the backward waits then) and the root's weights and gradient."""
    return sum(blocks) + 2 * max(blocks, default=0) + 2 * root


def materialize(params: list[nn.Parameter], names: dict[int, str],
                init: Callable[[set[str]], None] | None) -> None:
    """Parameters on the meta device given storage and their values, ``init`` naming them
    (one unit at a time, so that the whole model never exists on one rank)."""
    meta = [p for p in params if p.is_meta]
    if not meta:
        return
    if init is None:
        raise ValueError("the model is on the meta device: Zero3 needs init(names) to "
                         "initialise each unit's parameters")
    for p in meta:  # the same Parameter objects (and attributes), now with storage
        real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                            requires_grad=p.requires_grad)
        real.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, real)
    init({names[id(p)] for p in meta})

def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers left on the meta device (rotary frequencies) get storage on the device and
    their values from the model's ``reset_buffers``."""
    meta = False
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
                meta = True
    if meta and hasattr(model, "reset_buffers"):
        model.reset_buffers()


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def comm_thread() -> ThreadPoolExecutor:
    """The one thread that runs every partitioned model's collectives in this process, in
    the order they were issued: two models on one group (a critic and the reward model in
    the same worker) can never interleave their operations differently on two ranks."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(1, thread_name_prefix="zero3")
        return _POOL


class UnitState(enum.Enum):
    """Where a unit is in its life, the one field the hooks read and write: SHARDED (only this
    rank's shards, the full buffers without storage) -> GATHERING (an all-gather in flight,
    ``Unit.gather`` its future) -> GATHERED (whole: for a forward, ``gathered()``, the root
    between forwards) -> BACKWARD when the gradient of its output arrives (whole while its
    backward runs, its gradients to be reduce-scattered; the root's from its first forward
    with gradients until ``release``) -> GATHERED once they are handed to the reduce-scatter
    -> SHARDED when freed. A forward pre-hook that finds its unit in BACKWARD is activation
    checkpointing's recomputation, which the hooks leave alone."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
    BACKWARD = "backward"


@dataclass(eq=False)  # compared by identity (the schedule's lists look units up)
class Unit:
    """A block, or the root, with one partition per bucket it has parameters in."""

    index: int                               # position among the blocks; -1: the root
    modules: list[nn.Module]
    partitions: list[tuple[PartitionedBucket, int]]  # (bucket, index of the partition in it)
    state: UnitState = UnitState.SHARDED
    gather: Future | None = field(default=None, repr=False)  # while GATHERING

    def parts(self) -> Iterator[Partition]:
        for bucket, i in self.partitions:
            yield bucket.partitions[i]

    @property
    def trainable(self) -> bool:
        return any(p.requires_grad for part in self.parts() for p in part.params)

    def nbytes(self) -> int:
        return sum(p.padded * 4 for p in self.parts())


class BackwardDone(torch.autograd.Function):
    """The identity on ``tensors``; its backward, run once the gradients of all of them are
    complete, calls ``done`` (a block's inputs: its backward is over). ``anchor``, a tensor
    that requires a gradient (or None), makes the outputs require one when no input does."""

    @staticmethod
    def forward(ctx, done: Callable[[], None], anchor, *tensors):
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, None, *grads)


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors of a module's output: itself, or those of a tuple or list."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []
