"""Pretraining's collective groups (troupe.runtime.topology), laid out tp x ep x dp with tensor
parallelism innermost (troupe.parallel.layout.ParallelLayout): "tp" (the ranks that split each
dense layer), "dp" (the ranks holding the same shards, which reduce their gradients); with
MoE, DeepSpeed's expert layout over the data-parallel ranks, "ep" (the ranks that split the
experts between them) and "edp" (the ranks that hold the same experts); with train.offload,
"offload" (trainers and shard owners, gloo) and, for LAMB's global norms, "owners" (gloo). A
group that would have one member is not wired (None); without tensor parallelism the groups
are those of a data-parallel world of ``workers`` ranks."""

from __future__ import annotations

from dataclasses import dataclass

from troupe.pretrain.config import PretrainConfig
from troupe.runtime.topology import Group, Topology

TRAINER, OWNER = "trainer", "shard"  # the graph's roles


def _parts(groups: list[list[int]]) -> tuple[tuple[int, ...], ...] | None:
    """A group's parts, or None when it is one part of every rank (in rank order)."""
    if len(groups) == 1 and groups[0] == sorted(groups[0]):
        return None
    return tuple(tuple(g) for g in groups)


def _group(name: str, groups: list[list[int]]) -> Group | None:
    """The group of these parts, or None when each part has one member."""
    if all(len(g) == 1 for g in groups):
        return None
    return Group(name, (TRAINER,), parts=_parts(groups))


@dataclass(frozen=True)
class PretrainTopology(Topology):
    tp: Group | None = None
    dp: Group | None = None
    ep: Group | None = None
    edp: Group | None = None
    offload: Group | None = None
    owners: Group | None = None

    @classmethod
    def of(cls, cfg: PretrainConfig) -> "PretrainTopology":
        moe, layout = cfg.model.architecture().moe, cfg.layout()
        ep = edp = offload = owners = None
        if moe is not None:
            ep, edp = _group("ep", layout.ep_groups), _group("edp", layout.edp_groups)
        if cfg.train.offload:
            offload = Group("offload", (TRAINER, OWNER), backend="gloo")
            if cfg.optimizer.name == "lamb" and cfg.workers > 1:
                owners = Group("owners", (OWNER,), backend="gloo")
        return cls(tp=_group("tp", layout.tp_groups), dp=_group("dp", layout.dp_groups),
                   ep=ep, edp=edp, offload=offload, owners=owners)
