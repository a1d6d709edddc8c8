"""The optimizer section of a recipe, the learning-rate schedule, and the factory."""

from __future__ import annotations

import math
from typing import Annotated, Callable, Literal

import torch
from pydantic import Field

from troupe.collectives import Communicator
from troupe.config import Config
from troupe.devices import precision_dtype
from troupe.optim.base import CommCounter, Optimizer
from troupe.optim.flat import FlatParams, segment_ids
from troupe.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam
from troupe.optim.sharded import (
    Adam,
    AdamRule,
    Lamb,
    LambRule,
    PartitionedOptimizer,
    ShardRule,
)

OPTIMIZERS = ("adam", "adamw", "lamb", "onebit_adam", "zero_one_adam", "onebit_lamb")


class OptimizerConfig(Config):
    """name picks the algorithm; the rest are its parameters (DeepSpeed's names and defaults
    where DeepSpeed has them). lr follows a linear warmup over warmup_steps, then a cosine decay
    to min_lr at the last step. bias_correction: Adam's moment corrections, for every algorithm
    (DeepSpeed's 1-bit optimizers run without; with it, a frozen variance keeps the correction
    of its last update, which matters when the warmup is short of 1/(1 - beta2) steps).
    reduce_dtype: the type gradients are averaged in across ranks (the ZeRO reduce-scatter and
    the 1-bit optimizers' uncompressed warm-up allreduce): bf16 halves those bytes at bf16's
    rounding of the sum; the mean lands back in the fp32 gradients and the update is fp32.
    shard_state: the 1-bit optimizers keep the variance of the chunks each rank serves in the
    compressed allreduce only (1/W of it) and all-gather the updated parameters: half of
    ZeRO-1 Adam's bytes instead of a thirty-second (see troupe.optim.onebit); the same results bit
    for bit. update_clip: 0/1 Adam scales each tensor's update down to this RMS (Adafactor's
    update clipping; 0: off, as in DeepSpeed), see troupe.optim.onebit.ZeroOneAdam."""

    name: Literal["adam", "adamw", "lamb", "onebit_adam", "zero_one_adam", "onebit_lamb"] = "adamw"
    lr: float = Field(default=1e-3, gt=0)
    min_lr: float = Field(default=1e-4, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = \
        (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    bias_correction: bool = True
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # the 1-bit family: partition the variance over the group (adam, adamw and lamb always are)
    shard_state: bool = False
    # 1-bit Adam and 1-bit LAMB
    freeze_step: int = Field(default=100_000, ge=0)
    # 0/1 Adam
    var_freeze_step: int = Field(default=100_000, ge=0)
    var_update_scaler: int = Field(default=16, ge=1)
    local_step_scaler: int = Field(default=32_678, ge=1)
    local_step_clipper: int = Field(default=16, ge=1)
    update_clip: float = Field(default=1.0, ge=0)
    # LAMB and 1-bit LAMB
    max_coeff: float = Field(default=10.0, gt=0)
    min_coeff: float = Field(default=0.01, ge=0)
    coeff_beta: float = Field(default=0.9, ge=0, lt=1)
    factor_max: float = Field(default=4.0, gt=0)
    factor_min: float = Field(default=0.5, gt=0)
    factor_threshold: float = Field(default=0.1, ge=0)

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate of 1-based ``step`` of ``total_steps``."""
        if step <= self.warmup_steps:
            return self.lr * step / max(self.warmup_steps, 1)
        frac = (step - self.warmup_steps) / max(total_steps - self.warmup_steps, 1)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(frac, 1)))

    @property
    def sharded(self) -> bool:
        """Whether parameters and state are partitioned in contiguous ZeRO-1 shards (the
        checkpoint then holds a shard of the parameters per rank); the 1-bit optimizers keep
        the parameters whole on every rank, with or without shard_state."""
        return self.name in ("adam", "adamw", "lamb")


def build_optimizer(cfg: OptimizerConfig, flat: FlatParams, group: Communicator | None,
                    grad_scale: float = 1.0) -> Optimizer:
    """The optimizer ``cfg`` names, over ``flat``, averaging gradients over ``group`` (in
    ``cfg.reduce_dtype``)."""
    opt = _build(cfg, flat, group, grad_scale)
    opt.reduce_dtype = precision_dtype(cfg.reduce_dtype)
    return opt


def _build(cfg: OptimizerConfig, flat: FlatParams, group: Communicator | None,
           grad_scale: float) -> Optimizer:
    common = dict(betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                  grad_scale=grad_scale)
    onebit = dict(common, bias_correction=cfg.bias_correction, shard_state=cfg.shard_state)
    lamb = dict(max_coeff=cfg.max_coeff, min_coeff=cfg.min_coeff)
    if cfg.name in ("adam", "adamw"):
        return Adam(flat, group, decoupled=cfg.name == "adamw",
                    bias_correction=cfg.bias_correction, **common)
    if cfg.name == "lamb":
        return Lamb(flat, group, **lamb, **common)
    if cfg.name == "onebit_adam":
        return OneBitAdam(flat, group, freeze_step=cfg.freeze_step, **onebit)
    if cfg.name == "zero_one_adam":
        return ZeroOneAdam(flat, group, var_freeze_step=cfg.var_freeze_step,
                           var_update_scaler=cfg.var_update_scaler,
                           local_step_scaler=cfg.local_step_scaler,
                           local_step_clipper=cfg.local_step_clipper,
                           update_clip=cfg.update_clip, **onebit)
    return OneBitLamb(flat, group, freeze_step=cfg.freeze_step, coeff_beta=cfg.coeff_beta,
                      factor_max=cfg.factor_max, factor_min=cfg.factor_min,
                      factor_threshold=cfg.factor_threshold, **lamb, **onebit)


def build_shard_rule(cfg: OptimizerConfig, numels: list[int], padded: int, lo: int, hi: int,
                     norm_group: Communicator | None, comm: CommCounter) -> ShardRule:
    """The update of shard [lo, hi) of a flat buffer of tensors of ``numels`` elements, for a
    ParameterShard owner (ZeRO-1 algorithms only)."""
    if not cfg.sharded:
        raise ValueError(f"optimizer {cfg.name!r} keeps its state on every rank and cannot be "
                         "offloaded; use adam, adamw or lamb")
    if cfg.name == "lamb":
        return LambRule(segment_ids(numels, padded, lo, hi), len(numels) + 1, norm_group, comm,
                        cfg.betas, cfg.eps, cfg.weight_decay, cfg.min_coeff, cfg.max_coeff)
    return AdamRule(hi - lo, cfg.betas, cfg.eps, cfg.weight_decay, cfg.name == "adamw",
                    cfg.bias_correction, device="cpu")  # the owners are host-memory actors


def build_partitioned_optimizer(cfg: OptimizerConfig, data: torch.Tensor, grad: torch.Tensor,
                                segments: Callable[[], tuple[torch.Tensor, int]],
                                group: Communicator | None,
                                comm: CommCounter) -> PartitionedOptimizer:
    """ZeRO-2/3's optimizer over one bucket of a partitioned model: this rank's master weights
    ``data`` and gradient shard ``grad``; ``segments()`` gives each element's tensor and
    their count (LAMB's per-tensor norms, summed over ``group``; asked for by LAMB only: an
    index per element costs 8 bytes a parameter)."""
    if not cfg.sharded:
        raise ValueError(f"zero_stages 2 and 3 partition the state of adam, adamw or lamb; "
                         f"optimizer.name={cfg.name!r} keeps its own (use zero_stage 1)")
    if cfg.name == "lamb":
        ids, count = segments()
        rule: ShardRule = LambRule(ids, count, group, comm, cfg.betas, cfg.eps,
                                   cfg.weight_decay, cfg.min_coeff, cfg.max_coeff)
    else:
        rule = AdamRule(data.numel(), cfg.betas, cfg.eps, cfg.weight_decay, cfg.name == "adamw",
                        cfg.bias_correction, device=data.device)
    return PartitionedOptimizer(rule, data, grad)
