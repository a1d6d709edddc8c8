"""Pretraining checkpoints read by another layout: a ZeRO-1 checkpoint written with one
tensor_parallel and number of workers, resumed with another. Each bucket's master weights and
optimizer state are put together whole, tensor by tensor (the old tensor-parallel shards
merged, troupe.parallel.tensor.Split), and this rank's part of them cut again: the same
values, laid out for the new run. Adam, AdamW and LAMB only (their state is elementwise);
the experts keep their slices (the model's ep_size)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from troupe.collectives import Communicator
from troupe.models import GPT, GPTConfig
from troupe.parallel import apply_tensor_parallel
from troupe.parallel.layout import ParallelLayout
from troupe.parallel.tensor import Place

if TYPE_CHECKING:
    from troupe.pretrain.rank import Trainer


def load_other_layout(trainer: "Trainer", read: Callable[[int], dict], old_world: int,
                      where: str) -> None:
    """Load into ``trainer`` a ZeRO-1 checkpoint of ``old_world`` ranks written by another
    layout (see the module's docstring); ``read(r)``: old rank r's state. The random
    streams are old rank ``rank % old_world``'s."""
    own = read(trainer.rank % old_world)
    old_T = own.get("tensor_parallel", 1)
    if not trainer.cfg.optimizer.sharded:
        raise ValueError(f"{where}: written by {old_world} ranks of tensor_parallel="
                         f"{old_T}; optimizer.name={trainer.cfg.optimizer.name!r} keeps state "
                         "that does not cut again: resume with the same workers and "
                         "tensor_parallel")
    if own.get("zero_stage", 1) != 1:
        raise ValueError(f"{where}: written with zero_stage {own.get('zero_stage')}, this "
                         "run has zero_stage 1")
    if old_world % (old_T * trainer.ep_size):
        raise ValueError(f"{where}: written by {old_world} ranks, which do not split into "
                         f"tensor_parallel={old_T} x expert-parallel groups of "
                         f"{trainer.ep_size}")
    old = ParallelLayout.of(old_world, old_T, trainer.ep_size)
    for b in trainer.buckets:
        if b.name == "dense":
            whole = _whole_dense(trainer.arch, read, old, b.name, where)
            tensors = {k: [_shard(trainer.model, name, v, trainer.tp) for name, v in
                           zip(_dense_names(trainer.model), whole[k])] for k in whole}
            flats = {k: torch.cat([t.reshape(-1) for t in v]) for k, v in tensors.items()}
        else:  # the experts are not split by tensor parallelism: the same flat buffer
            slice_ = trainer.layout_coords()[2]
            ranks = old.edp_groups[slice_]
            flats = _concat(read, ranks, b.name, where)
        lo, hi = b.owned()
        opt = own["buckets"][b.name]["optimizer"]
        padded = {k: torch.nn.functional.pad(v, (0, b.flat.padded - v.numel()))
                  for k, v in flats.items()}
        b.load_state_dict({"params": padded["params"][lo:hi],
                           "optimizer": {**opt, "tensors": {
                               k: padded[k][lo:hi] for k in opt["tensors"]}}}, where)
    trainer.load_common(own, where)


def _dense_names(model: GPT) -> list[str]:
    """The names of the dense bucket's parameters, in its order."""
    return [n for n, p in model.named_parameters()
            if p.requires_grad and not getattr(p, "expert", False)]


def _concat(read: Callable[[int], dict], ranks: list[int], bucket: str,
            where: str) -> dict[str, torch.Tensor]:
    """A ZeRO-1 bucket's flat master weights ("params") and optimizer tensors, whole: the
    shards of ``ranks`` (its group, in order) laid end to end."""
    states = [read(r)["buckets"][bucket] for r in ranks]
    if any("params" not in s for s in states):
        raise ValueError(f"{where}: bucket {bucket!r} has no saved parameters")
    out = {"params": torch.cat([s["params"] for s in states])}
    for k in states[0]["optimizer"]["tensors"]:
        out[k] = torch.cat([s["optimizer"]["tensors"][k] for s in states])
    return out


def _whole_dense(arch: GPTConfig, read: Callable[[int], dict], old: ParallelLayout,
                 bucket: str, where: str) -> dict[str, list[torch.Tensor]]:
    """The dense parameters and their optimizer tensors as the whole model's, in bucket
    order: each old tensor-parallel rank's bucket (its data-parallel group's shards) cut into
    its tensors, then the shards merged (troupe.parallel.tensor.Split)."""
    parts: list[dict[str, list[torch.Tensor]]] = []
    names: list[str] = []
    for t in range(old.tp):
        with torch.device("meta"):
            shard = apply_tensor_parallel(GPT(arch), Place(t, old.tp) if old.tp > 1 else None)
        names = _dense_names(shard)
        shapes = [shard.get_parameter(n).shape for n in names]
        flats = _concat(read, old.dp_groups[t], bucket, where)
        need = sum(s.numel() for s in shapes)
        for k, flat in flats.items():
            if flat.numel() < need:
                raise ValueError(f"{where}: bucket {bucket!r} {k} holds {flat.numel()} values, "
                                 f"the model's tensor-parallel rank {t} of {old.tp} needs {need}")
        parts.append({k: list(torch.split(flat[:need], [s.numel() for s in shapes]))
                      for k, flat in flats.items()})
        parts[-1] = {k: [v.view(s) for v, s in zip(vs, shapes)] for k, vs in parts[-1].items()}
    splits = shard.tp_layout if old.tp > 1 else {}
    return {k: [splits[n].merge([p[k][i] for p in parts]) if n in splits else parts[0][k][i]
                for i, n in enumerate(names)] for k in parts[0]}


def _shard(model: GPT, name: str, whole: torch.Tensor, tp: Communicator | None) -> torch.Tensor:
    """This rank's part of the whole tensor ``whole`` of parameter ``name``."""
    split = model.tp_layout.get(name) if tp is not None else None
    return whole if split is None else split.shard(whole, tp.rank)
