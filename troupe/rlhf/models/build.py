"""What every RLHF role shares: building its model and a data-parallel optimizer over its flat
parameters (weights are saved and loaded with troupe.models.io)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from troupe.collectives import Communicator
from troupe.data import ByteTokens, Tokenizer, load_tokenizer
from troupe.devices import precision_dtype
from troupe.generation.tools import template_text
from troupe.models import GPT, from_pretrained
from troupe.optim import (
    FlatParams,
    LossScaler,
    Optimizer,
    OptimizerConfig,
    PartitionedOptimizer,
    build_optimizer,
    build_partitioned_optimizer,
)
from troupe.models.io import save_module
from troupe.parallel import Zero3, apply_tensor_parallel
from troupe.parallel.tensor import full_state_dict, gathered_parameters, load_shards
from troupe.parallel.memory import check_budget, device_budget_gib, plan
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.models.lm import GPTLM
from troupe.rlhf.sections import ModelConfig


def build_lm(cfg: ModelConfig, seed: int, precision: str, tokenizer: bool = True,
             device: torch.device | str = "cpu", tools: list[dict] | None = None,
             tp: Communicator | None = None, training: bool = True
             ) -> tuple[GPTLM, Tokenizer | None]:
    """The language model and tokenizer a recipe names: the Hugging Face directory
    ``cfg.pretrained`` loaded into troupe's decoder, or troupe's GPT from ``seed`` (built on
    the host, so that every device starts from the same weights), on ``device``, computing in
    ``precision`` (the recipe's; troupe.rlhf.models.lm.GPTLM). Roles
    that never see text (reference, critic) ask for no tokenizer (a large vocabulary's
    tokenizer costs a process more than 100 MB). ``tools``: OpenAI tool specs every chat prompt
    is rendered with (the recipe's env.tools: SFT's demonstrations, the reward model's pairs
    and the rollouts see the same system turn). ``tp``: the tensor-parallel group whose rank's
    shards of the model this process holds (troupe.parallel.tensor; troupe's GPT drawn shard
    by shard from the whole model's seed, a checkpoint loaded whole and cut; ``training``
    False: for inference only, key/value heads may be replicated over its ranks)."""
    if cfg.pretrained is not None:
        gpt = apply_tensor_parallel(from_pretrained(cfg.pretrained).train(), tp, training)
        tok = recipe_tokenizer(cfg, tools) if tokenizer else None
    else:
        tok = ByteTokens()
        if cfg.gpt.vocab_size != tok.vocab_size:
            raise ValueError(f"model.gpt.vocab_size={cfg.gpt.vocab_size}: the byte tokenizer "
                             f"has {tok.vocab_size} tokens")
        if tp is None or tp.world_size == 1:
            gpt = GPT(cfg.gpt, seed=seed)
        else:
            with torch.device("meta"):
                gpt = apply_tensor_parallel(GPT(cfg.gpt, seed=seed), tp, training)
            gpt.materialize("cpu").init_weights(seed)
    gpt.checkpoint_activations = cfg.activation_checkpointing
    return GPTLM(gpt.to(device), precision, cfg.packing, cfg.packing_tokens), tok


def recipe_tokenizer(cfg: ModelConfig, tools: list[dict] | None = None) -> Tokenizer:
    """The tokenizer of the recipe's model: a Hugging Face directory's (with ``template`` in
    place of its chat template, ``tools`` rendered with every prompt), or troupe's bytes."""
    if cfg.pretrained is None:
        return ByteTokens()
    return load_tokenizer(cfg.pretrained, cfg.chat_template,
                          cfg.template and template_text(cfg.template), tools)


def build_trainable(module: nn.Module, blocks: nn.ModuleList, group: Communicator | None,
                    cfg: RLHFConfig, device: torch.device,
                    tp: Communicator | None = None) -> "Trainable | PartitionedTrainable":
    """A role's trained ``module`` (``blocks``: its decoder's) as the recipe lays it out:
    whole on every rank (zero_stage 1; each rank of a tensor-parallel group ``tp`` its
    shards) or partitioned over ``group`` (zero_stage 2 or 3)."""
    if cfg.zero_stage != 1:
        return PartitionedTrainable(module, blocks, group, cfg, device)
    return Trainable(module, group, cfg.precision, cfg.memory_per_worker, blocks, tp)


class _Weights:
    """Saving and loading a role's weights, whatever its layout: whole files, written by rank
    0 and read by every rank (a partitioned module gathered for it, a tensor-parallel one put
    together from its shards and cut again: troupe.parallel.tensor)."""

    tp: Communicator | None = None

    def save(self, path: str, module: nn.Module, write: bool, **meta) -> None:
        """``module``'s whole weights to ``path``, written where ``write`` (every rank calls)."""
        with self.gathered():
            state = self.put_together(module)
            if write:
                save_module(path, module, state=state, **meta)

    def put_together(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """Inside ``gathered()``: a tensor-parallel ``module``'s whole state dict (every rank
        calls: its shards are all-gathered), or None when the module is whole here already
        (the writer reads its own)."""
        return full_state_dict(module) if self.tp is not None else None

    def load(self, path: str, module: nn.Module) -> None:
        """Weights written by ``save`` (or by a run of another layout) into ``module``."""
        with self.writable():
            load_shards(path, module)


class Trainable(_Weights):
    """A module whose trainable parameters live in one flat buffer, stepped by a troupe
    optimizer that averages gradients over ``group`` (ZeRO-1, or 1-bit compressed). In fp16
    (``precision``) the losses are scaled on their way into ``backward`` and an update whose
    gradients overflow is skipped (troupe.optim.LossScaler). ``tp``: the tensor-parallel
    group the module's model is split over (its ranks' gradients of the split weights are
    each their slice's, of the replicated ones the same on each: ``group`` joins the ranks
    holding the same shards)."""

    def __init__(self, module: nn.Module, group: Communicator | None, precision: str = "fp32",
                 memory_per_worker: float | None = None, blocks: nn.ModuleList | None = None,
                 tp: Communicator | None = None):
        self.module, self.group, self.tp = module, group, tp
        self.memory_per_worker, self.blocks = memory_per_worker, blocks
        self.scaler = LossScaler() if precision == "fp16" else None
        self.world = group.world_size if group is not None else 1
        self.flat = FlatParams([p for p in module.parameters() if p.requires_grad],
                               align=self.world)
        self.opt: Optimizer | None = None
        self.opt_cfg: OptimizerConfig | None = None
        self.total_steps = 1

    def use_optimizer(self, cfg: OptimizerConfig, total_steps: int) -> None:
        """(Re)start the optimizer, e.g. at the beginning of a training step."""
        self.opt_cfg, self.total_steps = cfg, max(total_steps, 1)
        self.opt = None  # the old state goes before the new one is allocated
        _check_memory(self.module, self.blocks, cfg, self.world, 1, 0, self.flat.device,
                      self.memory_per_worker)
        self.opt = build_optimizer(cfg, self.flat, self.group)

    def drop_optimizer(self) -> None:
        """Free the optimizer state between training steps (``use_optimizer`` starts anew)."""
        self.opt = None

    def state_dict(self) -> dict:
        """The trainable weights (every data-parallel rank holds them all) and this rank's
        optimizer state: the live tensors, not copies (a checkpoint writes them out at once;
        copies cost a 135M model 1.6 GB per trained role at every checkpoint)."""
        assert self.opt is not None, "use_optimizer() first"
        return {"params": self.flat.data, "optimizer": self.opt.state_dict(copy=False),
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict, where: str) -> None:
        assert self.opt is not None, "use_optimizer() first"
        if state["params"].shape != self.flat.data.shape:
            raise ValueError(f"{where}: {state['params'].numel()} trainable parameters saved, "
                             f"this model has {self.flat.data.numel()}: another model or layout")
        try:
            self.opt.load_state_dict(state["optimizer"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        self.flat.data.copy_(state["params"])
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])

    def release(self) -> None:
        """Freeze the module for good: its gradients and optimizer state are freed (a frozen
        role holds neither); the weights stay where they are. Idempotent."""
        self.flat.free_grad()
        for p in self.flat.params:
            p.requires_grad_(False)
        self.opt = None

    def free_grads(self) -> None:
        """Give the gradient buffer back between updates (``backward`` makes it again)."""
        self.flat.free_grad()

    def gathered(self):
        """The whole module, for what the block encloses (it always is, at stage 1)."""
        return contextlib.nullcontext(self.module)

    writable = gathered

    def stream(self, module: nn.Module):
        """``module``'s named parameters, whole (troupe.parallel.weight_sync): a
        tensor-parallel model's put together one at a time (every rank walks it to the end)."""
        return gathered_parameters(module) if self.tp is not None else module.named_parameters()

    def settle(self) -> None:
        """After a forward without gradients (scoring): nothing to free at stage 1."""

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled first in fp16 (and the gradient buffer made
        again if ``free_grad`` gave it back)."""
        self.flat.alloc_grad()
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, step: int) -> float:
        """One optimizer step on the gradients accumulated since the last (the callers run
        ``backward`` once per micro-batch, each loss scaled to its share of the batch); in
        fp16 none when they overflowed on some rank."""
        assert self.opt is not None and self.opt_cfg is not None, "use_optimizer() first"
        lr = self.opt_cfg.lr_at(step, self.total_steps)
        self.flat.alloc_grad()  # a step without a backward since free_grad: zero gradients
        if self.scaler is None or self.scaler.unscale_([self.flat], [self.group, self.tp]):
            self.opt.step(lr)
        self.flat.zero_grad()
        return lr


class PartitionedTrainable(_Weights):
    """Trainable's interface over a module partitioned block by block over ``group``
    (zero_stage 2 or 3, troupe.parallel.zero3): each rank keeps 1/W of the weights, gradients and
    optimizer state. The weights are whole only inside ``gathered()`` (generation, saving)
    or ``writable()`` (loading). Every rank runs the same blocks in the same order whatever
    its data (the partitioned model's collectives): a forward is one ``GPT.hidden`` pass,
    shared prompts included (troupe.models.PrefixTree)."""

    def __init__(self, module: nn.Module, blocks: nn.ModuleList, group: Communicator | None,
                 cfg: RLHFConfig, device: torch.device):
        self.module, self.group, self.cfg, self.blocks = module, group, cfg, blocks
        self.scaler = LossScaler() if cfg.precision == "fp16" else None
        self.world = group.world_size if group is not None else 1
        # no expert parallelism in RLHF: experts reduce over the same group as the rest
        self.zero3 = Zero3(module, group, group, blocks=blocks, prefetch=cfg.zero_prefetch,
                           device=device, stage=cfg.zero_stage)
        self.buckets = list(self.zero3.buckets.values())
        self.opts: list[PartitionedOptimizer] | None = None
        self.opt_cfg: OptimizerConfig | None = None
        self.total_steps = 1

    def use_optimizer(self, cfg: OptimizerConfig, total_steps: int) -> None:
        self.opt_cfg, self.total_steps = cfg, max(total_steps, 1)
        self.opts = None
        _check_memory(self.module, self.blocks, cfg, self.world, self.zero3.stage,
                      self.cfg.zero_prefetch,
                      self.zero3.device, self.cfg.memory_per_worker)
        self.zero3.reduce_dtype = precision_dtype(cfg.reduce_dtype)
        self.opts = [build_partitioned_optimizer(cfg, b.data, b.grad, b.segments, b.group,
                                                 self.zero3.comm) for b in self.buckets]

    def drop_optimizer(self) -> None:
        self.opts = None

    def state_dict(self) -> dict:
        assert self.opts is not None, "use_optimizer() first"
        return {"partitioned": [b.state_dict(o) for b, o in zip(self.buckets, self.opts)],
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict, where: str) -> None:
        """This rank's shards, saved by the same rank of the same number of ranks."""
        assert self.opts is not None, "use_optimizer() first"
        saved = state.get("partitioned")
        if saved is None or len(saved) != len(self.buckets):
            raise ValueError(f"{where}: not written with zero_stage 2 or 3 (this run "
                             "partitions its models: resume from a stage-2 or 3 checkpoint or "
                             "start over)")
        for b, o, s in zip(self.buckets, self.opts, saved):
            b.load_state_dict(o, lambda k, s=s: s, s["world"], where)
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])

    def release(self) -> None:
        """Frozen for good: the optimizer state goes and the parameters stop asking for
        gradients; the weights stay partitioned."""
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.opts = None

    def free_grads(self) -> None:
        """Nothing to give back: the gradients are 1/W shards, kept between updates."""

    def gathered(self):
        return self.zero3.gathered()

    def writable(self):
        return self.zero3.writable()

    def stream(self, module: nn.Module):
        """``module``'s named parameters, gathered unit by unit (Zero3.stream): every rank
        walks it to the end, in step."""
        return self.zero3.stream(module)

    def settle(self) -> None:
        """After a forward without gradients (scoring): the root, which stays gathered
        between such forwards, is freed."""
        self.zero3.release()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, step: int) -> float:
        assert self.opts is not None and self.opt_cfg is not None, "use_optimizer() first"
        lr = self.opt_cfg.lr_at(step, self.total_steps)
        self.zero3.release()  # nothing gathered may outlive the update
        if self.scaler is None or self.scaler.unscale_(self.buckets, self.group):
            for opt in self.opts:
                opt.step(lr)
        self.zero3.zero_grad()
        return lr


def _check_memory(module: nn.Module, blocks: nn.ModuleList | None, cfg: OptimizerConfig,
                  world: int, stage: int, prefetch: int, device: torch.device,
                  budget: float | None) -> None:
    """MemoryBudgetError when a role's plan (troupe.parallel.memory) exceeds its budget
    (``blocks`` None: the module as one unit, and no figure of the other stage beside it)."""
    gib = device_budget_gib(device, budget)
    if gib is None:
        return
    units = blocks if blocks is not None else nn.ModuleList()
    other = None if blocks is None else plan(module, cfg, world, 4 - stage, prefetch,
                                             blocks=units)
    check_budget(plan(module, cfg, world, stage, prefetch, blocks=units), gib,
                 type(module).__name__, other)
