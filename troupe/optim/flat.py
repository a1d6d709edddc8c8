"""Parameters and gradients viewed as one contiguous fp32 buffer each, so that optimizers and
collectives work on a single tensor."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn


class FlatParams:
    """Re-homes ``params`` (and their grads) into two flat fp32 buffers padded to a multiple of
    ``align``, on the parameters' device; afterwards each ``p.data`` and ``p.grad`` is a view
    into ``data`` / ``grad``.

    segments[i] = (offset, numel) of the i-th parameter; padding stays zero.
    """

    def __init__(self, params: Iterable[nn.Parameter], align: int = 1):
        self.params = [p for p in params if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.padded = padded_size([p.numel() for p in self.params], align)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        if any(p.device != self.device for p in self.params):
            raise ValueError("FlatParams: the parameters are on more than one device")
        self.data = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        self.grad = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        self.segments: list[tuple[int, int]] = []
        offset = 0
        for p in self.params:
            if p.dtype != torch.float32:
                raise ValueError(f"FlatParams holds fp32 parameters, got {p.dtype}")
            n = p.numel()
            self.data[offset:offset + n].copy_(p.data.reshape(-1))
            p.data = self.data[offset:offset + n].view_as(p)
            p.grad = self.grad[offset:offset + n].view_as(p)
            self.segments.append((offset, n))
            offset += n

    def zero_grad(self) -> None:
        self.grad.zero_()

    def free_grad(self) -> None:
        """Give the gradient buffer back (between training steps, e.g. while a policy
        generates); ``alloc_grad`` makes a zeroed one again before the next backward."""
        for p in self.params:
            p.grad = None
        self.grad = torch.empty(0, device=self.device)

    def alloc_grad(self) -> None:
        """A zeroed gradient buffer with each parameter's ``grad`` a view into it, if
        ``free_grad`` gave it back (else nothing)."""
        if self.grad.numel() == self.padded:
            return
        self.grad = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for p, (offset, n) in zip(self.params, self.segments):
            p.grad = self.grad[offset:offset + n].view_as(p)

    def segment_ids(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """For each element of [lo, hi): the index of its parameter (len(params) for padding)."""
        return segment_ids([n for _, n in self.segments], self.padded, lo, hi).to(self.device)


def padded_size(numels: list[int], align: int) -> int:
    """The size of a flat buffer holding tensors of ``numels`` elements, padded to ``align``."""
    return max(math.ceil(sum(numels) / align) * align, align)


def segment_ids(numels: list[int], padded: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Tensor index of each element of [lo, hi) of a flat buffer of tensors of ``numels``
    elements (len(numels) for the padding), without the tensors themselves."""
    hi = padded if hi is None else hi
    ids = torch.full((padded,), len(numels), dtype=torch.int64)  # host: filled here, then moved
    offset = 0
    for i, n in enumerate(numels):
        ids[offset:offset + n] = i
        offset += n
    return ids[lo:hi].clone()
