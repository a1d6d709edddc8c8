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
  the block is gathered again and the next ones of the backward prefetched (the forward's
  recorded order, reversed); once the gradients of all the block's inputs that require one
  are complete (its backward is done: ``BackwardDone``) the block's gradient is
  reduce-scattered (the group's mean, in ``reduce_dtype``) into this rank's gradient shard,
  and its weights and gradient are freed. So at most a few units' gradients exist at full
  size, and micro-batches accumulate into the shards: each gathers every block twice and
  reduce-scatters it once, the price of never holding a whole gradient.
- The root is gathered at its first use and kept, with its gradient whole, until ``release``
  (which the trainer calls before the optimizer step): a tied embedding is used at both ends
  of the model, and a step's micro-batches then gather and reduce-scatter it once.

Every rank issues the same collectives in the same order, whatever its data: gathers in the
order the blocks run, reduce-scatters from the last block down (the root's at ``release``).
An expert that received no tokens on a rank contributes a zero gradient there and its rank
still joins the reduce-scatter, so no rank waits on a collective another skipped.

``stage=2`` keeps each unit whole from its gather until ``release``: the forward gathers it
(prefetching as above) and neither the forward nor the backward frees it, so a step gathers
every unit once and reduce-scatters it once (a micro-batch after the first gathers nothing):
ZeRO-1's bytes, with the reduce-scatters overlapping the backward and the gathers the next
forward, and the gradient partitioned as in stage 3 (ZeRO-2's, with the parameters freed
between steps as well).

The optimizer (troupe.optim.PartitionedOptimizer) steps each bucket's master shard with its
gradient shard; nothing needs gathering after the step. ``gathered()`` holds the whole model
for a stretch of calls (generation: one gather per rollout, not one per token); ``stream()``
gives the parameters a unit at a time (a weight sync)."""

from __future__ import annotations

import contextlib
import itertools
import time
from concurrent.futures import Future
from typing import Callable, Iterator

import torch
from torch import nn

from troupe.collectives import Communicator
from troupe.collectives.base import seconds_in_operations
from troupe.optim import CommCounter
from troupe.parallel.partition import (BackwardDone, Partition, PartitionedBucket, Unit,
                                       UnitState, comm_thread, kept_bytes, lay_out,
                                       materialize, materialize_buffers, output_tensors,
                                       transient_bytes, unit_parameters)


class Zero3:
    """``model`` partitioned over ``dp`` (expert parameters over ``edp``): see the module
    docstring. ``init(names)``, for a model built on the meta device, initialises the named
    parameters once they have storage (e.g. ``GPT.init_weights(seed, only=names)``): each
    unit is materialised, initialised and partitioned in turn, so the whole model never
    exists on one rank. ``expert_scale``: the experts' grad_scale; ``expert_slice``: this
    rank's expert-parallel index. ``prefetch``: units gathered ahead of the one computing.
    ``stage``: 3, or 2 to keep units whole until ``release`` (see the module docstring)."""

    def __init__(self, model: nn.Module, dp: Communicator | None,
                 edp: Communicator | None = None, *, blocks: nn.ModuleList | None = None,
                 prefetch: int = 1,
                 reduce_dtype: torch.dtype = torch.float32,
                 init: Callable[[set[str]], None] | None = None,
                 device: torch.device | str = "cpu", expert_scale: float = 1.0,
                 expert_slice: int = 0, stage: int = 3):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if stage not in (2, 3):
            raise ValueError(f"stage must be 2 or 3, got {stage}")
        self.stage = stage
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
        # the layout first, from the shapes alone
        dense_parts, expert_parts, where = lay_out(unit_params, dp, edp, self.device)
        self.buckets = {"dense": PartitionedBucket("dense", dp, 1.0, dense_parts, self.device)}
        if expert_parts:
            self.buckets["expert"] = PartitionedBucket("expert", edp, expert_scale,
                                                       expert_parts, self.device, expert_slice)
        for params, mine in zip(unit_params, where):  # then one unit whole at a time
            materialize(params, names, init)
            for kind, i in mine:
                self.buckets[kind].partitions[i].build()
                self.buckets[kind].adopt(i)
        units = [Unit(i - 1, root_modules if i == 0 else [blocks[i - 1]],
                      [(self.buckets[k], j) for k, j in mine]) for i, mine in enumerate(where)]
        self.root, self.units = units[0], units[1:]
        materialize_buffers(model, self.device)
        self._pool = comm_thread()
        self._hold = 0                    # gathered(): nothing is freed while > 0
        self._order: list[Unit] = []      # the blocks in the order the last forward ran them
        self._running: list[Unit] = []    # ... and the forward under way
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)  # _mark_inputs
        self.whole_bytes = self.peak_whole_bytes = 0  # of the units not SHARDED (take_peak)
        self._reducing: Future | None = None  # the last reduce-scatter handed to the thread
        self.blocked_s = 0.0     # seconds the caller waited on the communication thread
        self.background_s = 0.0  # of the groups' seconds in operations, those of that thread
        self._handles = []
        for unit in self.units:
            block = unit.modules[0]
            self._handles.append(block.register_forward_pre_hook(self._pre_forward(unit),
                                                                 with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post_forward(unit)))
        for m in root_modules:
            self._handles.append(m.register_forward_pre_hook(self._root_pre_forward))

    # ---------------------------------------------------------------- gathering

    def _gather_async(self, unit: Unit) -> None:
        if unit.state is not UnitState.SHARDED:
            return
        for part in unit.parts():
            part.allocate()
        unit.gather = self._pool.submit(self._run_gather, list(unit.parts()))
        unit.state = UnitState.GATHERING
        self.whole_bytes += unit.nbytes()
        self.peak_whole_bytes = max(self.peak_whole_bytes, self.whole_bytes)

    @contextlib.contextmanager
    def _on_thread(self, parts: list[Partition]):
        """What the communication thread runs for ``parts``: its device work finished, and
        its groups' seconds in operations counted in ``background_s`` (while the thread runs
        one, the caller runs none on the same groups)."""
        t0 = seconds_in_operations(p.group for p in parts)
        yield
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.background_s += seconds_in_operations(p.group for p in parts) - t0

    def _run_gather(self, parts: list[Partition]) -> None:
        with self._on_thread(parts):
            for part in parts:
                part.gather(self.comm)

    def _wait(self, unit: Unit) -> None:
        if unit.state is UnitState.GATHERING:
            future, unit.gather = unit.gather, None
            self._block(future)
            unit.state = UnitState.GATHERED

    def _block(self, future: Future) -> None:
        t0 = time.perf_counter()
        try:
            future.result()
        finally:
            self.blocked_s += time.perf_counter() - t0

    def gather(self, unit: Unit) -> None:
        """Make ``unit``'s parameters whole (waiting for its prefetch, if one is under way)."""
        self._gather_async(unit)
        self._wait(unit)

    def _free(self, unit: Unit) -> None:
        if self._hold or self.stage == 2 or unit.state is UnitState.BACKWARD:
            return
        self._wait(unit)
        for part in unit.parts():
            part.free()
        self._sharded(unit)

    def _sharded(self, unit: Unit) -> None:
        if unit.state is not UnitState.SHARDED:
            self.whole_bytes -= unit.nbytes()
            unit.state = UnitState.SHARDED

    def take_peak(self) -> int:
        """The most bytes of full buffers held at once since the last call (the units'
        padded fp32 buffers: what ``memory()["gathered_bytes"]`` bounds)."""
        peak, self.peak_whole_bytes = self.peak_whole_bytes, self.whole_bytes
        return peak

    def _prefetch(self, unit: Unit, order: list[Unit], skip: list[Unit] = ()) -> None:
        """Gather the ``prefetch`` units after ``unit`` in ``order`` (not those in ``skip``)."""
        if unit in order:
            ahead = (u for u in order[order.index(unit) + 1:] if u not in skip)
            for nxt in itertools.islice(ahead, self.prefetch):
                self._gather_async(nxt)

    def _record(self, unit: Unit) -> None:
        """Note that ``unit`` runs now: the forward's order, which the next forward prefetches
        in (the blocks' own order until one forward has run) and its backward in reverse."""
        if unit in self._running:  # a new forward
            self._running = []
        self._running.append(unit)
        if len(self._running) == len(self.units):
            self._order = list(self._running)

    def _pre_forward(self, unit: Unit):
        def hook(module, args, kwargs):
            if unit.state is UnitState.BACKWARD:  # recomputed for activation checkpointing:
                return None                       # gathered by the backward's own hook
            self.gather(unit)
            self._record(unit)
            self._prefetch(unit, self._order or self.units, skip=self._running)  # not run yet
            if torch.is_grad_enabled():
                return self._mark_inputs(unit, args, kwargs)
            return None
        return hook

    def _mark_inputs(self, unit: Unit, args: tuple, kwargs: dict):
        """The block's inputs that require a gradient, positional and keyword, through
        ``BackwardDone``, whose backward runs once all their gradients are complete: the
        block's backward is done, and its gradients are reduced then. A trainable block none
        of whose inputs requires a gradient (its input from a frozen embedding) has its first
        floating-point input pass through with ``_anchor``, a tensor that does, so that its
        backward is seen too."""
        args = list(args)
        slots = [(args, i) for i, a in enumerate(args)
                 if isinstance(a, torch.Tensor) and a.requires_grad]
        slots += [(kwargs, k) for k, v in kwargs.items()
                  if isinstance(v, torch.Tensor) and v.requires_grad]
        anchor = None
        if not slots and unit.trainable:
            first = next((i for i, a in enumerate(args)
                          if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            if first is None:
                return None  # nothing to carry it: its gradients are reduced at release()
            slots, anchor = [(args, first)], self._anchor
        if not slots:
            return None
        marked = BackwardDone.apply(self._post_backward(unit), anchor,
                                     *(where[k] for where, k in slots))
        for (where, k), tensor in zip(slots, marked):
            where[k] = tensor
        return tuple(args), kwargs

    def _post_forward(self, unit: Unit):
        def hook(module, args, output):
            if unit.state is UnitState.BACKWARD:  # recomputed for activation checkpointing:
                return                            # the backward's own hooks free it
            if torch.is_grad_enabled():
                outs = [t for t in output_tensors(output) if t.requires_grad]
                if outs:
                    torch.autograd.graph.register_multi_grad_hook(
                        outs, self._pre_backward(unit), mode="any")
            self._free(unit)
        return hook

    def _root_pre_forward(self, module, args) -> None:
        self.gather(self.root)
        if (torch.is_grad_enabled() and self.root.state is not UnitState.BACKWARD
                and self.root.trainable):
            self._attach(self.root)

    # ---------------------------------------------------------------- backward

    def _attach(self, unit: Unit) -> None:
        """The unit's backward is about to run: its gradients are to be reduced."""
        for part in unit.parts():
            part.expect_grads()
        unit.state = UnitState.BACKWARD

    def _pre_backward(self, unit: Unit):
        def hook(grad) -> None:
            self.gather(unit)
            self._prefetch(unit, self._running[::-1])
            if unit.state is not UnitState.BACKWARD:
                self._attach(unit)
        return hook

    def _post_backward(self, unit: Unit) -> Callable[[], None]:
        def done() -> None:
            if unit.state is UnitState.BACKWARD:
                self._reduce([unit])
            if self._running and unit is self._running[0]:
                # the last block of this backward (the root's gradient stays whole until
                # release): its reduce-scatters finish before the backward returns, so that
                # the caller's next collective on these groups never runs beside them
                self.synchronize()
        return done

    def _reduce(self, units: list[Unit]) -> None:
        """Reduce-scatter the gradients of ``units`` (highest index first, the root last: the
        order every rank follows) and free their buffers."""
        for unit in sorted(units, key=lambda u: -u.index if u.index >= 0 else 1 << 30):
            work = []
            for bucket, i in unit.partitions:
                part = bucket.partitions[i]
                work.append((part, part.take_grads(), bucket.grad_scale))
            unit.state = UnitState.GATHERED
            if self.stage == 2 and self._reducing is not None:
                # no gather in the backward holds it back: at most one unit's gradient waits
                # for the link beside the one being reduced (and the one being computed)
                self._block(self._reducing)
            self._reducing = self._pool.submit(self._run_reduce, work)
            if unit is not self.root:
                self._free(unit)

    def _run_reduce(self, work) -> None:
        with self._on_thread([part for part, _, _ in work]):
            for part, grad, scale in work:
                part.reduce(grad, scale, self.reduce_dtype, self.comm)

    # ---------------------------------------------------------------- public

    def synchronize(self) -> None:
        """Wait until every collective issued so far has finished (before the optimizer
        step, or before other collectives on the same groups)."""
        self._block(self._pool.submit(lambda: None))

    def release(self) -> None:
        """Reduce-scatter what gradients are still whole (the root's, accumulated over a
        step's micro-batches) and free every gathered unit. Call it before the optimizer step
        (and after evaluation: the root stays gathered between forwards until this)."""
        self._reduce([u for u in [self.root, *self.units] if u.state is UnitState.BACKWARD])
        self.synchronize()
        for unit in [self.root, *self.units]:
            self._wait(unit)
            for part in unit.parts():
                part.free()
            self._sharded(unit)

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

    def stream(self, module: nn.Module | None = None) -> Iterator[tuple[str, nn.Parameter]]:
        """``module``'s parameters (the whole model's by default) as ``named_parameters``
        gives them, each unit gathered when its first parameter comes (the next one
        prefetched) and freed once the unit after it comes, the root kept to the end: at most
        what a training step holds gathered (``transient_bytes``). Every rank walks it to its
        end in step (its gathers are collectives); everything is freed at the end."""
        module = self.model if module is None else module
        owner = {id(p): unit for unit in [self.root, *self.units] for part in unit.parts()
                 for p in part.params}
        named = list(module.named_parameters())
        order = list(dict.fromkeys(owner[id(p)] for _, p in named
                                   if id(p) in owner and owner[id(p)] is not self.root))
        current = None
        try:
            for name, p in named:
                unit = owner.get(id(p))
                if unit is self.root:
                    self.gather(unit)
                elif unit is not None and unit is not current:
                    if current is not None:
                        self._free(current)
                    current = unit
                    self.gather(unit)
                    self._prefetch(unit, order)
                yield name, p
        finally:
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
        bound on the gathered units (``transient_bytes``; stage 2: every unit whole)."""
        units = [u.nbytes() for u in self.units]
        gathered = (transient_bytes(max(units, default=0), self.root.nbytes(), self.prefetch)
                    if self.stage == 3 else kept_bytes(units, self.root.nbytes()))
        return {"param_bytes": sum(b.data.numel() * 4 for b in self.buckets.values()),
                "grad_bytes": sum(b.grad.numel() * 4 for b in self.buckets.values()),
                "gathered_bytes": gathered}

    def close(self) -> None:
        """Remove the hooks (the model stays partitioned: its weights are the shards')."""
        self.synchronize()
        for h in self._handles:
            h.remove()
