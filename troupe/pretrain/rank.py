"""One data-parallel rank of GPT pretraining, in plain torch: the model (with this rank's slice
of the experts), ZeRO-1 or 1-bit optimizers over flat buckets or a ZeRO-2/3 partitioned model,
deterministic batches with the curriculum and random-LTD schedules, evaluation, and its share
of a sharded checkpoint; and the ParameterShard owner of offloaded training."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

import torch

from troupe.collectives import Communicator
from troupe.collectives.base import seconds_in_operations
from troupe.data import load_tokenizer, micro_batches, open_dataset
from troupe.devices import precision_dtype, rng_state, set_rng_state, worker_device
from troupe.models import GPT, GPTConfig, expert_parameters, from_pretrained
from troupe.models.moe import MoE
from troupe.optim import (
    CommCounter,
    FlatParams,
    LossScaler,
    OffloadedOptimizer,
    Optimizer,
    OptimizerConfig,
    ParameterShard,
    ShardedOptimizer,
    build_optimizer,
    build_partitioned_optimizer,
    build_shard_rule,
    padded_size,
)
from troupe.parallel import PartitionedBucket, Zero3, apply_expert_parallel, apply_tensor_parallel
from troupe.parallel.layout import ParallelLayout
from troupe.pretrain.layouts import load_other_layout
from troupe.pretrain.plan import check_memory
from troupe.pretrain.config import PretrainConfig
from troupe.runtime.metrics import peak_memory_mb


@dataclass(frozen=True)
class StepStats:
    """One rank's account of one optimizer step."""

    step: int
    loss: float          # language-model loss of this rank's batch
    aux_loss: float      # MoE load-balancing loss (0 without MoE)
    lr: float
    seq_len: int         # curriculum length of this step
    ltd_keep: int        # tokens random-LTD kept per sequence
    tokens: int          # tokens in this rank's batch
    bytes_sent: int      # by this rank's optimizers since the start
    seconds: float
    peak_memory_mb: float = 0.0  # this rank's so far (runtime.metrics.peak_memory_mb)
    loss_scale: float = 1.0      # fp16's, after this step (it halves on an overflow)
    skipped_steps: int = 0       # fp16 steps skipped for overflow, since the start
    a2a_bytes: int = 0           # MoE token exchanges' bytes to other ranks, since the start
    compute_s: float = 0.0       # forward and backward (MoE's token exchanges and ZeRO-3's
    #                              gathers inside), before the gradient's reduction and step
    comm_s: float = 0.0          # of the step: seconds waited on collectives (_comm_wait_s)
    data_s: float = 0.0          # reading this step's rows (a streamed corpus: from disk)


class Bucket:
    """Parameters that share a reduction group, flattened, with their optimizer."""

    def __init__(self, name: str, params: list, group: Communicator | None,
                 cfg: OptimizerConfig, grad_scale: float, offload: Communicator | None = None):
        self.name, self.group = name, group
        W = group.world_size if group is not None else 1
        self.flat = FlatParams(params, align=W if cfg.sharded else 1)
        self.optimizer: Optimizer
        if offload is not None:
            self.optimizer = OffloadedOptimizer(self.flat, offload, grad_scale)
        else:
            self.optimizer = build_optimizer(cfg, self.flat, group, grad_scale)

    def owned(self) -> tuple[int, int]:
        """The slice of the flat buffer this rank saves: its shard, everything, or nothing
        (offloaded: the shard owners save the parameters)."""
        opt = self.optimizer
        if isinstance(opt, OffloadedOptimizer):
            return (0, 0)
        return (opt.lo, opt.hi) if isinstance(opt, ShardedOptimizer) else (0, self.flat.padded)

    def state_dict(self) -> dict:
        lo, hi = self.owned()
        # live tensors, written out at once by the checkpoint (no second copy in memory)
        return {"params": self.flat.data[lo:hi], "optimizer": self.optimizer.state_dict(copy=False)}

    def load_state_dict(self, state: dict, where: str) -> None:
        lo, hi = self.owned()
        if state["params"].numel() != hi - lo:
            raise ValueError(f"{where}: bucket {self.name!r} holds {state['params'].numel()} "
                             f"parameters, this rank owns {hi - lo}: saved with another layout")
        self.flat.data[lo:hi].copy_(state["params"])
        if isinstance(self.optimizer, OffloadedOptimizer):
            self.optimizer.pull_params()
        elif (lo, hi) != (0, self.flat.padded) and self.group is not None:
            parts = self.group.all_gather(self.flat.data[lo:hi].contiguous())
            self.flat.data.copy_(parts.reshape(-1))
        self.optimizer.load_state_dict(state["optimizer"])


