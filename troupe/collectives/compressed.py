"""1-bit compressed allreduce with worker and server error feedback (1-bit Adam, DeepSpeed).

With W ranks and a tensor of n elements, zero-padded to N, a multiple of W * lcm(W, 8):

worker (every rank)   m = x + e_w;  s = ||m|| / sqrt(N);  e_w = m - s * sign(m)
                      rank r sends chunk j of sign(m) (N / 8W bytes) and s to rank j
server (rank j)       c = mean_i(s_i * sign_i[chunk j]) + e_s;  s_j = ||c|| / sqrt(N / W)
                      e_s = c - s_j * sign(c);  all_gather of sign(c) and s_j
output (every rank)   concat_j(s_j * sign_j)[:n], bit-identical on every rank

Each message is the packed signs followed by the sender's fp32 scale, so one call makes one
all_to_all and one all_gather, moving about 2N/8 bytes per rank against 2N*4 for an fp32 ring;
``compressed_allreduce_many`` does the same for many tensors in those two operations.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, NamedTuple

import torch

from troupe.collectives.base import Communicator
from troupe.kernels.onebit import accumulate_, pack_update_, unpack_

_SCALE_BYTES = 4


class OneBitState:
    """Error-feedback buffers of one tensor's compressed allreduce; allocated on first use.

    Keep one state per tensor (or per fused flat buffer) and save it with the checkpoint:
    ``state_dict()`` / ``load_state_dict()``.
    """

    def __init__(self) -> None:
        self.worker_error: torch.Tensor | None = None  # (N,) fp32
        self.server_error: torch.Tensor | None = None  # (N / W,) fp32
        self._server_sum: torch.Tensor | None = None  # work buffer reused between calls, not saved

    def reset(self) -> None:
        """Forget the accumulated errors (e.g. when the compressed phase restarts)."""
        self.worker_error = self.server_error = self._server_sum = None

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        return {"worker_error": self.worker_error, "server_error": self.server_error}

    def load_state_dict(self, state: dict[str, torch.Tensor | None]) -> None:
        unknown = set(state) - {"worker_error", "server_error"}
        if unknown:
            raise ValueError(f"OneBitState: unknown keys {sorted(unknown)}")
        we, se = state.get("worker_error"), state.get("server_error")
        if (we is None) != (se is None):
            raise ValueError("OneBitState: worker_error and server_error must both be set or None")
        if we is not None and we.numel() % se.numel():
            raise ValueError(f"OneBitState: server_error of {se.numel()} elements does not divide "
                             f"worker_error of {we.numel()}")
        self.worker_error = None if we is None else we.detach().float().clone()
        self.server_error = None if se is None else se.detach().float().clone()
        self._server_sum = None

    def _buffers(self, padded: int, world_size: int, device: torch.device):
        if self.worker_error is None:
            self.worker_error = torch.zeros(padded, device=device)
            self.server_error = torch.zeros(padded // world_size, device=device)
        if self.worker_error.device != device:  # restored from host memory (a checkpoint)
            self.worker_error = self.worker_error.to(device)
            self.server_error = self.server_error.to(device)
        if self.worker_error.numel() != padded or self.server_error.numel() != padded // world_size:
            raise ValueError(
                f"OneBitState holds errors for {self.worker_error.numel()} padded elements, this "
                f"call needs {padded} (one state per tensor; reset() after changing its size)")
        return self.worker_error, self.server_error



class Folded(NamedTuple):
    """An input of ``numel`` elements that adds itself into the worker error buffer
    (``fold(e)`` does e[:numel] += x) instead of being formed first: what the 1-bit
    optimizers pass for a momentum step read from its packed form (kernels.onebit.momentum_)."""

    numel: int
    device: torch.device
    fold: Callable[[torch.Tensor], None]


def padded_numel(numel: int, world_size: int) -> int:
    """numel rounded up to a multiple of W * lcm(W, 8), so every chunk packs into whole bytes."""
    unit = world_size * math.lcm(world_size, 8)
    return -(-numel // unit) * unit


def _with_scales(packed_WB: torch.Tensor, scales_W: torch.Tensor) -> torch.Tensor:
    """Append each row's fp32 scale as 4 bytes: (W, B) uint8 -> (W, B + 4)."""
    scale_bytes = scales_W.contiguous().view(torch.uint8).view(-1, _SCALE_BYTES)
    return torch.cat([packed_WB, scale_bytes.to(packed_WB.device)], dim=1)


