"""Pretraining: GPT / PR-MoE with ZeRO-1 or 1-bit optimizers, curriculum and random-LTD.

config (the recipe), rank (the two roles in plain torch: Trainer, one data-parallel rank, and
ShardOwner, the owner of a shard of offloaded parameters), workers (the same as graph workers:
TrainerActor, ShardOwnerActor, the RLHF roles' naming), driver (the graph, the step loop, recovery,
checkpoints), export (one full model from a sharded checkpoint)."""

from troupe.pretrain.config import PretrainConfig, TrainConfig
from troupe.pretrain.rank import ShardOwner, StepStats, Trainer
from troupe.pretrain.workers import RankInfo, ShardOwnerActor, TrainerActor

__all__ = ["PretrainConfig", "RankInfo", "ShardOwner", "ShardOwnerActor", "StepStats",
           "TrainConfig", "Trainer", "TrainerActor"]
