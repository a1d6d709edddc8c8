"""What the pretraining driver checks before any Ray process starts, and each rank again as
it builds its model: the training window against the model's context, the curriculum's start,
tensor parallelism's split of a pretrained model's heads, and each rank's memory plan (its
tensor-parallel shards; troupe.parallel.memory) against ``memory_per_worker``."""

from __future__ import annotations

import torch

from troupe.config import ConfigError
from troupe.models import GPT, GPTConfig
from troupe.models.hf_config import context_length
from troupe.parallel import apply_tensor_parallel
from troupe.parallel.memory import GIB, MemoryPlan, check_budget, device_budget_gib, size
from troupe.parallel.memory import plan as memory_plan
from troupe.parallel.tensor import Place, check_split, larger_fitting
from troupe.pretrain.config import PretrainConfig
from troupe.runtime.cluster import check_local_capacity


def plan(cfg: PretrainConfig, local: bool = False) -> MemoryPlan:
    """What the driver checks before any Ray process starts (pretraining and compression):
    the training window against the model's context and the curriculum's start against the
    window (ConfigError naming the keys and both numbers), each rank's memory plan against
    ``memory_per_worker`` (MemoryBudgetError, a ConfigError) and, with ``local`` (the apps,
    about to start Ray: not --print-config, whose recipe may be meant for a cluster), the
    ranks' CPUs against the local cluster's when the run would start one; returns the
    memory plan."""
    arch = cfg.model.architecture()
    if cfg.model.pretrained is not None and cfg.model.seq_len > arch.seq_len:
        _, where = context_length(cfg.model.pretrained)
        raise ConfigError(f"model.seq_len={cfg.model.seq_len} (the training window) exceeds "
                          f"the model's context of {arch.seq_len} tokens ({where})")
    window = cfg.model.window(arch)
    if cfg.curriculum.enabled and cfg.curriculum.min_len > window:
        raise ConfigError(f"curriculum.min_len={cfg.curriculum.min_len} exceeds the training "
                          f"window of {window} tokens (model.seq_len)")
    if cfg.tensor_parallel > 1 and cfg.model.pretrained is not None:
        try:
            check_split(arch, cfg.tensor_parallel)
        except ValueError as e:
            raise ConfigError(f"{e} ({cfg.model.pretrained}/config.json)") from None
    planned = check_memory(cfg, arch, torch.device("cpu"), None, cfg.workers)
    if local:
        cpus, what = cfg.workers * cfg.threads, f"workers={cfg.workers} x threads={cfg.threads}"
        if cfg.train.offload:
            cpus += cfg.workers * cfg.train.shard_cpus
            what += f" and as many shard owners x train.shard_cpus={cfg.train.shard_cpus:g}"
        check_local_capacity(cpus, what)
    return planned


def check_memory(cfg: PretrainConfig, arch: GPTConfig, device: torch.device, rank: int | None,
                 world: int) -> MemoryPlan:
    """This rank's memory plan (troupe.parallel.memory), from the model's shapes alone (its
    tensor-parallel shards); MemoryBudgetError when it exceeds the budget (memory_per_worker,
    or the GPU's), naming what the other ZeRO stage and a larger tensor_parallel would plan;
    ``rank`` None: every rank's (each plans the same; tensor-parallel rank 0 holds the most)."""
    budget = device_budget_gib(device, cfg.memory_per_worker)
    mine = _memory_plan(cfg, arch, cfg.tensor_parallel)
    who = f"every rank of {world}" if rank is None else f"rank {rank} of {world}"
    if budget is not None and mine.total > budget * GIB:
        larger = larger_fitting(arch, cfg.tensor_parallel,
                                lambda t: _memory_plan(cfg, arch, t).total, budget * GIB)
        if larger:
            who += (f" (tensor_parallel={larger} would plan "
                    f"{size(_memory_plan(cfg, arch, larger).total)} a rank, with workers a "
                    f"multiple of {larger})")
    other = _memory_plan(cfg, arch, cfg.tensor_parallel, 4 - cfg.zero_stage)
    check_budget(mine, budget, who, other)
    return mine


def _memory_plan(cfg: PretrainConfig, arch: GPTConfig, T: int,
                 zero_stage: int | None = None) -> MemoryPlan:
    """The plan of tensor-parallel rank 0 with tensor_parallel=T (the same data-parallel
    degree as the recipe's when T is its own; with another T, workers scaled to keep it)."""
    with torch.device("meta"):
        shapes = apply_tensor_parallel(GPT(arch), Place(0, T) if T > 1 else None)
    ep_size = arch.moe.ep_size if arch.moe else 1
    return memory_plan(shapes, cfg.optimizer, cfg.data_parallel, zero_stage or cfg.zero_stage,
                       cfg.zero_prefetch, ep_size, cfg.train.offload, tp=T)
