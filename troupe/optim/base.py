"""What every troupe optimizer shares: a flat parameter buffer, the group whose gradients it
averages, and the byte count of what it sent."""

from __future__ import annotations

import torch

from troupe.collectives import Communicator
from troupe.optim.flat import FlatParams


class CommCounter:
    """Bytes this rank hands to collectives, per the bandwidth-optimal algorithm of each:
    allreduce 2(W-1)/W * size, reduce_scatter and all_to_all (W-1)/W * size,
    all_gather (W-1) * size of one rank's part."""

    def __init__(self) -> None:
        self.bytes_sent = 0

    def allreduce(self, nbytes: int, W: int) -> None:
        self.bytes_sent += 2 * (W - 1) * nbytes // W

    def reduce_scatter(self, nbytes: int, W: int) -> None:
        self.bytes_sent += (W - 1) * nbytes // W

    def all_gather(self, part_nbytes: int, W: int) -> None:
        self.bytes_sent += (W - 1) * part_nbytes

    def compressed(self, numel: int, W: int) -> None:
        chunk_bytes = numel // W // 8 + 4  # signs of one chunk + its scale
        self.bytes_sent += (W - 1) * chunk_bytes * 2  # all_to_all out, all_gather of the result


class Optimizer:
    """Base of troupe's optimizers. ``step(lr)`` reads the local gradients in ``flat.grad``,
    averages them over ``group`` (as each algorithm does), and updates ``flat.data``.

    grad_scale multiplies the group mean: 1 for dense parameters; for experts, reduced over the
    expert-data-parallel group, it is that group's size over the whole data-parallel world.
    """

    def __init__(self, flat: FlatParams, group: Communicator | None, grad_scale: float = 1.0):
        self.flat, self.group, self.grad_scale = flat, group, grad_scale
        self.world = group.world_size if group is not None else 1
        self.t = 0
        self.comm = CommCounter()

    #: dtype the gradients travel and are averaged in (OptimizerConfig.reduce_dtype); the
    #: mean comes back into the fp32 buffer
    reduce_dtype: torch.dtype = torch.float32

    def _allreduce_mean(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            wire = x.to(self.reduce_dtype)
            self.group.all_reduce(wire, op="mean")
            if wire is not x:
                x.copy_(wire)
            self.comm.allreduce(wire.numel() * wire.element_size(), self.world)
        if self.grad_scale != 1.0:
            x.mul_(self.grad_scale)
        return x

    def _reduce_scatter_mean(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's 1/W of the group's mean of ``x``, in fp32 (travelling in
        ``reduce_dtype``)."""
        wire = x.to(self.reduce_dtype)
        part = self.group.reduce_scatter(wire, op="mean")
        self.comm.reduce_scatter(wire.numel() * wire.element_size(), self.world)
        return part.float()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's own tensors (for memory accounting and checkpoints)."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors().values())

    def state_dict(self, copy: bool = True) -> dict:
        """The optimizer's state; ``copy=False`` hands out the live tensors (for a caller that
        writes them out at once, as a checkpoint does: no second copy of the state in memory)."""
        tensors = self.state_tensors()
        return {"t": self.t, "bytes_sent": self.comm.bytes_sent,
                "tensors": {k: v.clone() for k, v in tensors.items()} if copy else dict(tensors),
                "extra": self._extra_state()}

    def load_state_dict(self, state: dict) -> None:
        self.t, self.comm.bytes_sent = int(state["t"]), int(state["bytes_sent"])
        mine = self.state_tensors()
        if set(mine) != set(state["tensors"]):
            raise ValueError(f"optimizer state has tensors {sorted(state['tensors'])}, "
                             f"expected {sorted(mine)}")
        for k, t in mine.items():
            if t.shape != state["tensors"][k].shape:
                raise ValueError(f"optimizer state {k!r}: shape {tuple(state['tensors'][k].shape)}"
                                 f" does not match {tuple(t.shape)}")
            t.copy_(state["tensors"][k])
        self._load_extra_state(state["extra"])

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, extra: dict) -> None:
        pass

    def step(self, lr: float) -> None:
        raise NotImplementedError
