"""Rebuild one full model from a sharded pretraining checkpoint: the dense parameters from the
ranks' shards (ZeRO-1) or any rank (replicated), the experts from every expert-parallel slice.
The result is an ordinary single-process GPT (ep_size 1), for evaluation, quantization and
serving."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from troupe.config import validate
from troupe.models import GPT, expert_parameters
from troupe.models.moe import Experts
from troupe.training import checkpoint as ckpt
from troupe.training.pretrain import PretrainConfig


def load_full_model(directory: str | Path, cfg: PretrainConfig | None = None) -> GPT:
    """The GPT a checkpoint directory (a local path or an fsspec URL) holds. Its config: ``cfg``,
    else the one the manifest carries, else the run's config.json two levels up (checkpoints
    written before manifests carried it). Only for checkpoints without offloaded shards."""
    manifest = ckpt.read_manifest(directory)
    if cfg is None and "config" in manifest:
        cfg = validate(PretrainConfig, manifest["config"], f"{directory}: manifest config")
    elif cfg is None:
        path = Path(directory).parent.parent / "config.json"
        cfg = validate(PretrainConfig, json.loads(path.read_text()), str(path))
    W = manifest["roles"].get("trainer")
    if "shard" in manifest["roles"]:
        raise ValueError(f"{directory}: offloaded checkpoints are not supported here")
    states = [ckpt.read_rank(directory, r, manifest) for r in range(W)]
    moe = cfg.model.moe
    P = moe.ep_size if moe else 1
    full = GPT(cfg.model.model_copy(update={"moe": moe and moe.model_copy(update={"ep_size": 1})}))
    dense, _ = expert_parameters(full)
    sharded = cfg.optimizer.sharded  # ZeRO-1 shards; the 1-bit optimizers keep whole copies
    _fill(dense, _bucket(states, "dense", range(W), sharded))
    if moe:
        for e in range(P):  # expert-parallel slice e lives on ranks e, e + P, ... (strided)
            sliced = GPT(cfg.model, _StandIn(e, P))
            _, experts = expert_parameters(sliced)
            _fill(experts, _bucket(states, "expert", range(e, W, P), sharded))
            for (name, mine), theirs in zip(_experts(full), [m for _, m in _experts(sliced)]):
                n = theirs.num_local
                for p_full, p_slice in zip(mine.parameters(), theirs.parameters()):
                    p_full.data[e * n:(e + 1) * n].copy_(p_slice.data)
    return full.eval()


def expert_parallel_copy(full: GPT, group) -> GPT:
    """The expert-parallel rank of ``full`` (a single-process MoE GPT) for ``group``: the same
    dense weights, and the contiguous slice of each MoE layer's experts that group rank r
    holds (experts r*n .. (r+1)*n - 1). Its MoE layers exchange tokens over ``group``."""
    moe = full.cfg.moe
    if moe is None:
        raise ValueError("expert_parallel_copy: the model has no MoE layers")
    P = group.world_size
    cfg = full.cfg.model_copy(update={"moe": moe.model_copy(update={"ep_size": P})})
    part = GPT(cfg, group)
    dense_full, _ = expert_parameters(full)
    dense_part, _ = expert_parameters(part)
    with torch.no_grad():
        for a, b in zip(dense_part, dense_full):
            a.copy_(b)
        for (_, mine), (_, whole) in zip(_experts(part), _experts(full)):
            n = mine.num_local
            for p_part, p_full in zip(mine.parameters(), whole.parameters()):
                p_part.copy_(p_full[group.rank * n:(group.rank + 1) * n])
    return part.eval()


def _bucket(states: list[dict], name: str, ranks: range, sharded: bool) -> torch.Tensor:
    """The flat buffer of a bucket: shards concatenated in group order, or rank 0's copy
    (after 0/1 Adam's local steps the copies differ by at most one sync; rank 0's is taken)."""
    parts = [states[r]["buckets"][name]["params"] for r in ranks]
    return torch.cat(parts) if sharded else parts[0]


def _fill(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.data.copy_(flat[offset:offset + n].view_as(p))
        offset += n


def _experts(model: GPT):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Experts)]


class _StandIn:
    """Just enough of a Communicator for building the expert slice of rank ``rank``."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
