"""A pretraining recipe: the model, optimizer, data, data-efficiency schedules and the run
(apps/configs/pretrain*.yaml)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from troupe.config import AppConfig, Config, check_zero_stage
from troupe.data import ByteTokenizer, CurriculumConfig, DataConfig, RandomLTDConfig
from troupe.devices import Device, Precision
from troupe.models import GPT, GPTConfig
from troupe.models.hf_config import read_config
from troupe.models.record import ModelRecord
from troupe.optim import OptimizerConfig
from troupe.parallel.layout import ParallelLayout
from troupe.runtime.metrics import LoggingConfig


BYTE_VOCAB = ByteTokenizer.vocab_size


class ModelConfig(GPTConfig):
    """troupe's GPT of this shape, or, with ``pretrained``, the local Hugging Face directory
    whose config.json gives the architecture (the shape fields here are then not used) and
    whose weights the run starts from; its tokenizer tokenizes the data. ``seq_len`` is the
    training window either way (for a pretrained model, at most its context)."""

    pretrained: str | None = None

    def architecture(self) -> GPTConfig:
        """The configuration the model is built with."""
        if self.pretrained is None:
            return GPTConfig.model_validate(self.model_dump(exclude={"pretrained"}))
        return read_config(self.pretrained)

    def record(self) -> ModelRecord:
        """What the run's checkpoints record about the model (troupe.models.record)."""
        return ModelRecord.of(self.architecture(), self.pretrained)

    def window(self, arch: GPTConfig) -> int:
        """Tokens per training sequence for a model of ``arch``."""
        return min(self.seq_len, arch.seq_len)


class TrainConfig(Config):
    """steps: optimizer steps; batch_size: sequences per step over all ranks; eval_every /
    checkpoint_every: in steps (0: only at the end / never).
    offload: keep the dense parameters' fp32 master weights and optimizer state on
    ``workers`` separate ParameterShard actors of ``shard_cpus`` CPUs each (ZeRO-1
    optimizers only); expert parameters stay sharded over their trainers.
    strategy: how the trainers are spread over nodes (SPREAD: one per node where it can).
    placement_timeout_s: how long to wait for the cluster (or its autoscaler) to offer the
    workers' resources. checkpoint_dir: where checkpoints go (default out_dir/checkpoints): a
    directory every node reaches, or an fsspec URL such as s3://bucket/run (fsspec and the
    filesystem's package, e.g. s3fs, installed on every node). activation_checkpointing:
    recompute each block's activations in the backward instead of keeping them (the same
    gradients; less memory for about a third more compute: benchmarks/RESULTS.md).
    micro_batch_size: sequences per forward and backward on a rank (None: its whole share of
    batch_size), the gradients accumulated over its share before the step (with zero_stage 3
    each micro-batch gathers the blocks again and reduce-scatters into the gradient shards,
    so no rank holds a whole gradient between them; MoE capacity and random-LTD draw per
    micro-batch)."""

    steps: int = Field(default=200, ge=1)
    batch_size: int = Field(default=16, ge=1)
    eval_every: int = Field(default=50, ge=0)
    eval_batches: int = Field(default=4, ge=1)
    checkpoint_every: int = Field(default=0, ge=0)
    offload: bool = False
    shard_cpus: float = Field(default=1.0, gt=0)
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    placement_timeout_s: float = Field(default=600.0, gt=0)
    checkpoint_dir: str | None = None
    activation_checkpointing: bool = False
    micro_batch_size: int | None = Field(default=None, ge=1)


