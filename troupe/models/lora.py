"""LoRA: low-rank adapters beside frozen linear layers, which can be fused into the weights
(for generation, or to save a plain model) and unfused again to keep training."""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRALinear(nn.Module):
    """y = base(x) + (x A^T B^T) * alpha / rank, with A (rank, in) and B (out, rank); B starts
    at zero so the adapted layer starts equal to the base one."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.scale, self.fused = base, alpha / rank, False
        base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.fused:
            return y
        return y + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale

    @torch.no_grad()
    def set_fused(self, fused: bool) -> None:
        if fused == self.fused:
            return
        delta = (self.lora_b @ self.lora_a) * self.scale
        self.base.weight.add_(delta if fused else -delta)
        self.fused = fused


def inject_lora(model: nn.Module, rank: int, alpha: float,
                names: tuple[str, ...] = ("qkv", "proj", "fc")) -> int:
    """Wrap the linear layers whose attribute name is in ``names``; freeze everything else.
    Returns the number of wrapped layers."""
    model.requires_grad_(False)
    targets = [(parent, attr) for parent in model.modules() for attr, child in
               parent.named_children() if attr in names and isinstance(child, nn.Linear)]
    for parent, attr in targets:
        setattr(parent, attr, LoRALinear(getattr(parent, attr), rank, alpha))
    if not targets:
        raise ValueError(f"no linear layers named {names} to adapt")
    return len(targets)


def fuse_lora(model: nn.Module) -> bool:
    """Fold every adapter into its weight; returns whether there were any."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.set_fused(True)
    return bool(layers)


def unfuse_lora(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.set_fused(False)


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` as if it had no adapters: each adapted weight with its
    adapter folded in, under the plain layer's key. Without adapters: the live weights
    (detached views, no copy; the callers write them out at once)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if not layers:
        return {k: v.detach() for k, v in model.state_dict().items()}
    was = [m.fused for m in layers]
    for m in layers:
        m.set_fused(True)
    state = {}
    for k, v in model.state_dict().items():
        if ".lora_a" in k or ".lora_b" in k:
            continue
        state[k.replace(".base.", ".")] = v.detach().clone()
    for m, f in zip(layers, was):
        m.set_fused(f)
    return state
