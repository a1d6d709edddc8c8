"""ZeRO-3: a model's parameters partitioned over its data-parallel ranks, block by block, so
that no rank holds the whole model, its whole gradient or its whole optimizer state.

The model is cut into units: each block of ``model.blocks``, and the root (everything else:
embeddings, final norm, output head, a value head). A unit's parameters that reduce over one
group (the dense ones over data-parallel, experts over expert-data-parallel) form a
``Partition``: one flat fp32 buffer padded to a multiple of the group's size W, of which rank r
keeps elements [r*n/W, (r+1)*n/W) as its master weights. The parameters stay ordinary
nn.Parameters, views into the partition's full buffer, whose storage is empty (zero bytes)
while the unit is not gathered.

- Forward: before a block runs, its buffer is all-gathered (the gathers of the next
  ``prefetch`` blocks are issued at the same time, on a communication thread, so they arrive
  while this one computes); after it runs, the storage is freed, in training too: the backward
  gathers it again.
- Backward: when the gradient of a block's output arrives (before the block's own backward)
  the block is gathered again and the next one down prefetched; once the gradient of the
  block's input is complete (its backward is done) the block's gradient is reduce-scattered
  (the group's mean, in ``reduce_dtype``) and added into this rank's gradient shard, and
  both its weights and gradient are freed. So at most a few
  units' gradients exist at full size, and gradient accumulation over micro-batches adds into
  the shards (1/W of the gradient): each micro-batch gathers every block twice and
  reduce-scatters it once, the price of never holding a whole gradient.
- The root is gathered at its first use and kept, with its gradient whole, until ``release``
  (which the trainer calls before the optimizer step): a tied embedding is used at both ends
  of the model, and a step's micro-batches then gather and reduce-scatter it once.

Every rank issues the same collectives in the same order, whatever its data: gathers in the
order the blocks run, reduce-scatters from the last block down (the root's at ``release``).
An expert that received no tokens on a rank contributes a zero gradient there and its rank
still joins the reduce-scatter, so no rank waits on a collective another skipped.

The optimizer (troupe.optim.PartitionedOptimizer) steps each bucket's master shard with its
gradient shard; nothing needs gathering after the step. ``gathered()`` holds the whole model
for a stretch of calls (generation: one gather per rollout, not one per token)."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from troupe.collectives import Communicator
from troupe.optim import CommCounter, padded_size, segment_ids


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
        self.gathered = False

    def build(self) -> None:
        """The full buffer, holding the parameters' values (they must have storage), each
        parameter a view into it from here on."""
        self.full = torch.zeros(self.padded, device=self.device)
        for p, offset, n in zip(self.params, self.offsets, self.numels):
            self.full[offset:offset + n].copy_(p.data.reshape(-1))
        self._point_params()
        self.gathered = True

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
        self.gathered = False

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
        self.gathered = True

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
        number: the shards are cut again); ``read(k)`` gives the bucket's state saved by
        group rank k (of this rank's expert slice). Only the ranks whose shards overlap
        this rank's are read."""
        mine = optimizer.state_tensors()
        sources = sorted({k for part in self.partitions
                          for k in _overlapping(part, old_world)})
        covered = 0
        t = bytes_sent = None
        for k in sources:
            state = read(k)
            self._check_saved(state, k, old_world, where)
            opt = state["optimizer"]
            if set(opt["tensors"]) != set(mine):
                raise ValueError(f"{where}: bucket {self.name!r} optimizer state has "
                                 f"{sorted(opt['tensors'])}, expected {sorted(mine)}")
            t, bytes_sent = opt["t"], opt["bytes_sent"]
            old_offset = 0
            for part, offset in zip(self.partitions, self.offsets):
                old_size = padded_size(part.numels, old_world) // old_world
                a = max(k * old_size, part.lo)
                b = min((k + 1) * old_size, part.lo + part.size, part.numel)
                if a < b:
                    src = slice(old_offset + a - k * old_size, old_offset + b - k * old_size)
                    dst = slice(offset + a - part.lo, offset + b - part.lo)
                    self.data[dst].copy_(state["params"][src])
                    for name, tensor in mine.items():
                        tensor[dst].copy_(opt["tensors"][name][src])
                    covered += b - a
                old_offset += old_size
        need = sum(max(0, min(p.lo + p.size, p.numel) - p.lo) for p in self.partitions)
        if covered != need:
            raise ValueError(f"{where}: bucket {self.name!r}: the saved shards cover {covered} "
                             f"of this rank's {need} parameters")
        optimizer.load_state_dict({"t": t, "bytes_sent": bytes_sent,
                                   "tensors": mine, "extra": {}})

    def _check_saved(self, state: dict, k: int, old_world: int, where: str) -> None:
        layout = [[p.numel, padded_size(p.numels, old_world)] for p in self.partitions]
        if not isinstance(state, dict) or "layout" not in state:
            raise ValueError(f"{where}: bucket {self.name!r} of rank {k} was not written with "
                             "zero_stage 3")
        if (state["world"], state["rank"], state["slice"]) != (old_world, k, self.slice):
            raise ValueError(f"{where}: bucket {self.name!r}: expected rank {k} of "
                             f"{old_world} (slice {self.slice}), the file holds rank "
                             f"{state['rank']} of {state['world']} (slice {state['slice']})")
        if state["layout"] != layout:
            raise ValueError(f"{where}: bucket {self.name!r}: saved partitions "
                             f"{state['layout']} (numel, padded) do not match this model's "
                             f"{layout}: another model or expert layout")