class PartitionedState:
    """A bucket of a zero_stage 2 or 3 model (troupe.parallel.zero3) with its optimizer: what
    the trainer steps, zeroes and saves, as it does a ZeRO-1 Bucket."""

    def __init__(self, part: PartitionedBucket, cfg: OptimizerConfig, comm: CommCounter):
        self.name, self.part = part.name, part
        self.optimizer = build_partitioned_optimizer(cfg, part.data, part.grad, part.segments,
                                                     part.group, comm)

    @property
    def flat(self) -> PartitionedBucket:
        """What the loss scaler unscales and the step zeroes: the gradient shard."""
        return self.part

    def state_dict(self) -> dict:
        return self.part.state_dict(self.optimizer)


def partitioned_model(cfg: PretrainConfig, arch: GPTConfig, device: torch.device,
                      dp: Communicator | None, ep: Communicator | None,
                      edp: Communicator | None, expert_scale: float,
                      tp: Communicator | None = None) -> tuple[GPT, Zero3]:
    """The model of ``cfg`` (this rank's tensor-parallel shards of it) partitioned over
    ``dp`` (experts over ``edp``), zero_stage 2 or 3. troupe's GPT is built on the meta
    device and each block initialised as it is partitioned, so no rank ever holds it whole; a
    pretrained checkpoint is loaded whole and then cut."""
    if cfg.model.pretrained is not None:
        model, init = cfg.prepare_model(from_pretrained(cfg.model.pretrained).train()), None
        model = apply_tensor_parallel(model, tp)
    else:
        with torch.device("meta"):
            model = apply_tensor_parallel(GPT(arch, seed=cfg.seed), tp)
        init = functools.partial(model.init_weights, cfg.seed)  # init(names): those only
    model = apply_expert_parallel(model, ep)
    zero3 = Zero3(model, dp, edp, prefetch=cfg.zero_prefetch,
                  reduce_dtype=precision_dtype(cfg.optimizer.reduce_dtype), init=init,
                  device=device, expert_scale=expert_scale,
                  expert_slice=ep.rank if ep is not None else 0, stage=cfg.zero_stage)
    return model, zero3


