"""Layer-by-layer knowledge distillation (ZeroQuant's LKD): for each block in order, train a
quantized copy to reproduce the full-precision block's output on the full-precision block's
input (MSE). Training goes through fake quantization with a straight-through estimator; the
result is frozen into QuantizedLinear layers.

The data is optional: batches of token ids from the training corpus, a user's text, or
random tokens (``random_batches``)."""

from __future__ import annotations

import copy
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from troupe.compression.lowbit import fake_lowbit
from troupe.compression.quantize import (LOWBIT, QuantizedLinear, gates_stay_fp32,
                                         quantize_experts, quantize_for, replace_linears,
                                         replace_modules)
from troupe.kernels.quant import dequantize_weight, quantize_tokens
from troupe.models import GPT


class FakeQuantLinear(nn.Module):
    """An nn.Linear trained through quantization: the forward uses dq(q(w)) (and, for w8a8,
    ternary and binary, token-wise INT8 inputs); gradients pass straight through to the fp32
    weight (and the inputs). Its parameters are named as nn.Linear's (``weight``, ``bias``), so
    a model's state dict does not change when its layers are swapped for these."""

    def __init__(self, linear: nn.Linear, mode: str, group_size: int = 64):
        super().__init__()
        self.mode, self.group_size = mode, group_size
        self.weight = nn.Parameter(linear.weight.detach().clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode in LOWBIT:  # one scale a row, recomputed from the weight every step
            w = fake_lowbit(self.weight, self.mode)
        else:
            qw = quantize_for(self.weight.detach(), self.mode, self.group_size)
            w = self.weight + (dequantize_weight(qw) - self.weight).detach()
        if self.mode in ("w8a8", *LOWBIT):  # INT8 tokens
            x2 = x.reshape(-1, x.shape[-1])
            q, s = quantize_tokens(x2.detach())
            x = x + ((q.float() * s[:, None]).reshape(x.shape) - x).detach()
        return F.linear(x, w, self.bias)

    def freeze(self) -> QuantizedLinear:
        lin = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None)
        lin.weight.data = self.weight.detach().clone()
        if self.bias is not None:
            lin.bias.data = self.bias.detach().clone()
        return QuantizedLinear(lin, self.mode, self.group_size)


def random_batches(vocab: int, n: int, batch: int, seq_len: int, seed: int = 0,
                   device: torch.device | str = "cpu"):
    """``n`` batches of random token ids, the same on every device (drawn with a CPU
    generator, then moved)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)  # host: drawn
            for _ in range(n)]


def layerwise_distill(teacher: GPT, rules: dict[str, str], batches: Iterable[torch.Tensor],
                      steps_per_layer: int = 80, lr: float = 3e-5, group_size: int = 64,
                      check_every: int = 10) -> tuple[GPT, list[tuple[float, float]]]:
    """A quantized copy of ``teacher`` (linear layers by ``rules``, as quantize_model), with
    each block distilled in order. With two or more batches the last one is held out: every
    ``check_every`` steps the block's held-out MSE is measured, and the block keeps the weights
    that scored best (the undistilled ones included), so distillation never makes a block
    worse on data it did not train on. MoE gates stay fp32 (as in quantize_model); MoE
    experts matched by a rule are quantized as they are, after the distillation (the integer
    expert kernels have no backward), so the block's other layers are distilled around fp32
    experts. Returns (student, [(held-out mse before, after) per block])."""
    teacher = teacher.eval()
    student = copy.deepcopy(teacher)
    rules = gates_stay_fp32(student, rules)
    replace_linears(student, rules, lambda lin, mode, _: FakeQuantLinear(lin, mode, group_size))
    student.requires_grad_(False)
    batches = list(batches)
    with torch.no_grad():  # the full-precision inputs of block 0
        inputs = [teacher.embed(b) for b in batches]
    held = 1 if len(inputs) > 1 else 0
    report = []
    for t_block, s_block in zip(teacher.blocks, student.blocks):
        with torch.no_grad():
            targets = [t_block(x)[0] for x in inputs]
        train_x, train_y = inputs[:len(inputs) - held], targets[:len(inputs) - held]
        val_x, val_y = (inputs[-held:], targets[-held:]) if held else (train_x, train_y)
        params = [p for m in s_block.modules() if isinstance(m, FakeQuantLinear)
                  for p in m.parameters()]
        before = best = _mse(s_block, val_x, val_y)
        if params:
            kept = [p.detach().clone() for p in params]
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.Adam(params, lr=lr)
            for step in range(1, steps_per_layer + 1):
                i = step % len(train_x)
                loss = F.mse_loss(s_block(train_x[i])[0], train_y[i])
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step % check_every == 0 or step == steps_per_layer:
                    now = _mse(s_block, val_x, val_y)
                    if now < best:
                        best, kept = now, [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, k in zip(params, kept):
                    p.copy_(k)
                    p.requires_grad_(False)
        report.append((before, best))
        inputs = targets  # the next block learns on the full-precision activations
    replace_modules(student, lambda _, m: m.freeze() if isinstance(m, FakeQuantLinear) else None)
    quantize_experts(student, rules, group_size)
    return student, report


@torch.no_grad()
def _mse(block: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    return sum(F.mse_loss(block(x)[0], t).item() for x, t in zip(inputs, targets)) / len(inputs)
