"""What the 1-bit optimizers (troupe.optim.onebit) share: the chunk layout of their state, the
1-bit mean of a tensor's momentum with its error feedback, the momentum kept packed, and the
state's save and load. Each optimizer's own arithmetic is in troupe.optim.onebit.

Their state is whole on every rank (as in DeepSpeed) or, with ``shard_state``, partitioned
the way the compression already partitions the work. compressed_allreduce makes rank r the server of chunk r of every tensor (see
troupe.optim.chunks): with ``shard_state`` rank r also owns the variance (and LAMB's fresh
variance) of those chunks, updates the parameters of its chunks from the mean it serves, and
all-gathers the updated parameters. What stays whole, and why:

- the momentum: each rank forms its next local momentum from the whole mean, and compresses it
  whole. After a compressed step that mean *is* 1 bit per element (a sign and a scale per chunk),
  so 1-bit Adam and 1-bit LAMB keep it packed: N/8 bytes instead of 4N, sharded or not;
- the worker error feedback: the residual of compressing this rank's own momentum (the server
  error is 1/W already);
- 0/1 Adam's state after var_freeze_step: every rank then takes local steps on all of its
  parameters, which needs the frozen variance whole; it is all-gathered once at the freeze.

The price is the parameter all-gather (4N (W-1)/W bytes per step, fp32), on top of the 1-bit
messages (about N/4 (W-1)/W): half of ZeRO-1 Adam's bytes, against 1/32 of them with the whole
state (benchmarks/RESULTS.md). Sharded and unsharded runs are equal bit for
bit: the same reductions (a reduce-scatter of the gradients in the chunk layout, then an
all-gather of the mean where the rows are whole) and the same element-wise arithmetic.
"""

from __future__ import annotations

import torch

from troupe.collectives import (Communicator, Folded, OneBitState, compressed_allreduce_many,
                                padded_numel, unpack_mean)
from troupe.kernels.onebit import momentum_, unpack_
from troupe.optim.base import Optimizer
from troupe.optim.chunks import ChunkLayout
from troupe.optim.flat import FlatParams


