"""Rebuild one full model from a sharded pretraining checkpoint: the dense parameters from the
ranks' shards (ZeRO-1) or any rank (replicated), the experts from every expert-parallel slice,
the tensor-parallel shards put together.
The result is an ordinary single-process GPT, for evaluation, quantization and serving
(troupe.parallel.apply_expert_parallel splits it again)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from troupe import checkpoint as ckpt
from troupe.config import ConfigError, validate
from troupe.models import GPT, expert_parameters
from troupe.models.record import ModelRecord
from troupe.optim import padded_size
from troupe.parallel import apply_tensor_parallel
from troupe.parallel.layout import ParallelLayout
from troupe.parallel.partition import unit_parameters
from troupe.parallel.reshard import assemble
from troupe.parallel.tensor import Place
from troupe.pretrain.config import PretrainConfig


def load_full_model(directory: str | Path, cfg: PretrainConfig | None = None) -> GPT:
    """The GPT a checkpoint directory (a local path or an fsspec URL) holds. Its config: ``cfg``,
    else the one the manifest carries, else the run's config.json two levels up (checkpoints
    written before manifests carried it); its architecture: the manifest's model record
    (``checkpoint_model``). Only for checkpoints without offloaded shards."""
    manifest = ckpt.read_manifest(directory)
    if cfg is None and "config" in manifest:
        cfg = validate(PretrainConfig, manifest["config"], f"{directory}: manifest config")
    elif cfg is None:
        path = Path(directory).parent.parent / "config.json"
        cfg = validate(PretrainConfig, json.loads(path.read_text()), str(path))
    W = manifest["roles"].get("trainer")
    if "shard" in manifest["roles"]:
        raise ValueError(f"{directory}: offloaded checkpoints are not supported here")
    arch = checkpoint_model(manifest, directory, cfg).architecture
    states = [ckpt.read_rank(directory, r, manifest) for r in range(W)]
    moe, T = arch.moe, cfg.tensor_parallel
    P = moe.ep_size if moe else 1
    layout = ParallelLayout.of(W, T, P)
    whole = arch.model_copy(update={"moe": moe and moe.model_copy(update={"ep_size": 1})})
    partitioned = manifest.get("zero_stage") in (2, 3)  # the same layout
    if T == 1:
        full = GPT(whole)
        _fill_rank(full, states, layout, 0, partitioned, cfg.optimizer.sharded, str(directory))
        return full.eval()
    # each tensor-parallel rank's shards, then put together (troupe.parallel.tensor)
    parts = []
    for t in range(T):
        with torch.device("meta"):
            part = apply_tensor_parallel(GPT(whole), Place(t, T))
        part.materialize("cpu")  # every value comes from the checkpoint
        _fill_rank(part, states, layout, t, partitioned, cfg.optimizer.sharded,
                   f"{directory} (tensor-parallel rank {t})")
        parts.append(part.state_dict())
    splits = part.tp_layout
    with torch.device("meta"):
        full = GPT(whole)
    full.materialize("cpu").load_state_dict({name: splits[name].merge([p[name] for p in parts]) if name in splits
                          else value for name, value in parts[0].items()})
    return full.eval()


def _fill_rank(model: GPT, states: list[dict], layout: ParallelLayout, t: int,
               partitioned: bool, sharded: bool, where: str) -> None:
    """``model``'s parameters (tensor-parallel rank t's shards, or the whole model) from the
    checkpoint's rank ``states``: the dense ones from the ranks holding them (the data-parallel
    group of t: ZeRO shards, or any rank's whole copy), the experts slice by slice from each
    slice's expert-data-parallel group."""
    P = layout.ep
    if partitioned:
        _fill_partitioned(model, states, layout.dp_groups[t], layout.edp_groups, P, where)
        return
    dense, experts = expert_parameters(model)
    ranks = layout.dp_groups[t]
    _fill(dense, _bucket(states, "dense", ranks, sharded), len(ranks) if sharded else 1,
          f"{where}: dense parameters")
    for e, group in enumerate(layout.edp_groups if experts else []):
        # slice e's expert bucket holds, parameter by parameter, experts e*n .. (e+1)*n - 1
        # (see troupe.parallel.apply_expert_parallel)
        part = [p.data[e * (p.shape[0] // P):(e + 1) * (p.shape[0] // P)] for p in experts]
        _fill(part, _bucket(states, "expert", group, sharded),
              len(group) if sharded else 1, f"{where}: experts of slice {e}")


def _fill_partitioned(full: GPT, states: list[dict], dense_ranks: list[int],
                      expert_groups: list[list[int]], P: int, where: str) -> None:
    """``full``'s parameters from a zero_stage 2 or 3 checkpoint: each bucket's partitions
    assembled from its group's shards (troupe.parallel.zero3), the dense ones from
    ``dense_ranks``, the experts slice by slice (slice e from ``expert_groups[e]``)."""
    units = unit_parameters(full)
    dense = [[p.data for p in u if not getattr(p, "expert", False)] for u in units]
    buckets = [("dense", dense_ranks, dense)]
    for e, ranks in enumerate(expert_groups if any(
            getattr(p, "expert", False) for u in units for p in u) else []):
        part = [[p.data[e * (p.shape[0] // P):(e + 1) * (p.shape[0] // P)] for p in u
                 if getattr(p, "expert", False)] for u in units]
        buckets.append(("expert", ranks, part))
    for name, ranks, tensors in buckets:
        tensors = [t for t in tensors if t]
        shards = [states[r]["buckets"][name]["params"] for r in ranks]
        numels = [[t.numel() for t in ts] for ts in tensors]
        need = sum(padded_size(n, len(ranks)) // len(ranks) for n in numels)
        if any(s.numel() != need or s.dtype != torch.float32 for s in shards):
            raise ckpt.CheckpointError(
                f"{where}: bucket {name!r} shards of {[s.numel() for s in shards]} values, the "
                f"config's model needs {need} torch.float32 per rank: the manifest's config "
                "does not describe these weights")
        for ts, flat in zip(tensors, assemble(shards, numels)):
            _fill(ts, flat, 1, where)


def checkpoint_model(manifest: dict, directory: str | Path,
                     cfg: PretrainConfig | None = None) -> ModelRecord:
    """The model a pretraining checkpoint holds: its manifest's record (troupe.models.record,
    its hash checked), or for a checkpoint written before manifests carried one, what its
    config (``cfg``, else the manifest's) describes. CheckpointError when neither is there or
    the record is damaged."""
    record = ModelRecord.in_manifest(manifest, directory)
    if record is not None:
        return record
    try:
        if cfg is None and "config" in manifest:
            cfg = validate(PretrainConfig, manifest["config"], f"{directory}: manifest config")
    except ConfigError as e:
        raise ckpt.CheckpointError(str(e)) from None
    if cfg is None:
        raise ckpt.CheckpointError(f"{directory}: the manifest records no model")
    return cfg.model.record()


def _bucket(states: list[dict], name: str, ranks: list[int], sharded: bool) -> torch.Tensor:
    """The flat buffer of a bucket: shards concatenated in group order, or rank 0's copy
    (after 0/1 Adam's local steps the copies differ by at most one sync; rank 0's is taken)."""
    parts = [states[r]["buckets"][name]["params"] for r in ranks]
    return torch.cat(parts) if sharded else parts[0]


def _fill(params: list[torch.Tensor], flat: torch.Tensor, align: int, where: str) -> None:
    """Copy a bucket's flat buffer into ``params``; CheckpointError when its size or dtype is
    not what the config's model needs (a manifest whose config does not describe the weights
    would otherwise serve another model)."""
    want = padded_size([p.numel() for p in params], align)
    if flat.numel() != want or flat.dtype != torch.float32:
        raise ckpt.CheckpointError(
            f"{where}: {flat.numel()} {flat.dtype} values saved, the config's model needs "
            f"{want} torch.float32: the manifest's config does not describe these weights")
    offset = 0
    for p in params:
        n = p.numel()
        p.data.copy_(flat[offset:offset + n].view_as(p))
        offset += n
