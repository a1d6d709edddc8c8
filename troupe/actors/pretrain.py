"""The trainer role of pretraining: a thin shell that hosts a PretrainWorker on the graph's
groups ("dp", and with MoE "ep" and "edp")."""

from __future__ import annotations

import os
from typing import Any

from troupe import collectives
from troupe.config import validate
from troupe.runtime.context import get_context
from troupe.training import PretrainConfig, PretrainWorker
from troupe.training import checkpoint as ckpt


class PretrainRank:
    """One data-parallel trainer rank. The driver calls ``setup`` once the groups are wired."""

    def __init__(self, config: dict | PretrainConfig):
        self.cfg = config if isinstance(config, PretrainConfig) else validate(
            PretrainConfig, config, "pretrain config")
        self.worker: PretrainWorker | None = None

    def setup(self) -> dict:
        """Build the model and optimizers; returns this rank's pid and memory figures."""
        ctx = get_context()
        dp, ep, edp, offload = (collectives.find_group(n) for n in ("dp", "ep", "edp", "offload"))
        self.worker = PretrainWorker(self.cfg, ctx.rank, ctx.world_size, dp, ep, edp, offload)
        return {"pid": os.getpid(), **self.worker.memory()}

    def train_step(self, step: int) -> dict:
        return self._w.train_step(step)

    def evaluate(self) -> float:
        return self._w.evaluate()

    def save(self, directory: str) -> dict[str, Any]:
        """Write this rank's file of a checkpoint; returns its manifest entry."""
        return ckpt.write_rank(directory, self._w.rank, self._w.state_dict())

    def load(self, directory: str) -> int:
        """Restore this rank from a checkpoint; returns its step."""
        manifest = ckpt.read_manifest(directory)
        path = ckpt.rank_file(directory, self._w.rank)
        self._w.load_state_dict(ckpt.read_rank(directory, self._w.rank, manifest), str(path))
        return self._w.step

    @property
    def _w(self) -> PretrainWorker:
        if self.worker is None:
            raise RuntimeError("PretrainRank.setup() must be called before training")
        return self.worker
