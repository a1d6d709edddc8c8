"""The two roles of pretraining as graph workers: thin shells that build the plain classes of
troupe.pretrain.rank once the groups are wired, and the dataclasses their methods return.

TrainerActor: one data-parallel trainer ("dp"; with MoE "ep" and "edp"; with offload
"offload"). ShardOwnerActor: a CPU-only owner of one shard of the dense parameters' fp32
master weights and optimizer state (train.offload). Each owner method pairs with the
trainers' method of the same name, which the driver calls at the same time."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from troupe import checkpoint as ckpt
from troupe.actors import Dispatch, dispatch
from troupe.config import validate
from troupe.context import get_context
from troupe.pretrain.config import PretrainConfig
from troupe.pretrain.rank import ShardOwner, StepStats, Trainer
from troupe.pretrain.topology import PretrainTopology
from troupe.runtime.topology import communicator

SHARD_PREFIX = "shard"


@dataclass(frozen=True)
class RankInfo:
    """What a worker reports once set up: its process, torch threads and the bytes it holds."""

    pid: int
    param_bytes: int
    optimizer_bytes: int
    grad_bytes: int = 0
    gathered_bytes: int = 0  # zero_stage 2, 3: the transient peak of the gathered blocks
    threads: int = 1


def _config(config: dict | PretrainConfig) -> PretrainConfig:
    if isinstance(config, PretrainConfig):
        return config
    return validate(PretrainConfig, config, "pretrain config")


class TrainerActor:
    """One trainer rank (of tensor and data parallelism: troupe.pretrain.topology). The
    driver calls ``setup`` once the groups are wired."""

    def __init__(self, config: dict | PretrainConfig):
        self.cfg = _config(config)
        torch.set_num_threads(self.cfg.threads)
        self.worker: Trainer | None = None

    @dispatch(Dispatch.ALL)
    def configure(self, config: dict | PretrainConfig) -> None:
        """Another recipe for this worker, what it built dropped (``setup`` builds it afresh):
        a graph reused for another run of the same ranks and groups (troupe.pretrain.driver)."""
        self.__dict__.clear()
        type(self).__init__(self, config)

    @dispatch(Dispatch.ALL)
    def setup(self, topology: PretrainTopology) -> RankInfo:
        """Build the model and optimizers, with this rank's communicators in ``topology``."""
        ctx, t = get_context(), topology
        self.worker = Trainer(self.cfg, ctx.rank, ctx.world_size, communicator(t.dp),
                              communicator(t.ep), communicator(t.edp), communicator(t.offload),
                              communicator(t.tp))
        return RankInfo(os.getpid(), **self.worker.memory(), threads=torch.get_num_threads())

    @dispatch(Dispatch.ALL)
    def train_step(self, step: int) -> StepStats:
        return self._w.train_step(step)

    @dispatch(Dispatch.ALL)
    def evaluate(self) -> float:
        return self._w.evaluate()

    @dispatch(Dispatch.ALL)
    def probe_links(self, nbytes: int) -> dict:
        """Each data-parallel pair's transfer of ``nbytes`` (troupe.collectives.straggler),
        with this rank's node address."""
        from troupe.collectives import straggler
        return {"seconds": straggler.probe_links(self._w.dp, nbytes, self._w.device),
                "node": get_context().node_ip}

    @dispatch(Dispatch.ALL)
    def memory(self) -> dict:
        """Bytes of parameters and optimizer state held now (a 1-bit optimizer's state
        changes at its freeze: setup's figures are those before the first step)."""
        return self._w.memory()

    @dispatch(Dispatch.ALL)
    def save(self, directory: str) -> dict:
        """Write this rank's file of a checkpoint; returns its manifest entry."""
        return ckpt.write_rank(directory, self._w.rank, self._w.state_dict())

    @dispatch(Dispatch.ALL)
    def load(self, directory: str) -> int:
        """Restore this rank from a checkpoint; returns its step."""
        manifest = ckpt.read_manifest(directory)
        if self.cfg.zero_stage != 1:  # any number of ranks wrote it: cut again
            read = _OneFile(lambda r: ckpt.read_rank(directory, r, manifest))
            self._w.load_partitioned(read, manifest["roles"]["trainer"], str(directory))
            return self._w.step
        old_world = manifest["roles"]["trainer"]
        same = old_world == self._w.world
        if same:
            own = ckpt.read_rank(directory, self._w.rank, manifest)
            same = own.get("tensor_parallel", 1) == self.cfg.tensor_parallel
        if not same:  # another layout: put together and cut again
            # every old rank's file is read once (the buckets are put together whole)
            read = functools.cache(lambda r: ckpt.read_rank(directory, r, manifest))
            self._w.load_other_layout(read, old_world, str(directory))
            return self._w.step
        self._w.load_state_dict(own, str(ckpt.rank_file(directory, self._w.rank)))
        return self._w.step

    @property
    def _w(self) -> Trainer:
        if self.worker is None:
            raise RuntimeError("TrainerActor.setup() must be called before training")
        return self.worker


class _OneFile:
    """``read(rank)`` keeping the last file read (a rank's buckets come from the same files
    in turn), never more than one in memory."""

    def __init__(self, read):
        self.read, self.rank, self.state = read, None, None

    def __call__(self, rank: int) -> dict:
        if rank != self.rank:
            self.state = None
            self.rank, self.state = rank, self.read(rank)
        return self.state


class ShardOwnerActor:
    """Shard owner ``rank`` of the dense parameters (train.offload)."""

    def __init__(self, config: dict | PretrainConfig):
        self.cfg = _config(config)
        self.owner: ShardOwner | None = None

    @dispatch(Dispatch.ALL)
    def configure(self, config: dict | PretrainConfig) -> None:
        """Another recipe for this worker, what it built dropped (``setup`` builds it afresh):
        a graph reused for another run of the same ranks and groups (troupe.pretrain.driver)."""
        self.__dict__.clear()
        type(self).__init__(self, config)

    @dispatch(Dispatch.ALL)
    def setup(self, topology: PretrainTopology) -> RankInfo:
        self.owner = ShardOwner(self.cfg, communicator(topology.offload),
                                communicator(topology.owners))
        return RankInfo(os.getpid(), **self.owner.memory())

    @dispatch(Dispatch.ALL)
    def train_step(self, step: int) -> None:
        self._o.step(step)

    @dispatch(Dispatch.ALL)
    def save(self, directory: str) -> dict:
        return ckpt.write_rank(directory, get_context().rank, self._o.state_dict(), SHARD_PREFIX)

    @dispatch(Dispatch.ALL)
    def load(self, directory: str) -> None:
        rank = get_context().rank
        state = ckpt.read_rank(directory, rank, ckpt.read_manifest(directory), SHARD_PREFIX)
        self._o.load_state_dict(state, str(ckpt.rank_file(directory, rank, SHARD_PREFIX)))

    @property
    def _o(self) -> ShardOwner:
        if self.owner is None:
            raise RuntimeError("ShardOwnerActor.setup() must be called first")
        return self.owner