class Trainer:
    """Rank ``rank`` of ``world`` (laid out by troupe.pretrain.topology). Groups: ``tp`` (the
    ranks splitting each dense layer with this one), ``dp`` (the ranks holding the same
    shards; all ranks without tensor parallelism); with MoE, ``ep`` (this rank's
    expert-parallel group) and ``edp`` (the ranks holding the same experts); None where a group
    would have one member. ``offload``: the trainers + ParameterShard owners group, when the
    dense parameters are offloaded (the owners must construct in step: see ShardOwner)."""

    def __init__(self, cfg: PretrainConfig, rank: int, world: int, dp: Communicator | None,
                 ep: Communicator | None = None, edp: Communicator | None = None,
                 offload: Communicator | None = None, tp: Communicator | None = None):
        self.cfg, self.rank, self.world = cfg, rank, world
        # the batch this rank reads: its data-parallel rank's (the same on its tp ranks)
        self.dp_rank, self.dp_world = cfg.layout().coords(rank)[0], cfg.data_parallel
        self.tp = tp
        # dropout and gate noise differ per data-parallel rank (the same on its tp ranks)
        torch.manual_seed(cfg.seed * 1000 + self.dp_rank)
        self.device = worker_device(cfg.device)
        self.arch = cfg.model.architecture()
        self.window = cfg.model.window(self.arch)
        pretrained = cfg.model.pretrained
        self.data = open_dataset(cfg.data, pretrained,
                                 load_tokenizer(pretrained) if pretrained else None)
        edp_size = edp.world_size if edp is not None else 1
        check_memory(cfg, self.arch, self.device, rank, world)
        self.zero3: Zero3 | None = None
        self.buckets: list[Bucket | PartitionedState]
        # the experts' gradients: summed over the ranks holding them, then a share of the
        # data-parallel mean (edp counts the tp ranks, each with its own share of the tokens)
        expert_scale = edp_size / self.dp_world
        if cfg.zero_stage != 1:
            self.model, self.zero3 = partitioned_model(cfg, self.arch, self.device, dp, ep,
                                                       edp, expert_scale, tp)
            self.buckets = [PartitionedState(b, cfg.optimizer, self.zero3.comm)
                            for b in self.zero3.buckets.values()]
        else:
            model = build_model(cfg, self.arch, tp, self.device)
            self.model = apply_expert_parallel(model, ep)
            dense, expert = expert_parameters(self.model)
            self.buckets = [Bucket("dense", dense, dp, cfg.optimizer, 1.0, offload)]
            if offload is not None:
                self.buckets[0].optimizer.push_params()
            if expert:
                self.buckets.append(Bucket("expert", expert, edp, cfg.optimizer,
                                           expert_scale))
        self.model.checkpoint_activations = cfg.train.activation_checkpointing
        self.ep_size = ep.world_size if ep is not None else 1
        self.dp, self.step = dp, 0
        self.scaler = LossScaler() if cfg.precision == "fp16" else None
        self.objective = cfg.objective(self.device) or language_model_loss

    def train_step(self, step: int) -> StepStats:
        """Run global step ``step`` (1-based); returns this rank's metrics."""
        cfg, t0 = self.cfg, time.perf_counter()
        waited = self._comm_wait_s()
        full = self.window
        seq_len = cfg.curriculum.seq_len_at(step, full)
        x, y = self.data.train_batch(step, cfg.train.batch_size, full, self.dp_rank,
                                     self.dp_world)
        data_s = time.perf_counter() - t0
        x, y = x[:, :seq_len].to(self.device), y[:, :seq_len].to(self.device)
        keep = cfg.random_ltd.keep_at(step, seq_len)
        ltd = None
        if cfg.random_ltd.enabled and keep < seq_len:
            gen = torch.Generator().manual_seed(cfg.seed * 7919 + step * 131 + self.dp_rank)
            ltd = (keep, cfg.random_ltd.layers(self.arch.n_layer), gen)
        self.model.train()
        coef = self.arch.moe.aux_loss_coef if self.arch.moe else 0.0
        lm_loss_value = aux_value = 0.0
        parts = micro_batches(len(x), cfg.train.micro_batch_size)
        for part in parts:  # gradients accumulate; each loss its share of the batch's mean
            with self.model.mixed_precision(cfg.precision):
                lm_loss, aux = self.objective(self.model, x[part], y[part], ltd)
            share = (part.stop - part.start) / len(x)
            lm_loss_value += lm_loss.item() * share
            aux_value += aux.detach().item() * share
            loss = (lm_loss + coef * aux) * share
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        compute_s = time.perf_counter() - t0
        lr = cfg.optimizer.lr_at(step, cfg.train.steps)
        if self.zero3 is not None:  # the root's gradient reduced, nothing left gathered
            self.zero3.release()
        if self.scaler is None or self.scaler.unscale_([b.flat for b in self.buckets],
                                                       [self.dp, self.tp]):
            for b in self.buckets:
                b.optimizer.step(lr)
        for b in self.buckets:
            b.flat.zero_grad()
        self.step = step
        s = self.scaler
        sent = sum(b.optimizer.comm.bytes_sent for b in self.buckets)
        if self.zero3 is not None:  # the gathers and reduce-scatters of the partitions
            sent += self.zero3.comm.bytes_sent
        tokens = x.numel() if self.tp is None or self.tp.rank == 0 else 0  # counted once
        return StepStats(step, lm_loss_value, aux_value, lr, seq_len, keep, tokens, sent,
                         time.perf_counter() - t0, peak_memory_mb(),
                         loss_scale=s.scale_value if s else 1.0,
                         skipped_steps=s.skipped if s else 0,
                         a2a_bytes=sum(m.meter.bytes for m in self.model.modules()
                                       if isinstance(m, MoE)), compute_s=compute_s,
                         comm_s=self._comm_wait_s() - waited, data_s=data_s)

    def _comm_wait_s(self) -> float:
        """Seconds this rank has waited on its data- and tensor-parallel groups' operations
        (gloo's count; 0 for communicators that keep none). A partitioned model's operations
        run on a thread of their own, beside the compute: what counts of them is the time
        the trainer waited for that thread."""
        waited = seconds_in_operations([self.dp, self.tp] + [getattr(b, "group", None)
                                                             for b in self.buckets])
        if self.zero3 is not None:
            waited += self.zero3.blocked_s - self.zero3.background_s
        return waited

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over this rank's share of the fixed validation windows."""
        self.model.eval()
        c = self.cfg
        with self.model.mixed_precision(c.precision):
            losses = [self.model(x.to(self.device), y.to(self.device))[1].item()
                      for x, y in self.data.val_batches(c.train.eval_batches, c.train.batch_size,
                                                        self.window, self.dp_rank,
                                                        self.dp_world)]
        if self.zero3 is not None:
            self.zero3.release()
        return sum(losses) / len(losses)

    def memory(self) -> dict:
        """Bytes this rank holds between steps: parameters, gradients and optimizer state
        (with zero_stage 3 its shards, and apart from them the transient peak of the blocks
        gathered while the model runs)."""
        optimizer = sum(b.optimizer.state_bytes() for b in self.buckets)
        if self.zero3 is not None:
            return {**self.zero3.memory(), "optimizer_bytes": optimizer}
        params = sum(b.flat.padded * 4 for b in self.buckets)
        return {"param_bytes": params, "grad_bytes": params, "optimizer_bytes": optimizer,
                "gathered_bytes": 0}

    def state_dict(self) -> dict:
        return {"step": self.step, "rank": self.rank, "world": self.world,
                "tensor_parallel": self.cfg.tensor_parallel,
                "zero_stage": self.cfg.zero_stage,
                **rng_state(self.device),
                "loss_scaler": self.scaler.state_dict() if self.scaler else None,
                "buckets": {b.name: b.state_dict() for b in self.buckets}}

    def load_partitioned(self, read: Callable[[int], dict], old_world: int, where: str) -> None:
        """Load a zero_stage 2 or 3 checkpoint (the same layout) written by ``old_world``
        ranks (any number: each bucket's shards are cut again for this world); ``read(r)``
        gives old rank r's state. The random streams are old rank ``rank % old_world``'s (the
        same rank's when the world is the same)."""
        T = self.cfg.tensor_parallel
        own = read(self.rank % old_world)
        if own.get("zero_stage") not in (2, 3):
            raise ValueError(f"{where}: not written with zero_stage 2 or 3 (this run partitions "
                             "its parameters: resume from a stage-2 or 3 checkpoint or start "
                             "over)")
        self._check_tensor_parallel(own, where)
        if old_world % (self.ep_size * T):
            raise ValueError(f"{where}: written by {old_world} ranks, which do not split into "
                             f"expert-parallel groups of {self.ep_size} (and tensor-parallel "
                             f"groups of {T})")
        layout = ParallelLayout.of(old_world, T, self.ep_size)
        dense = layout.dp_groups[self.rank % T]  # the old ranks holding these shards
        for b in self.buckets:
            if b.name == "dense":
                trainer, group_world = (lambda k: dense[k]), len(dense)
            else:
                s = b.part.slice
                trainer, group_world = (lambda k, s=s: layout.edp_groups[s][k]), \
                    len(layout.edp_groups[s])
            b.part.load_state_dict(b.optimizer, lambda k, b=b, t=trainer:
                                   read(t(k))["buckets"][b.name], group_world, where)
        self.load_common(own, where)

    def load_other_layout(self, read: Callable[[int], dict], old_world: int,
                          where: str) -> None:
        """Load a ZeRO-1 checkpoint written by another layout (another tensor_parallel or
        number of workers): troupe.pretrain.layouts.load_other_layout."""
        load_other_layout(self, read, old_world, where)

    def layout_coords(self) -> tuple[int, int, int]:
        """(data-parallel rank, tensor-parallel rank, expert slice) of this rank."""
        d, t = self.cfg.layout().coords(self.rank)
        return d, t, d % self.ep_size

    def _check_tensor_parallel(self, state: dict, where: str) -> None:
        saved = state.get("tensor_parallel", 1)
        if saved != self.cfg.tensor_parallel:
            raise ValueError(f"{where}: written with tensor_parallel={saved}, this run has "
                             f"tensor_parallel={self.cfg.tensor_parallel}: resume with the same "
                             "size")

    def load_common(self, state: dict, where: str) -> None:
        """The random streams, fp16's loss scale and the step of a loaded checkpoint."""
        set_rng_state(state, self.device)
        if self.scaler is not None:
            if state.get("loss_scaler") is None:
                raise ValueError(f"{where}: saved without fp16's loss scale; resume with the "
                                 "precision it was written with")
            self.scaler.load_state_dict(state["loss_scaler"])
        self.step = int(state["step"])

    def load_state_dict(self, state: dict, where: str) -> None:
        """Load this rank's own state, saved by the same rank of the same world."""
        if state.get("world") != self.world or state.get("rank") != self.rank:
            raise ValueError(f"{where}: written by rank {state.get('rank')} of "
                             f"{state.get('world')}, loading into rank {self.rank} of {self.world}")
        names = sorted(b.name for b in self.buckets)
        if sorted(state["buckets"]) != names:
            raise ValueError(f"{where}: buckets {sorted(state['buckets'])}, model has {names}")
        if self.zero3 is not None:
            return self.load_partitioned(lambda r: state, self.world, where)
        self._check_tensor_parallel(state, where)
        for b in self.buckets:
            b.load_state_dict(state["buckets"][b.name], where)
        self.load_common(state, where)


