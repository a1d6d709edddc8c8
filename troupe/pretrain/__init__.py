"""Pretraining: GPT / PR-MoE with ZeRO-1 or 1-bit optimizers, curriculum and random-LTD.

config (the recipe), rank (one data-parallel rank in plain torch, and the ParameterShard
owner), workers (the two roles as graph workers), driver (the graph, the step loop, recovery,
checkpoints), export (one full model from a sharded checkpoint)."""

from troupe.pretrain.config import PretrainConfig, TrainConfig
from troupe.pretrain.rank import PretrainWorker, ShardOwner, StepStats
from troupe.pretrain.workers import ParameterShardRank, PretrainRank, RankInfo

__all__ = ["ParameterShardRank", "PretrainConfig", "PretrainRank", "PretrainWorker", "RankInfo",
           "ShardOwner", "StepStats", "TrainConfig"]
