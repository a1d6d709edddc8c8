"""Optimizers over flat fp32 buffers: ZeRO-1 sharded Adam, AdamW and LAMB with plain
collectives, and the 1-bit family (OneBitAdam, ZeroOneAdam, OneBitLamb) on compressed_allreduce."""

from troupe.optim.base import CommCounter, Optimizer
from troupe.optim.config import OPTIMIZERS, OptimizerConfig, build_optimizer
from troupe.optim.flat import FlatParams
from troupe.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam
from troupe.optim.sharded import Adam, Lamb, ShardedOptimizer

__all__ = ["OPTIMIZERS", "Adam", "CommCounter", "FlatParams", "Lamb", "OneBitAdam", "OneBitLamb",
           "Optimizer", "OptimizerConfig", "ShardedOptimizer", "ZeroOneAdam", "build_optimizer"]