def language_model_loss(model: GPT, x: torch.Tensor, y: torch.Tensor,
                        ltd=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean next-token loss of ``model`` on ``x`` against ``y``, and its MoE aux loss."""
    _, loss, aux = model(x, y, ltd=ltd)
    return loss, aux


def build_model(cfg: PretrainConfig, arch: GPTConfig, tp: Communicator | None = None,
                device: torch.device | str = "cpu") -> GPT:
    """The model a run starts from (``arch``: ``cfg.model.architecture()``), on ``device``:
    the pretrained checkpoint, or troupe's GPT seeded; with a tensor-parallel group ``tp``
    this rank's shards of it (troupe's GPT built on the meta device and each shard drawn
    from the whole model's seed, so no rank holds more than a shard and one tensor)."""
    if cfg.model.pretrained is not None:
        model = cfg.prepare_model(from_pretrained(cfg.model.pretrained).train())
        return apply_tensor_parallel(model, tp).to(device)
    if tp is None:
        return cfg.prepare_model(GPT(arch, seed=cfg.seed)).to(device)
    with torch.device("meta"):
        model = apply_tensor_parallel(GPT(arch, seed=cfg.seed), tp)
    model.materialize(device).init_weights(cfg.seed)
    return cfg.prepare_model(model)


class ShardOwner:
    """A ParameterShard owner of the dense parameters (train.offload): index ``index`` of W.
    ``offload`` is the trainers + owners group; ``owners`` the owners among themselves (LAMB's
    per-tensor norms)."""

    def __init__(self, cfg: PretrainConfig, offload: Communicator,
                 owners: Communicator | None):
        with torch.device("meta"):  # shapes only: the owner never holds a model
            dense, _ = expert_parameters(GPT(cfg.model.architecture(), seed=cfg.seed))
        numels = [p.numel() for p in dense if p.requires_grad]
        W = cfg.workers
        padded = padded_size(numels, W)
        chunk, index = padded // W, offload.rank - W
        self.comm = CommCounter()
        rule = build_shard_rule(cfg.optimizer, numels, padded, index * chunk,
                                (index + 1) * chunk, owners, self.comm)
        self.cfg, self.index = cfg, index
        self.shard = ParameterShard(offload, padded, rule)
        self.shard.receive_params()

    def step(self, step: int) -> None:
        self.shard.step(self.cfg.optimizer.lr_at(step, self.cfg.train.steps))

    def memory(self) -> dict:
        state = self.shard.rule.state_tensors().values()
        return {"param_bytes": self.shard.params.numel() * 4,
                "optimizer_bytes": sum(t.numel() * t.element_size() for t in state)}

    def state_dict(self) -> dict:
        return {"index": self.index, "shard": self.shard.state_dict()}

    def load_state_dict(self, state: dict, where: str) -> None:
        if state.get("index") != self.index:
            raise ValueError(f"{where}: written by owner {state.get('index')}, loading into "
                             f"owner {self.index}")
        self.shard.load_state_dict(state["shard"], where)
        self.shard.send_params()