def _split_scales(msg_WB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of _with_scales: (W, B + 4) -> packed (W, B), scales (W,)."""
    scales = msg_WB[:, -_SCALE_BYTES:].contiguous().view(torch.float32).reshape(-1)
    return msg_WB[:, :-_SCALE_BYTES], scales


def compressed_allreduce(tensor: torch.Tensor, state: OneBitState, group: Communicator,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The 1-bit mean of ``tensor`` over ``group`` with error feedback in ``state``.

    Returns a tensor of the input's shape and dtype, identical on every rank (written into
    ``out`` when given: a float32 tensor of padded_numel(numel, W) elements, the result being
    its first numel). Over repeated calls the running mean of the outputs tends to the true mean.
    """
    signs, scales = compressed_allreduce_packed(tensor, state, group)
    mean = unpack_mean(signs, scales, tensor.numel(), out)
    return mean.view(tensor.shape).to(tensor.dtype)


def compressed_allreduce_packed(tensor: torch.Tensor, state: OneBitState, group: Communicator
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed_allreduce before its last unpacking: the mean is exactly ``scales[j] *
    sign`` over chunk j, the signs packed in ``signs[j]``: (W, N / 8W) uint8 and (W,) float32,
    identical on every rank. A caller that keeps the mean can keep it in this form (N/8 bytes
    and W scales instead of 4N bytes) and lose nothing."""
    return compressed_allreduce_many([(tensor, state)], group)[0]


def compressed_allreduce_many(items: Iterable[tuple[torch.Tensor | Folded, OneBitState]],
                              group: Communicator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``compressed_allreduce_packed`` of several tensors, each with its own state and scales
    (the same numbers as one call each), in one all_to_all and one all_gather: every rank's
    message to rank j is each tensor's chunk j in turn. A model's 50 tensors cost two
    operations, not 100, each of which pays the link's latency and waits for the slowest
    rank. ``items`` is read once, a tensor at a time: each is folded into its error buffer
    and packed before the next is asked for (a generator may make each on the fly, or pass a
    ``Folded`` that adds itself into the error buffer)."""
    W = group.world_size
    packs, states = [], []
    for tensor, state in items:  # worker side: m = x + e_w, its signs and scale, e_w updated
        folded = isinstance(tensor, Folded)
        N = padded_numel(tensor.numel if folded else tensor.numel(), W)
        worker_error, _ = state._buffers(N, W, tensor.device)
        if folded:
            tensor.fold(worker_error)
        scale = accumulate_(worker_error, None if folded else tensor)
        packs.append((pack_update_(worker_error, scale).view(W, N // W // 8), scale))
        states.append(state)
    # Rank j receives chunk j of every rank's signs, each followed by that rank's scale.
    incoming = group.all_to_all(torch.cat([_with_scales(p, s.expand(W)) for p, s in packs], 1))
    widths = [p.shape[1] + _SCALE_BYTES for p, _ in packs]
    replies, at = [], 0
    for state, width in zip(states, widths):  # server side: this rank's chunk of each tensor
        signs_WB, scales_W = _split_scales(incoming[:, at:at + width])
        at += width
        server_error = state.server_error
        if state._server_sum is None or state._server_sum.shape != server_error.shape:
            state._server_sum = torch.empty_like(server_error)
        c = state._server_sum
        for i in range(W):
            unpack_(signs_WB[i].contiguous(), c, scales_W[i], accumulate=i > 0)
        server_error += c.div_(W)  # c = mean_i(s_i * sign_i) + e_s, formed in e_s's buffer
        server_scale = accumulate_(server_error)
        server_packed = pack_update_(server_error, server_scale)
        replies.append(_with_scales(server_packed.view(1, -1), server_scale)[0])
    gathered = group.all_gather(torch.cat(replies))  # (W, sum of widths)
    out, at = [], 0
    for width in widths:
        out.append(_split_scales(gathered[:, at:at + width]))  # (W, chunk/8), (W,)
        at += width
    return out


def unpack_mean(signs: torch.Tensor, scales: torch.Tensor, n: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``n`` elements of a packed mean (``compressed_allreduce_packed``'s result) as
    float32, written into ``out`` (padded_numel(n, W) elements) when given."""
    W, B = signs.shape
    N = W * B * 8
    if out is None:
        out = torch.empty(N, device=signs.device)
    elif out.numel() != N or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 with padded_numel({n}, {W}) = {N} elements")
    for j, part in enumerate(out.view(W, N // W)):
        unpack_(signs[j].contiguous(), part, scales[j])
    return out[:n]
