"""What every RLHF role shares: building its model and a data-parallel optimizer over its flat
parameters (weights are saved and loaded with troupe.models.io)."""

from __future__ import annotations

import torch
from torch import nn

from troupe.collectives import Communicator
from troupe.optim import FlatParams, LossScaler, Optimizer, OptimizerConfig, build_optimizer
from troupe.data import ByteTokens, Tokenizer, load_tokenizer
from troupe.models import GPT, from_pretrained
from troupe.rlhf.config import ModelConfig
from troupe.rlhf.lm import GPTLM


def build_lm(cfg: ModelConfig, seed: int, precision: str, tokenizer: bool = True,
             device: torch.device | str = "cpu") -> tuple[GPTLM, Tokenizer | None]:
    """The language model and tokenizer a recipe names: the Hugging Face directory
    ``cfg.pretrained`` loaded into troupe's decoder, or troupe's GPT from ``seed`` (built on
    the host, so that every device starts from the same weights), on ``device``, computing in
    ``precision`` (the recipe's; troupe.rlhf.lm.GPTLM). Roles
    that never see text (reference, critic) ask for no tokenizer (a large vocabulary's
    tokenizer costs a process more than 100 MB)."""
    if cfg.pretrained is not None:
        gpt = from_pretrained(cfg.pretrained).train()
        tok = load_tokenizer(cfg.pretrained, cfg.chat_template) if tokenizer else None
    else:
        tok = ByteTokens()
        if cfg.gpt.vocab_size != tok.vocab_size:
            raise ValueError(f"model.gpt.vocab_size={cfg.gpt.vocab_size}: the byte tokenizer "
                             f"has {tok.vocab_size} tokens")
        gpt = GPT(cfg.gpt, seed=seed)
    gpt.checkpoint_activations = cfg.activation_checkpointing
    return GPTLM(gpt.to(device), precision), tok


def micro_batches(n: int, size: int | None) -> list[slice]:
    """Row slices of a batch of ``n`` rows, ``size`` rows each (None: one slice)."""
    size = size or max(n, 1)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class Trainable:
    """A module whose trainable parameters live in one flat buffer, stepped by a troupe
    optimizer that averages gradients over ``group`` (ZeRO-1, or 1-bit compressed). In fp16
    (``precision``) the losses are scaled on their way into ``backward`` and an update whose
    gradients overflow is skipped (troupe.optim.LossScaler)."""

    def __init__(self, module: nn.Module, group: Communicator | None, precision: str = "fp32"):
        self.module, self.group = module, group
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
        if self.scaler is None or self.scaler.unscale_([self.flat], self.group):
            self.opt.step(lr)
        self.flat.zero_grad()
        return lr
