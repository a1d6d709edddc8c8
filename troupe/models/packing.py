"""Packed batches: the real tokens of a padded batch laid end to end in fewer, fuller rows,
each sample a segment that attends only to itself (GPT.hidden's ``segments_BT``).

A padded batch of B rows of S columns holds sum(valid) real tokens; its padding is computed
and thrown away (in RL batches, where prompts and responses vary in length, half the work or
more). ``Packing.of(valid_BS)`` places every row's real tokens, in order, in packed rows of at
most ``capacity`` tokens (first-fit decreasing: the longest rows first, each into the first
packed row with room), and ``pack`` / ``unpack`` carry tensors between the two layouts:

    packing = Packing.of(valid_BS)
    h_PTC = model.hidden(packing.pack(ids_BS), segments_BT=packing.segments_PT)[0]
    h_BSC = packing.unpack(h_PTC)   # as model.hidden(ids_BS, valid_BS=valid_BS), zeros at padding

Inside a segment positions count from 0 and attention is causal, exactly as a left-padded
row's real tokens see each other (positions counting real tokens only), so the values and
gradients at real tokens are those of the padded batch up to the order of float sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packing:
    """Where each real token of a (B, S) batch sits in the packed (P, T) one.

    src_N: the flat index (b * S + s) of each real token, row-major; dst_N: its flat index
    (p * T + t) in the packed batch; segments_PT: the padded row each packed position came
    from (-1 - p for the packing's own padding at the end of packed row p)."""

    src_N: torch.Tensor
    dst_N: torch.Tensor
    segments_PT: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def of(cls, valid_BS: torch.Tensor, capacity: int | None = None) -> "Packing":
        """Pack the real tokens (``valid_BS`` True) of each row into rows of at most
        ``capacity`` tokens (default S, the padded length; a row longer than the capacity
        is an error: a sample is never split)."""
        B, S = valid_BS.shape
        capacity = S if capacity is None else capacity
        lengths = valid_BS.sum(1).tolist()
        if max(lengths, default=0) > capacity:
            raise ValueError(f"a row of {max(lengths)} tokens does not fit a packed row of "
                             f"capacity={capacity}")
        fill: list[int] = []              # tokens in each packed row so far
        place = [(0, 0)] * B              # (packed row, offset) of each padded row
        for b in sorted(range(B), key=lambda b: -lengths[b]):
            p = next((p for p, f in enumerate(fill) if f + lengths[b] <= capacity), len(fill))
            if p == len(fill):
                fill.append(0)
            place[b] = (p, fill[p])
            fill[p] += lengths[b]
        P, T = max(len(fill), 1), max(fill, default=0) or 1
        device = valid_BS.device
        # each real token's row and rank within its row, then its packed position
        src = valid_BS.flatten().nonzero().squeeze(1)
        row = src // S
        rank = valid_BS.long().cumsum(1).flatten()[src] - 1
        p_B = torch.tensor([p for p, _ in place], dtype=torch.long, device=device)
        o_B = torch.tensor([o for _, o in place], dtype=torch.long, device=device)
        dst = p_B[row] * T + o_B[row] + rank
        segments = -1 - torch.arange(P, device=device)[:, None].expand(P, T).clone()
        segments.view(-1)[dst] = row
        return cls(src, dst, segments, (B, S))

    @property
    def packed_shape(self) -> tuple[int, int]:
        return tuple(self.segments_PT.shape)

    def pack(self, x_BS: torch.Tensor, fill=0) -> torch.Tensor:
        """(B, S, ...) -> (P, T, ...): the real positions moved, the rest ``fill``."""
        B, S = self.shape
        P, T = self.packed_shape
        flat = x_BS.reshape(B * S, *x_BS.shape[2:])
        out = flat.new_full((P * T, *x_BS.shape[2:]), fill)
        out[self.dst_N] = flat[self.src_N]
        return out.view(P, T, *x_BS.shape[2:])

    def unpack(self, y_PT: torch.Tensor) -> torch.Tensor:
        """(P, T, ...) -> (B, S, ...): the real positions moved back, zeros at padding
        (differentiable: gradients reach the packed positions they came from)."""
        B, S = self.shape
        P, T = self.packed_shape
        flat = y_PT.reshape(P * T, *y_PT.shape[2:])
        out = flat.new_zeros((B * S, *y_PT.shape[2:]))
        out = out.index_copy(0, self.src_N, flat.index_select(0, self.dst_N))
        return out.view(B, S, *y_PT.shape[2:])

    def padding(self) -> tuple[float, float]:
        """The fraction of positions that are padding: (in the padded batch, packed)."""
        real = self.src_N.numel()
        B, S = self.shape
        P, T = self.packed_shape
        return 1.0 - real / max(B * S, 1), 1.0 - real / max(P * T, 1)


def segment_positions(segments_BT: torch.Tensor) -> torch.Tensor:
    """Each position's index within its segment (a run of equal ids): 0, 1, ... restarting
    wherever the id changes."""
    B, T = segments_BT.shape
    t = torch.arange(T, device=segments_BT.device).expand(B, T)
    starts = torch.ones_like(segments_BT, dtype=torch.bool)
    starts[:, 1:] = segments_BT[:, 1:] != segments_BT[:, :-1]
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(1).values
    return t - first


def segment_mask(segments_BT: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean attention mask: causal, within a segment."""
    T = segments_BT.shape[1]
    t = torch.arange(T, device=segments_BT.device)
    same = segments_BT[:, :, None] == segments_BT[:, None, :]
    return (same & (t[None, :] <= t[:, None])).unsqueeze(1)
