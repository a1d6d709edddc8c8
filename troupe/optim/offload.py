"""Optimizer offload: fp32 master weights and optimizer state live on separate ParameterShard
owners (CPU-only actors), not on the trainers.

One "offload" group holds the W trainers (ranks 0..W-1) and the W shard owners (ranks W..2W-1).
A step is two all_to_alls with variable splits: trainer t sends chunk r of its gradient to owner
r, and owner r sums the W chunks it receives (a reduce-scatter into the owners); owner r updates
its chunk and sends it to every trainer (an all-gather from the owners). The group is gloo's:
trainers on a GPU send and receive through host memory."""

from __future__ import annotations

import torch

from troupe.collectives import Communicator
from troupe.optim.base import Optimizer
from troupe.optim.flat import FlatParams
from troupe.optim.sharded import ShardRule


def _splits(W: int, trainers: int, owners: int) -> list[int]:
    return [trainers] * W + [owners] * W


class OffloadedOptimizer(Optimizer):
    """Trainer side: the flat gradient goes out to the shard owners, parameters come back."""

    def __init__(self, flat: FlatParams, group: Communicator, grad_scale: float = 1.0):
        super().__init__(flat, group, grad_scale)
        if group.world_size % 2 or group.rank >= group.world_size // 2:
            raise ValueError(f"offload group: trainers are ranks 0..W-1 of 2W, got rank "
                             f"{group.rank} of {group.world_size}")
        self.W = group.world_size // 2
        if flat.padded % self.W:
            raise ValueError(f"flat buffer of {flat.padded} does not split over {self.W} owners")
        self.chunk = flat.padded // self.W
        self.world = self.W  # the data-parallel world whose gradients are averaged

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}  # all of it lives with the owners

    def push_params(self) -> None:
        """Trainer 0 sends the initial parameters to the owners (the others send nothing)."""
        n = self.chunk if self.group.rank == 0 else 0
        self.group.all_to_all(self.flat.data[:n * self.W].cpu(), _splits(self.W, 0, 0),
                              _splits(self.W, 0, n))

    def pull_params(self) -> None:
        """Receive every owner's chunk into the flat parameters."""
        got = self.group.all_to_all(torch.empty(0),  # host: the owners' group is gloo's
                                    _splits(self.W, 0, self.chunk),
                                    _splits(self.W, 0, 0))
        self.flat.data.copy_(got)

    def step(self, lr: float) -> None:
        self.t += 1
        self.group.all_to_all(self.flat.grad.cpu(), _splits(self.W, 0, 0),
                              _splits(self.W, 0, self.chunk))
        self.comm.bytes_sent += self.flat.padded * 4
        self.pull_params()


class ParameterShard:
    """Owner side: master weights [lo, hi) of one flat buffer and the rule's state for them.

    Call ``receive_params()`` once (matching the trainers' push_params), then ``step(lr)`` in
    step with the trainers; ``send_params()`` answers a trainer's pull_params (after a restore).
    """

    def __init__(self, group: Communicator, padded: int, rule: ShardRule,
                 grad_scale: float = 1.0):
        self.group, self.rule, self.grad_scale = group, rule, grad_scale
        self.W = group.world_size // 2
        if group.rank < self.W:
            raise ValueError(f"offload group: owners are ranks {self.W}..{2 * self.W - 1}, "
                             f"got rank {group.rank}")
        self.chunk = padded // self.W
        self.index = group.rank - self.W
        self.lo, self.hi = self.index * self.chunk, (self.index + 1) * self.chunk
        self.params = torch.zeros(self.chunk)  # host: an owner is a host-memory actor
        self.t = 0

    def receive_params(self) -> None:
        """The other end of the trainers' push_params: this owner's chunk, from trainer 0."""
        got = self.group.all_to_all(torch.empty(0),  # host: (an owner)
                                    [self.chunk] + [0] * (2 * self.W - 1),
                                    [0] * (2 * self.W))
        self.params.copy_(got)

    def step(self, lr: float) -> None:
        self.t += 1
        grads = self.group.all_to_all(torch.empty(0),  # host: (an owner)
                                      _splits(self.W, self.chunk, 0),
                                      _splits(self.W, 0, 0))
        g = grads.view(self.W, self.chunk).sum(0).div_(self.W)
        if self.grad_scale != 1.0:
            g.mul_(self.grad_scale)
        self.rule.update(self.params, g, lr, self.t)
        self.send_params()

    def send_params(self) -> None:
        self.group.all_to_all(self.params.repeat(self.W), _splits(self.W, 0, 0),
                              _splits(self.W, self.chunk, 0))

    def state_dict(self) -> dict:
        return {"t": self.t, "params": self.params.clone(),
                "tensors": {k: v.clone() for k, v in self.rule.state_tensors().items()}}

    def load_state_dict(self, state: dict, where: str) -> None:
        if state["params"].numel() != self.chunk:
            raise ValueError(f"{where}: shard of {state['params'].numel()} elements, this owner "
                             f"holds {self.chunk}: saved with another layout")
        self.t = int(state["t"])
        self.params.copy_(state["params"])
        for k, t in self.rule.state_tensors().items():
            t.copy_(state["tensors"][k])
