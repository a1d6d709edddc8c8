"""Optimizers over flat fp32 buffers: ZeRO-1 sharded Adam, AdamW and LAMB with plain
collectives (or offloaded to ParameterShard owners), and the 1-bit family (OneBitAdam,
ZeroOneAdam, OneBitLamb) on compressed_allreduce; ZeRO-3's PartitionedOptimizer over a
partitioned model's shards (troupe.parallel.zero3); LossScaler for fp16."""

from troupe.optim.base import CommCounter, Optimizer
from troupe.optim.config import (
    OPTIMIZERS,
    OptimizerConfig,
    build_optimizer,
    build_partitioned_optimizer,
    build_shard_rule,
)
from troupe.optim.flat import FlatParams, padded_size, segment_ids
from troupe.optim.offload import OffloadedOptimizer, ParameterShard
from troupe.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam
from troupe.optim.scaler import LossScaler
from troupe.optim.sharded import (
    Adam,
    AdamRule,
    Lamb,
    LambRule,
    PartitionedOptimizer,
    ShardedOptimizer,
    ShardRule,
)

__all__ = ["OPTIMIZERS", "Adam", "AdamRule", "CommCounter", "FlatParams", "Lamb", "LambRule",
           "LossScaler", "OffloadedOptimizer", "OneBitAdam", "OneBitLamb", "Optimizer",
           "OptimizerConfig", "ParameterShard", "PartitionedOptimizer", "ShardRule",
           "ShardedOptimizer", "ZeroOneAdam", "build_optimizer", "build_partitioned_optimizer",
           "build_shard_rule", "padded_size", "segment_ids"]
