"""Resharding ZeRO-3's checkpoints: a bucket saved by W ranks (each its shard of every
partition, padded to a multiple of W) loaded by W' ranks, or assembled whole for export. Each
rank reads only the saved shards that overlap its own (``overlapping``), checks each against
this model's partitions (their sizes and padding for W, the rank and expert slice it claims to
be) and copies the overlap of its master weights and optimizer state; the elements copied must
cover its shard exactly, or the load fails naming the bucket."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from troupe.optim import padded_size

if TYPE_CHECKING:
    from troupe.parallel.partition import Partition, PartitionedBucket


def load_resharded(bucket: PartitionedBucket, optimizer, read: Callable[[int], dict],
               old_world: int, where: str) -> None:
    """Load from a checkpoint written by ``old_world`` ranks of this bucket's group (any
    number: the shards are cut again); ``read(k)`` gives the bucket's state saved by
    group rank k (of this rank's expert slice). Only the ranks whose shards overlap
    this rank's are read."""
    mine = optimizer.state_tensors()
    sources = sorted({k for part in bucket.partitions
                      for k in overlapping(part, old_world)})
    covered = 0
    t = bytes_sent = None
    for k in sources:
        state = read(k)
        _check_saved(bucket, state, k, old_world, where)
        opt = state["optimizer"]
        if set(opt["tensors"]) != set(mine):
            raise ValueError(f"{where}: bucket {bucket.name!r} optimizer state has "
                             f"{sorted(opt['tensors'])}, expected {sorted(mine)}")
        t, bytes_sent = opt["t"], opt["bytes_sent"]
        old_offset = 0
        for part, offset in zip(bucket.partitions, bucket.offsets):
            old_size = padded_size(part.numels, old_world) // old_world
            a = max(k * old_size, part.lo)
            b = min((k + 1) * old_size, part.lo + part.size, part.numel)
            if a < b:
                src = slice(old_offset + a - k * old_size, old_offset + b - k * old_size)
                dst = slice(offset + a - part.lo, offset + b - part.lo)
                bucket.data[dst].copy_(state["params"][src])
                for name, tensor in mine.items():
                    tensor[dst].copy_(opt["tensors"][name][src])
                covered += b - a
            old_offset += old_size
    need = sum(max(0, min(p.lo + p.size, p.numel) - p.lo) for p in bucket.partitions)
    if covered != need:
        raise ValueError(f"{where}: bucket {bucket.name!r}: the saved shards cover {covered} "
                         f"of this rank's {need} parameters")
    optimizer.load_state_dict({"t": t, "bytes_sent": bytes_sent,
                               "tensors": mine, "extra": {}})

def _check_saved(bucket: PartitionedBucket, state: dict, k: int, old_world: int,
             where: str) -> None:
    layout = [[p.numel, padded_size(p.numels, old_world)] for p in bucket.partitions]
    if not isinstance(state, dict) or "layout" not in state:
        raise ValueError(f"{where}: bucket {bucket.name!r} of rank {k} was not written with "
                         "zero_stage 3")
    if (state["world"], state["rank"], state["slice"]) != (old_world, k, bucket.slice):
        raise ValueError(f"{where}: bucket {bucket.name!r}: expected rank {k} of "
                         f"{old_world} (slice {bucket.slice}), the file holds rank "
                         f"{state['rank']} of {state['world']} (slice {state['slice']})")
    if state["layout"] != layout:
        raise ValueError(f"{where}: bucket {bucket.name!r}: saved partitions "
                         f"{state['layout']} (numel, padded) do not match this model's "
                         f"{layout}: another model or expert layout")


def overlapping(part: Partition, old_world: int) -> range:
    """The ranks of ``old_world`` whose shards of ``part`` hold elements of this rank's."""
    old_size = padded_size(part.numels, old_world) // old_world
    hi = min(part.lo + part.size, part.numel)
    if hi <= part.lo:
        return range(0)
    return range(part.lo // old_size, (hi - 1) // old_size + 1)


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
