"""The ParameterShard role of offloaded pretraining: a CPU-only actor that owns one shard of
the dense parameters' fp32 master weights and optimizer state."""

from __future__ import annotations

import os
from typing import Any

from troupe import collectives
from troupe.config import validate
from troupe.runtime.context import get_context
from troupe.training import PretrainConfig
from troupe.training import checkpoint as ckpt
from troupe.training.pretrain import ShardOwner

PREFIX = "shard"


class ParameterShardRank:
    """Shard owner ``rank``. Each method pairs with the trainers' method of the same name
    (setup, train_step, load), which the driver calls at the same time."""

    def __init__(self, config: dict | PretrainConfig):
        self.cfg = config if isinstance(config, PretrainConfig) else validate(
            PretrainConfig, config, "pretrain config")
        self.owner: ShardOwner | None = None

    def setup(self) -> dict:
        self.owner = ShardOwner(self.cfg, collectives.get_group("offload"),
                                collectives.find_group("owners"))
        return {"pid": os.getpid(), **self.owner.memory()}

    def train_step(self, step: int) -> None:
        self._o.step(step)

    def save(self, directory: str) -> dict[str, Any]:
        return ckpt.write_rank(directory, get_context().rank, self._o.state_dict(), PREFIX)

    def load(self, directory: str) -> None:
        rank = get_context().rank
        state = ckpt.read_rank(directory, rank, ckpt.read_manifest(directory), PREFIX)
        self._o.load_state_dict(state, str(ckpt.rank_file(directory, rank, PREFIX)))

    @property
    def _o(self) -> ShardOwner:
        if self.owner is None:
            raise RuntimeError("ParameterShardRank.setup() must be called first")
        return self.owner