def unit_parameters(model: nn.Module, blocks=None) -> list[list[nn.Parameter]]:
    """The parameters of each unit, in the order partitions flatten them: the root
    (everything outside ``blocks``, by default ``model.blocks``) first, then block by block."""
    blocks = list(model.blocks if blocks is None else blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [[p for p in model.parameters() if id(p) not in in_blocks]]
    return units + [list(b.parameters()) for b in blocks]


def assemble(shards: list[torch.Tensor], numels: list[int]) -> list[torch.Tensor]:
    """The partitions of a bucket saved by its W ranks (``shards[k]``: rank k's master
    weights), as one flat tensor per partition of ``numels`` (each partition's tensor sizes),
    padding dropped: what ``Zero3`` flattened, whole again (export)."""
    W, out, offset = len(shards), [], 0
    for sizes in numels:
        size = padded_size(sizes, W) // W
        out.append(torch.cat([s[offset:offset + size] for s in shards])[:sum(sizes)])
        offset += size
    return out


def _overlapping(part: Partition, old_world: int) -> range:
    """The ranks of ``old_world`` whose shards of ``part`` hold elements of this rank's."""
    old_size = padded_size(part.numels, old_world) // old_world
    hi = min(part.lo + part.size, part.numel)
    if hi <= part.lo:
        return range(0)
    return range(part.lo // old_size, (hi - 1) // old_size + 1)


@dataclass
class Unit:
    """A block, or the root, with one partition per bucket it has parameters in."""

    index: int                               # position among the blocks; -1: the root
    modules: list[nn.Module]
    partitions: list[tuple[PartitionedBucket, int]]  # (bucket, index of the partition in it)
    pending: Future | None = None            # a gather under way
    grads: bool = False                      # its gradients are to be reduced

    def parts(self) -> Iterator[Partition]:
        for bucket, i in self.partitions:
            yield bucket.partitions[i]

    @property
    def gathered(self) -> bool:
        return all(p.gathered for p in self.parts())

    def nbytes(self) -> int:
        return sum(p.padded * 4 for p in self.parts())


def transient_bytes(largest_block: int, root: int, prefetch: int) -> int:
    """The bound on what a rank holds gathered at once, from the full bytes of the largest
    block and of the root: the block computing, the next ``prefetch`` and one block's
    gradient, plus the root's weights and gradient."""
    return largest_block * (prefetch + 2) + 2 * root


class Zero3:
    """``model`` partitioned over ``dp`` (expert parameters over ``edp``): see the module
    docstring. ``init(names)``, for a model built on the meta device, initialises the named
    parameters once they have storage (e.g. ``GPT.init_weights(seed, only=names)``): each
    unit is materialised, initialised and partitioned in turn, so the whole model never
    exists on one rank. ``expert_scale``: the experts' grad_scale; ``expert_slice``: this
    rank's expert-parallel index. ``prefetch``: units gathered ahead of the one computing."""

    def __init__(self, model: nn.Module, dp: Communicator | None,
                 edp: Communicator | None = None, *, blocks: nn.ModuleList | None = None,
                 prefetch: int = 1,
                 reduce_dtype: torch.dtype = torch.float32,
                 init: Callable[[set[str]], None] | None = None,
                 device: torch.device | str = "cpu", expert_scale: float = 1.0,
                 expert_slice: int = 0):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.model, self.prefetch, self.reduce_dtype = model, prefetch, reduce_dtype
        self.device = torch.device(device)
        self.comm = CommCounter()
        blocks = list(model.blocks if blocks is None else blocks)
        names = {id(p): n for n, p in model.named_parameters()}
        unit_params = unit_parameters(model, blocks)
        in_blocks = {id(m) for b in blocks for m in b.modules()}
        # every module outside the blocks that owns parameters gathers the root when called
        root_modules = [m for m in model.modules() if id(m) not in in_blocks
                        and any(True for _ in m.parameters(recurse=False))]
        dense_parts: list[Partition] = []
        expert_parts: list[Partition] = []
        where: list[list[tuple[str, int]]] = []
        for params in unit_params:  # the layout first, from the shapes alone
            dense = [p for p in params if not getattr(p, "expert", False)]
            expert = [p for p in params if getattr(p, "expert", False)]
            mine = []
            for kind, ps, group, parts in (("dense", dense, dp, dense_parts),
                                           ("expert", expert, edp, expert_parts)):
                if ps:
                    mine.append((kind, len(parts)))
                    parts.append(Partition(ps, group, self.device))
            where.append(mine)
        self.buckets = {"dense": PartitionedBucket("dense", dp, 1.0, dense_parts, self.device)}
        if expert_parts:
            self.buckets["expert"] = PartitionedBucket("expert", edp, expert_scale,
                                                       expert_parts, self.device, expert_slice)
        for params, mine in zip(unit_params, where):  # then one unit whole at a time
            self._materialize(params, names, init)
            for kind, i in mine:
                self.buckets[kind].partitions[i].build()
                self.buckets[kind].adopt(i)
        units = [Unit(i - 1, root_modules if i == 0 else [blocks[i - 1]],
                      [(self.buckets[k], j) for k, j in mine]) for i, mine in enumerate(where)]
        self.root, self.units = units[0], units[1:]
        self._materialize_buffers(model)
        self._pool = _comm_thread()
        self._hold = 0                    # gathered(): nothing is freed while > 0
        self._backward: int | None = None   # the graph task whose end callback is queued
        self._pending: list[Unit] = []    # units with gradients not yet reduced
        self._handles = []
        for unit in self.units:
            block = unit.modules[0]
            self._handles.append(block.register_forward_pre_hook(self._pre_forward(unit)))
            self._handles.append(block.register_forward_hook(self._post_forward(unit)))
        for m in root_modules:
            self._handles.append(m.register_forward_pre_hook(self._root_pre_forward))

    # ---------------------------------------------------------------- construction

    @staticmethod
    def _materialize(params: list[nn.Parameter], names: dict[int, str],
                     init: Callable[[set[str]], None] | None) -> None:
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

    def _materialize_buffers(self, model: nn.Module) -> None:
        """Buffers left on the meta device (rotary frequencies) get storage on the device and
        their values from the model's ``reset_buffers``."""
        meta = False
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty_like(b, device=self.device)
                    meta = True
        if meta and hasattr(model, "reset_buffers"):
            model.reset_buffers()

    # ---------------------------------------------------------------- gathering

    def _gather_async(self, unit: Unit) -> None:
        if unit.gathered or unit.pending is not None:
            return
        for part in unit.parts():
            part.allocate()
        parts = list(unit.parts())
        unit.pending = self._pool.submit(self._run_gather, parts)

    def _run_gather(self, parts: list[Partition]) -> None:
        for part in parts:
            part.gather(self.comm)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _wait(self, unit: Unit) -> None:
        if unit.pending is not None:
            pending, unit.pending = unit.pending, None
            pending.result()

    def gather(self, unit: Unit) -> None:
        """Make ``unit``'s parameters whole (waiting for its prefetch, if one is under way)."""
        self._gather_async(unit)
        self._wait(unit)

    def _free(self, unit: Unit) -> None:
        if self._hold or unit.grads:
            return
        self._wait(unit)
        for part in unit.parts():
            part.free()

    def _prefetch(self, after: int, step: int) -> None:
        """Issue the gathers of the ``prefetch`` blocks after block ``after`` (step -1:
        before it, for the backward)."""
        for k in range(1, self.prefetch + 1):
            i = after + k * step
            if 0 <= i < len(self.units):
                self._gather_async(self.units[i])

    def _pre_forward(self, unit: Unit):
        def hook(module, args):
            self.gather(unit)
            if _in_backward():  # recomputed for activation checkpointing
                return
            self._prefetch(unit.index, 1)
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if torch.is_grad_enabled() and x is not None and x.requires_grad:
                # the gradient of the block's input is complete once its backward is done
                x.register_hook(self._post_backward(unit))
        return hook

    def _post_forward(self, unit: Unit):
        def hook(module, args, output):
            if _in_backward():  # recomputed for activation checkpointing: the backward's
                return          # own hooks gather and free
            if torch.is_grad_enabled():
                outs = [t for t in _tensors(output) if t.requires_grad]
                if outs:
                    torch.autograd.graph.register_multi_grad_hook(
                        outs, self._pre_backward(unit), mode="any")
            self._free(unit)
        return hook

    def _root_pre_forward(self, module, args) -> None:
        self.gather(self.root)
        if (torch.is_grad_enabled() and not self.root.grads and not _in_backward()
                and any(p.requires_grad for part in self.root.parts() for p in part.params)):
            self._attach(self.root)

    # ---------------------------------------------------------------- backward

    def _attach(self, unit: Unit) -> None:
        """The unit's backward is about to run: its gradients are to be reduced."""
        for part in unit.parts():
            part.expect_grads()
        unit.grads = True
        self._pending.append(unit)

    def _pre_backward(self, unit: Unit):
        def hook(grad) -> None:
            task = torch._C._current_graph_task_id()
            if self._backward != task:
                self._backward = task
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self.gather(unit)
            self._prefetch(unit.index, -1)
            if not unit.grads:
                self._attach(unit)
        return hook

    def _post_backward(self, unit: Unit):
        def hook(grad) -> None:
            if unit.grads:
                self._reduce([unit])
        return hook

    def _reduce(self, units: list[Unit]) -> None:
        """Reduce-scatter the gradients of ``units`` (highest index first, the root last: the
        order every rank follows) and free their buffers."""
        for unit in sorted(units, key=lambda u: -u.index if u.index >= 0 else 1 << 30):
            self._pending.remove(unit)
            work = []
            for bucket, i in unit.partitions:
                part = bucket.partitions[i]
                work.append((part, part.take_grads(), bucket.grad_scale))
            unit.grads = False
            self._pool.submit(self._run_reduce, work)
            if unit is not self.root:
                self._free(unit)

    def _run_reduce(self, work) -> None:
        for part, grad, scale in work:
            part.reduce(grad, scale, self.reduce_dtype, self.comm)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _end_backward(self) -> None:
        """The blocks' gradients all reduced; the root's stays whole (and its weights
        gathered) until ``release``, so that the micro-batches of one step gather it once
        and reduce-scatter it once."""
        self._backward = None
        self._reduce([u for u in self._pending if u is not self.root])
        self.synchronize()

    # ---------------------------------------------------------------- public

    def synchronize(self) -> None:
        """Wait until every collective issued so far has finished (before the optimizer
        step, or before other collectives on the same groups)."""
        self._pool.submit(lambda: None).result()

    def release(self) -> None:
        """Reduce-scatter what gradients are still whole (the root's, accumulated over a
        step's micro-batches) and free every gathered unit. Call it before the optimizer step
        (and after evaluation: the root stays gathered between forwards until this)."""
        self._reduce(list(self._pending))
        self.synchronize()
        for unit in [self.root, *self.units]:
            self._wait(unit)
            for part in unit.parts():
                part.free()

    @contextlib.contextmanager
    def gathered(self):
        """The whole model gathered for what the block encloses (generation: one gather per
        rollout, not per token); freed at the end. Not for training inside."""
        self._hold += 1
        try:
            for unit in [self.root, *self.units]:
                self._gather_async(unit)
            for unit in [self.root, *self.units]:
                self._wait(unit)
            yield self.model
        finally:
            self._hold -= 1
            if not self._hold:
                self.release()

    @contextlib.contextmanager
    def writable(self):
        """The whole model gathered for what the block encloses to write into (loading a
        checkpoint into it: every rank loads the same one); at the end each rank keeps its
        part of what was written as its master weights."""
        with self.gathered():
            yield self.model
            for bucket in self.buckets.values():
                for part in bucket.partitions:
                    part.shard.copy_(part.full[part.lo:part.lo + part.size])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (a copy), as ``model.state_dict()`` names them (every rank
        takes part; export and tests)."""
        with self.gathered():
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def zero_grad(self) -> None:
        for bucket in self.buckets.values():
            bucket.zero_grad()

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: master weights and gradient shards; and the
        bound on the gathered units (``transient_bytes``)."""
        largest = max((u.nbytes() for u in self.units), default=0)
        return {"param_bytes": sum(b.data.numel() * 4 for b in self.buckets.values()),
                "grad_bytes": sum(b.grad.numel() * 4 for b in self.buckets.values()),
                "gathered_bytes": transient_bytes(largest, self.root.nbytes(), self.prefetch)}

    def close(self) -> None:
        """Remove the hooks (the model stays partitioned: its weights are the shards')."""
        self.synchronize()
        for h in self._handles:
            h.remove()


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _comm_thread() -> ThreadPoolExecutor:
    """The one thread that runs every partitioned model's collectives in this process, in
    the order they were issued: two models on one group (a critic and the reward model in
    the same worker) can never interleave their operations differently on two ranks."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(1, thread_name_prefix="zero3")
        return _POOL


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []
