"""ZeRO-3's schedule on one process (troupe.parallel.zero3): each block's gradient is reduced as
soon as its backward is done, whatever carries the gradient into it (a keyword input, no
input at all when the embedding is frozen), so that only a few blocks are ever whole at once;
the gradients are the unpartitioned model's; and the forward's recorded order, not the blocks'
indices, is what the backward prefetches in."""

import pytest
import torch
from torch import nn

from troupe.parallel.zero3 import UnitState, Zero3

WIDTH, BLOCKS = 8, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, mask, h=None, scale=None):
        out = torch.tanh(self.lin(h)) * mask
        return out * scale if scale is not None else out


class Toy(nn.Module):
    """Blocks called with a tensor that needs no gradient first and the hidden states as a
    keyword; ``order`` runs them in another order than their indices."""

    def __init__(self, order=None, scaled=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.scale = nn.Parameter(torch.full((WIDTH,), 1.5)) if scaled else None
        self.order = order or list(range(BLOCKS))

    def forward(self, x):
        h, mask = self.emb(x), torch.ones(WIDTH)
        for i in self.order:
            h = self.blocks[i](mask, h=h, scale=self.scale)
        return h.square().mean()


def _whole_during_backward(z: Zero3, model: Toy) -> list[int]:
    """How many blocks are not sharded each time a block's output gradient arrives."""
    seen = []

    def count(grad):
        seen.append(sum(u.state is not UnitState.SHARDED for u in z.units))

    for block in model.blocks:
        block.register_forward_hook(lambda m, a, out: out.register_hook(count) and None)
    return seen


@pytest.mark.parametrize("frozen_embedding,scaled", [(False, False), (True, False),
                                                     (False, True)])
def test_each_block_is_reduced_when_its_backward_is_done(frozen_embedding, scaled):
    ref = Toy(scaled=scaled)
    model = Toy(scaled=scaled)
    for m in (ref, model):
        m.emb.requires_grad_(not frozen_embedding)
    z = Zero3(model, None, prefetch=1)
    seen = _whole_during_backward(z, model)
    x = torch.randn(3, WIDTH)
    for _ in range(2):  # two micro-batches: the shards accumulate
        model(x).backward()
        ref(x).backward()
    assert seen and max(seen) <= 3, seen  # this block, the one prefetched, one reducing
    assert all(u.state is UnitState.SHARDED for u in z.units)
    z.release()
    want = torch.cat([p.grad.reshape(-1) for p in ref.blocks.parameters()])
    dense = z.buckets["dense"]  # one rank: each partition unpadded, the root's first
    got = torch.cat([dense.grad[o:o + part.numel]
                     for part, o in zip(dense.partitions[1:], dense.offsets[1:])])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_backward_prefetches_in_the_forwards_recorded_order():
    order = [3, 0, 5, 1, 4, 2]
    model = Toy(order=order)
    z = Zero3(model, None, prefetch=1)
    gathered = []
    real = z._gather_async

    def spy(unit):
        if unit.state is UnitState.SHARDED and unit.index >= 0:
            gathered.append(unit.index)
        real(unit)
    z._gather_async = spy
    model(torch.randn(2, WIDTH)).backward()  # the first forward prefetches by index
    assert gathered[-BLOCKS:] == order[::-1]  # its backward: the forward's order reversed
    gathered.clear()
    model(torch.randn(2, WIDTH)).backward()
    assert gathered == order + order[::-1]    # then each forward in the order recorded


def test_the_stream_gives_every_parameter_whole_with_a_block_or_two_gathered():
    """Zero3.stream (what a stage-3 policy's weight sync reads): every parameter in the order
    of named_parameters, with its values, while no more than the root and two blocks (the
    one read, the next prefetched) are whole; everything sharded again at its end."""
    ref, model = Toy(scaled=True), Toy(scaled=True)
    z = Zero3(model, None, prefetch=1)
    want = dict(ref.named_parameters())
    seen, most = [], 0
    for name, p in z.stream():
        most = max(most, sum(u.state is not UnitState.SHARDED for u in z.units))
        torch.testing.assert_close(p.detach(), want[name], rtol=0, atol=0)
        seen.append(name)
    assert seen == list(want) and most <= 2, (seen, most)
    assert all(u.state is UnitState.SHARDED for u in [z.root, *z.units])


def test_stage2_gathers_each_block_once_a_step_and_reduces_in_the_backward():
    """Stage 2: over two micro-batches every unit is gathered once and stays whole until
    release; a block's gradient is reduce-scattered while the blocks before it run their
    backward (when the first block's output gradient arrives, those two blocks down are in
    their shards already); the gradients are the unpartitioned model's, bit for bit."""
    ref, model = Toy(scaled=True), Toy(scaled=True)
    z = Zero3(model, None, prefetch=1, stage=2)
    gathered, reduced_early = [], []
    real = z._gather_async

    def spy(unit):
        if unit.state is UnitState.SHARDED:
            gathered.append(unit.index)
        real(unit)
    z._gather_async = spy
    dense = z.buckets["dense"]

    def in_shards(grad):  # block 0's output gradient: the backward of blocks 1.. is done
        reduced_early.append([bool(dense.grad[o:o + part.numel].abs().sum() > 0) for part, o
                              in zip(dense.partitions[3:], dense.offsets[3:])])
    model.blocks[0].register_forward_hook(lambda m, a, out: out.register_hook(in_shards) and None)
    x = torch.randn(3, WIDTH)
    for _ in range(2):
        model(x).backward()
        ref(x).backward()
        assert all(u.state is not UnitState.SHARDED for u in [z.root, *z.units])
    assert sorted(gathered) == list(range(-1, BLOCKS)), gathered  # each unit once
    assert reduced_early and all(all(r) for r in reduced_early), reduced_early
    z.release()
    assert all(u.state is UnitState.SHARDED for u in [z.root, *z.units])
    want = torch.cat([p.grad.reshape(-1) for p in ref.blocks.parameters()])
    got = torch.cat([dense.grad[o:o + part.numel]
                     for part, o in zip(dense.partitions[1:], dense.offsets[1:])])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="stage must be 2 or 3"):
        Zero3(Toy(), None, stage=1)
