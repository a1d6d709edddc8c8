"""ZeRO-1 optimizers: rank r of W owns elements [r*n/W, (r+1)*n/W) of the flat buffer and the
optimizer state for them only. A step reduce-scatters the gradients, updates the owned shard,
and all-gathers the parameters: the same bytes as one allreduce, 1/W of the state."""

from __future__ import annotations

import math

import torch

from troupe.collectives import Communicator
from troupe.optim.base import Optimizer
from troupe.optim.flat import FlatParams


class ShardedOptimizer(Optimizer):
    """Base of Adam, AdamW and LAMB; subclasses implement ``_update(p, g, lr)`` on the shard."""

    def __init__(self, flat: FlatParams, group: Communicator | None, grad_scale: float = 1.0):
        super().__init__(flat, group, grad_scale)
        if flat.padded % self.world:
            raise ValueError(f"flat buffer of {flat.padded} does not split over {self.world} "
                             "ranks; build FlatParams with align=world_size")
        rank = group.rank if group is not None else 0
        size = flat.padded // self.world
        self.lo, self.hi = rank * size, (rank + 1) * size

    def step(self, lr: float) -> None:
        self.t += 1
        g = self._reduce_scatter_grads()
        self._update(self.flat.data[self.lo:self.hi], g, lr)
        if self.world > 1:
            parts = self.group.all_gather(self.flat.data[self.lo:self.hi])
            self.flat.data.copy_(parts.reshape(-1))
            self.comm.all_gather((self.hi - self.lo) * 4, self.world)

    def _reduce_scatter_grads(self) -> torch.Tensor:
        g = self.flat.grad
        if self.world > 1:
            g = self.group.reduce_scatter(g, op="mean")
            self.comm.reduce_scatter(self.flat.padded * 4, self.world)
        else:
            g = g.clone()
        return g.mul_(self.grad_scale) if self.grad_scale != 1.0 else g

    def _update(self, p: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        raise NotImplementedError


class Adam(ShardedOptimizer):
    """Adam (L2 weight decay added to the gradient) or, with decoupled=True, AdamW."""

    def __init__(self, flat: FlatParams, group: Communicator | None = None, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = False,
                 bias_correction: bool = True, grad_scale: float = 1.0):
        super().__init__(flat, group, grad_scale)
        self.betas, self.eps, self.wd = betas, eps, weight_decay
        self.decoupled, self.bias_correction = decoupled, bias_correction
        self.m = torch.zeros(self.hi - self.lo)
        self.v = torch.zeros(self.hi - self.lo)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"m": self.m, "v": self.v}

    def _update(self, p: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        b1, b2 = self.betas
        if self.wd and not self.decoupled:
            g.add_(p, alpha=self.wd)
        self.m.mul_(b1).add_(g, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1, bc2 = (1 - b1 ** self.t, 1 - b2 ** self.t) if self.bias_correction else (1.0, 1.0)
        denom = (self.v / bc2).sqrt_().add_(self.eps)
        if self.wd and self.decoupled:
            p.mul_(1 - lr * self.wd)
        p.addcdiv_(self.m, denom, value=-lr / bc1)


class Lamb(ShardedOptimizer):
    """LAMB: the Adam direction plus weight decay, scaled per parameter tensor by the trust
    ratio ||w|| / ||update||, clamped to [min_coeff, max_coeff]."""

    def __init__(self, flat: FlatParams, group: Communicator | None = None, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, min_coeff: float = 0.01, max_coeff: float = 10.0,
                 grad_scale: float = 1.0):
        super().__init__(flat, group, grad_scale)
        self.betas, self.eps, self.wd = betas, eps, weight_decay
        self.min_coeff, self.max_coeff = min_coeff, max_coeff
        self.m = torch.zeros(self.hi - self.lo)
        self.v = torch.zeros(self.hi - self.lo)
        self.seg = flat.segment_ids(self.lo, self.hi)
        self.num_segments = len(flat.params) + 1  # the last one is padding

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"m": self.m, "v": self.v}

    def _update(self, p: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        b1, b2 = self.betas
        self.m.mul_(b1).add_(g, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        u = (self.m / bc1).div_((self.v / bc2).sqrt_().add_(self.eps))
        if self.wd:
            u.add_(p, alpha=self.wd)
        norms = torch.zeros(2, self.num_segments)  # squared ||w||, ||u|| per tensor
        norms[0].index_add_(0, self.seg, p * p)
        norms[1].index_add_(0, self.seg, u * u)
        if self.world > 1:
            self.group.all_reduce(norms)
            self.comm.allreduce(norms.numel() * 4, self.world)
        ratio = trust_ratio(norms[0].sqrt(), norms[1].sqrt(), self.min_coeff, self.max_coeff)
        p.add_(u * ratio[self.seg], alpha=-lr)


def trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """||w|| / ||u|| clamped to [lo, hi]; 1 where either norm is zero."""
    ok = (w_norm > 0) & (u_norm > 0)
    return torch.where(ok, w_norm / u_norm.clamp_min(1e-30), torch.ones_like(w_norm)).clamp_(lo, hi)