class CompressedOptimizer(Optimizer):
    """Shared plumbing: the chunk layout and its rows (``rows``: the ones this rank keeps), the
    1-bit mean of a tensor's momentum (each tensor compressed on its own with its own scale, as
    in DeepSpeed: one scale for the whole buffer would give small-gradient tensors the magnitude
    of large ones), the packed momentum, and error-feedback states saved with the optimizer."""

    def __init__(self, flat: FlatParams, group: Communicator | None, grad_scale: float,
                 shard_state: bool):
        super().__init__(flat, group, grad_scale)
        self.layout = ChunkLayout(flat.segments, self.world)
        self.all_rows = list(range(self.world))
        self.rows = [group.rank] if shard_state and self.world > 1 else self.all_rows
        self.sharded = len(self.rows) < self.world
        self.m_signs: torch.Tensor | None = None  # (W, S/8) uint8: the packed momentum
        self.m_scales: torch.Tensor | None = None  # (W, T): its scale per chunk
        self.m_divisor: torch.Tensor | None = None  # (T,): what the packed mean is divided by

    def _init_onebit(self, *names: str) -> None:
        self.onebit: dict[str, list[OneBitState]] = {
            name: [OneBitState() for _ in self.flat.segments] for name in names}

    # -- rows of the chunk layout ------------------------------------------------------------

    def _zeros_rows(self) -> torch.Tensor:
        return torch.zeros(len(self.rows), self.layout.S, device=self.flat.device)

    def _gather_rows(self, x_1S: torch.Tensor, dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
        """All W rows from each rank's one (travelling in ``dtype``)."""
        wire = x_1S[0].to(dtype)
        parts = self.group.all_gather(wire)
        self.comm.all_gather(wire.numel() * wire.element_size(), self.world)
        return parts.float()

    def _whole(self, x_RS: torch.Tensor) -> torch.Tensor:
        """All W rows of a layout tensor this rank holds ``rows`` of."""
        return self._gather_rows(x_RS) if self.sharded else x_RS

    def _params(self) -> torch.Tensor:
        return self.layout.gather(self.flat.data, self.rows)

    def _publish(self, p_RS: torch.Tensor) -> None:
        """Updated parameter rows into the flat buffer, all-gathered when sharded."""
        self.layout.scatter(self._whole(p_RS), self.all_rows, self.flat.data)

    def _mean_grad_rows(self) -> torch.Tensor:
        """Rows ``rows`` of the group's mean gradient: a reduce-scatter in the chunk layout
        (then an all-gather when the rows are whole: the bytes of one allreduce)."""
        g = self.layout.gather(self.flat.grad, self.all_rows)
        if self.world > 1:
            mine = self._reduce_scatter_mean(g.view(-1)).view(1, -1)
            g = mine if self.sharded else self._gather_rows(mine, self.reduce_dtype)
        return g.mul_(self.grad_scale) if self.grad_scale != 1.0 else g

    def _per_element(self, x_T: torch.Tensor) -> torch.Tensor:
        """A per-tensor value at each element of the rows (a (1, S) view for all of them)."""
        return self.layout.expand(x_T).unsqueeze(0)

    def _tensor_sums(self, x_RS: torch.Tensor) -> torch.Tensor:
        """(T,): each tensor's sum over all ranks' rows, summed row by row in rank order."""
        return self._whole(self.layout.row_sums(x_RS, self.rows)).sum(0)[:self.layout.T]

    def _tensor_maxes(self, x_RS: torch.Tensor) -> torch.Tensor:
        return self._whole(self.layout.row_maxes(x_RS, self.rows)).amax(0)[:self.layout.T]

    # -- the compressed momentum -------------------------------------------------------------

    def _local_grad(self) -> torch.Tensor:
        g = self.flat.grad[:self.flat.numel]
        return g * self.grad_scale if self.grad_scale != 1.0 else g

    def _onebit_mean(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x`` (flat, whole) replaced by its 1-bit mean over the group, tensor by tensor."""
        if self.world == 1:
            return x
        parts = [x[offset:offset + n] for offset, n in self.flat.segments]
        means = compressed_allreduce_many(zip(parts, self.onebit[name]), self.group)
        for part, (signs, scales) in zip(parts, means):
            part.copy_(unpack_mean(signs, scales, part.numel()))
            self.comm.compressed(padded_numel(part.numel(), self.world), self.world)
        return x

    def _compress_momentum(self, b1: float, g: torch.Tensor,
                           scaling: torch.Tensor | None = None) -> None:
        """One compressed momentum step, kept packed: each tensor k's momentum becomes
        (b1 * m_k + (1 - b1) * g_k) * scaling[k] and its 1-bit mean over the group is stored;
        ``g`` is this rank's gradient, flat. Before the first such step the last momentum is
        the fp32 rows ``m`` (gone afterwards); from then on it is the packed mean, read in
        place: the step is folded into the error buffer it is compressed from, one pass over
        each tensor (kernels.onebit.momentum_), the fp32 momentum never formed."""
        W, L, segments = self.world, self.layout, self.flat.segments
        if self.m_signs is None:
            self._alloc_packed()
        if self.m is not None:
            previous = self._whole(self.m)

            def momenta():  # each tensor's, made when the exchange asks for it
                for k, state in enumerate(self.onebit["m"]):
                    offset, n = segments[k]
                    m_k = L.tensor_of(previous, k).mul_(b1).add_(g[offset:offset + n],
                                                                 alpha=1 - b1)
                    yield (m_k if scaling is None else m_k.mul_(scaling[k])), state
        else:
            # the last mean is sign * m_scales[j, k] / m_divisor[k] over chunk j of tensor k
            scales = self.m_scales.tolist()  # (W, T), on the host: one copy, not one per chunk
            divisors = self.m_divisor.tolist() if self.m_divisor is not None else [1.0] * L.T
            factors = scaling.tolist() if scaling is not None else [1.0] * L.T

            def fold(k: int, e: torch.Tensor) -> None:
                offset, C, s = segments[k][0], L.chunks[k], L.starts[k] // 8
                for j in range(W):
                    lo, length = L.span(k, j)
                    if length:
                        momentum_(e[lo:lo + length], self.m_signs[j, s:s + C // 8],
                                  g[offset + lo:offset + lo + length],
                                  b1 * scales[j][k] / divisors[k] * factors[k],
                                  (1 - b1) * factors[k])

            def momenta():
                for k, state in enumerate(self.onebit["m"]):
                    yield Folded(segments[k][1], self.flat.device,
                                 lambda e, k=k: fold(k, e)), state

        means = compressed_allreduce_many(momenta(), self.group)  # one exchange for them all
        for k, ((_, n), (signs, scales)) in enumerate(zip(segments, means)):
            self.comm.compressed(padded_numel(n, W), W)
            s = L.starts[k] // 8
            self.m_signs[:, s:s + L.chunks[k] // 8].copy_(signs)
            self.m_scales[:, k].copy_(scales)
        self.m = None

    def _alloc_packed(self) -> None:
        dev = self.flat.device
        self.m_signs = torch.zeros(self.world, self.layout.S // 8, dtype=torch.uint8, device=dev)
        self.m_scales = torch.zeros(self.world, self.layout.T, device=dev)

    def _unpacked_rows(self) -> torch.Tensor:
        """Rows ``rows`` of the mean momentum (divided by m_divisor per tensor)."""
        out = self._zeros_rows()
        for i, j in enumerate(self.rows):
            unpack_(self.m_signs[j], out[i], 1.0)
            out[i].mul_(self.layout.expand(self.m_scales[j]))
        return out.div_(self._per_element(self.m_divisor)) if self.m_divisor is not None else out

    # -- state ------------------------------------------------------------------------------

    def _packed_state(self) -> dict[str, torch.Tensor]:
        return {"m_signs": self.m_signs, "m_scales": self.m_scales}

    def _prepare(self, t: int) -> None:
        """Allocate the buffers the state after step ``t`` has (they change at a phase
        boundary), for load_state_dict. Here: the momentum ``m`` of 1-bit Adam and LAMB, fp32
        rows up to ``freeze_step``, packed after it (when there is a group to compress over)."""
        if t > self.freeze_step and self.world > 1:
            if self.m_signs is None:
                self._alloc_packed()
            self.m = None
        elif self.m is None:
            self.m, self.m_signs, self.m_scales = self._zeros_rows(), None, None

    def state_bytes(self) -> int:
        errors = [t for states in self.onebit.values() for st in states
                  for t in st.state_dict().values() if t is not None]
        return super().state_bytes() + sum(t.numel() * t.element_size() for t in errors)

    def state_dict(self, copy: bool = True) -> dict:
        state = super().state_dict(copy)
        state["onebit"] = {name: [{k: v.clone() if copy else v for k, v in st.state_dict().items()
                                   if v is not None} for st in states]
                           for name, states in self.onebit.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self._prepare(int(state["t"]))
        super().load_state_dict(state)
        for name, states in self.onebit.items():
            saved = state["onebit"].get(name, [])
            if len(saved) != len(states):
                raise ValueError(f"optimizer state {name!r}: error feedback for {len(saved)} "
                                 f"tensors, this model has {len(states)}")
            for st, errors in zip(states, saved):
                st.reset()
                if errors:
                    st.load_state_dict(errors)
