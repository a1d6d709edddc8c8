"""Pretraining's collective groups (troupe.runtime.topology): "dp" over the trainers; with
MoE, DeepSpeed's expert layout, "ep" (the ranks that split the experts between them) and
"edp" (the ranks that hold the same experts); with train.offload, "offload" (trainers and
shard owners, gloo) and, for LAMB's global norms, "owners" (gloo). A group that would have one
member is not wired (None)."""

from __future__ import annotations

from dataclasses import dataclass

from troupe.parallel import expert_layout
from troupe.pretrain.config import PretrainConfig
from troupe.runtime.topology import Group, Topology

TRAINER, OWNER = "trainer", "shard"  # the graph's roles


def _parts(groups: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in groups)


@dataclass(frozen=True)
class PretrainTopology(Topology):
    dp: Group | None = None
    ep: Group | None = None
    edp: Group | None = None
    offload: Group | None = None
    owners: Group | None = None

    @classmethod
    def of(cls, cfg: PretrainConfig) -> "PretrainTopology":
        W, moe = cfg.workers, cfg.model.architecture().moe
        ep = edp = offload = owners = None
        if moe is not None:
            layout = expert_layout(W, moe.ep_size)
            if moe.ep_size > 1:
                ep = Group("ep", (TRAINER,), parts=_parts(layout.ep_groups))
            if W // moe.ep_size > 1:
                edp = Group("edp", (TRAINER,), parts=_parts(layout.edp_groups))
        if cfg.train.offload:
            offload = Group("offload", (TRAINER, OWNER), backend="gloo")
            if cfg.optimizer.name == "lamb" and W > 1:
                owners = Group("owners", (OWNER,), backend="gloo")
        return cls(dp=Group("dp", (TRAINER,)) if W > 1 else None, ep=ep, edp=edp,
                   offload=offload, owners=owners)