class PretrainConfig(AppConfig):
    """A pretraining recipe (apps/configs/*.yaml).

    workers: trainer ranks; threads: torch threads of each (it asks Ray for as
    many CPUs: one rank of two threads trains a small model faster than two ranks of one,
    which exchange its gradients every step). tensor_parallel: T, how many of the workers
    split each dense layer between them (troupe.parallel.tensor: attention heads, MLPs and
    the vocabulary; MoE layers dispatch 1/T of the tokens from each); the workers are
    workers / T data-parallel ranks of T each, tensor parallelism innermost
    (troupe.parallel.layout.ParallelLayout). T must divide the query and key/value heads
    and the MLP width. device: where the trainers compute (auto: cuda
    when the cluster has GPUs, else cpu; the shard owners of ``train.offload`` always hold
    host memory); num_gpus: GPUs each trainer asks Ray for on cuda (one: NCCL wants one GPU
    per rank). precision: "bf16" runs the forward and backward under bf16 autocast (matmuls,
    attention and the MoE experts in bf16) while the fp32 master weights, gradients and
    optimizer state stay in the flat buffers and ZeRO shards; "fp16" the same in fp16 with
    dynamic loss scaling (troupe.optim.LossScaler: a step whose gradients overflow on any
    rank is skipped on all); "fp32" (default) everything in fp32. seed: of the weights and
    the data order. out_dir: metrics, plots, checkpoints and the exported model.
    max_restarts: the failure policy: how many times a lost or failed worker is restarted and
    the run resumed from its last checkpoint before it stops with a report (failure.json).
    collective_timeout_s: how long a collective waits for the other ranks (see
    troupe.config.AppConfig).
    zero_stage, zero_prefetch, memory_per_worker: see troupe.config.ZERO (the same in every
    app). logging: where the metric records go besides metrics.jsonl (troupe.runtime.metrics:
    tensorboard, wandb, mlflow; the same in every app)."""

    MOVED: ClassVar[dict[str, str]] = {
        f"train.{old}": new for old, new in [
            ("device", "device"), ("precision", "precision"), ("num_gpus", "num_gpus"),
            ("seed", "seed"), ("out_dir", "out_dir"), ("num_workers", "workers"),
            ("max_restarts", "max_restarts")]}

    model: ModelConfig = ModelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    random_ltd: RandomLTDConfig = RandomLTDConfig()
    train: TrainConfig = TrainConfig()
    workers: int = Field(default=2, ge=1)
    tensor_parallel: int = Field(default=1, ge=1, le=1024)
    threads: int = Field(default=1, ge=1)
    device: Device = "auto"
    num_gpus: float = Field(default=1.0, gt=0)
    precision: Precision = "fp32"
    seed: int = 0
    out_dir: str = "runs/pretrain"
    max_restarts: int = Field(default=0, ge=0)
    collective_timeout_s: float = Field(default=300.0, gt=0)
    zero_stage: Literal[1, 2, 3] = 1
    zero_prefetch: int = Field(default=1, ge=0, le=8)
    memory_per_worker: float | None = Field(default=None, gt=0)
    logging: LoggingConfig = LoggingConfig()

    def prepare_model(self, model: GPT) -> GPT:
        """The model a rank trains, made from the one it starts from (the pretrained
        checkpoint, or troupe's GPT seeded): itself. apps/compress.py's recipe makes a
        student of it (troupe.compression.distill)."""
        return model

    def objective(self, device: torch.device):
        """What a rank minimises: None for the language-model loss; apps/compress.py's recipe
        gives a distillation loss ``(model, x, y, ltd) -> (loss, MoE aux loss)``."""
        return None

    def layout(self) -> ParallelLayout:
        """The trainers' ranks laid out tp x ep x dp (troupe.parallel.layout)."""
        moe = self.model.architecture().moe
        return ParallelLayout.of(self.workers, self.tensor_parallel, moe.ep_size if moe else 1)

    @property
    def data_parallel(self) -> int:
        """How many different batches a step reads: workers / tensor_parallel."""
        return self.workers // self.tensor_parallel

    @model_validator(mode="after")
    def _fits(self) -> "PretrainConfig":
        T = self.tensor_parallel
        if self.workers % T:
            raise ValueError(f"workers={self.workers} must be a multiple of tensor_parallel={T} "
                             f"(the workers are data-parallel ranks of {T} tensor-parallel "
                             "ranks each)")
        W = self.data_parallel
        if T > 1:
            _check_tensor_parallel(self)
        check_zero_stage(self.zero_stage, {"optimizer": self.optimizer})
        if self.train.offload and self.zero_stage != 1:
            raise ValueError("train.offload moves ZeRO-1's master weights and optimizer state "
                             f"to shard owners; zero_stage={self.zero_stage} keeps 1/W of them "
                             "on each trainer already: use one or the other")
        if self.train.batch_size % W:
            ranks = f"workers={W}" if T == 1 else \
                f"the {W} data-parallel ranks (workers={self.workers} / tensor_parallel={T})"
            raise ValueError(f"train.batch_size={self.train.batch_size} must be a multiple of "
                             f"{ranks}")
        if self.train.offload and self.precision == "fp16":
            raise ValueError("precision=fp16 with train.offload: the shard owners step "
                             "in lockstep with the trainers and cannot skip an overflowed "
                             "step; use bf16")
        if self.train.offload and not self.optimizer.sharded:
            raise ValueError(f"train.offload: optimizer.name={self.optimizer.name!r} keeps its "
                             "state on every rank; offload works with adam, adamw or lamb")
        if self.model.pretrained is None and self.model.vocab_size < BYTE_VOCAB:
            raise ValueError(f"model.vocab_size={self.model.vocab_size}: the byte tokenizer's "
                             f"ids need at least {BYTE_VOCAB} (set model.pretrained for "
                             "another tokenizer)")
        if self.model.moe is not None and W % self.model.moe.ep_size:
            ranks = f"workers={W}" if T == 1 else f"the {W} data-parallel ranks"
            raise ValueError(f"model.moe.ep_size={self.model.moe.ep_size} must divide {ranks}")
        return self


def _check_tensor_parallel(cfg: PretrainConfig) -> None:
    """What tensor parallelism does not combine with (ValueError naming the key): optimizers
    that take norms of whole tensors (LAMB's trust ratio, 0/1 Adam's update clipping would see
    each rank's shard instead), offloaded master weights; and, for troupe's own GPT (a
    pretrained one's config.json is read on the driver, troupe.pretrain.plan.plan), heads
    and widths that T does not split."""
    from troupe.parallel.tensor import check_optimizer, check_split
    T = cfg.tensor_parallel
    check_optimizer(cfg.optimizer, T, "optimizer")
    if cfg.train.offload:
        raise ValueError(f"tensor_parallel={T} with train.offload: the shard owners hold "
                         "whole dense parameters; use zero_stage=3 to spread them instead")
    if cfg.model.pretrained is None:
        check_split(cfg.model.architecture(), T)
