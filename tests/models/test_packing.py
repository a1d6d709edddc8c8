"""Packed batches (troupe.models.packing): the real tokens of a left-padded batch in fewer rows,
each sample attending to itself only, give the padded batch's values and gradients (1e-6)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from troupe.models import GPT, GPTConfig
from troupe.models.packing import Packing, segment_mask, segment_positions


def left_padded(lengths: list[int], S: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), S), generator=g)
    valid = torch.zeros(len(lengths), S, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, S - n:] = True
    return ids, valid


def test_a_packing_by_hand():
    valid = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1], [0, 1, 1, 1]]).bool()
    p = Packing.of(valid)
    # longest first: row 1 (4) alone, row 3 (3) then row 0 (2) does not fit, row 2 (1) does
    assert p.segments_PT.tolist() == [[1, 1, 1, 1], [3, 3, 3, 2], [0, 0, -3, -3]]
    assert p.padding() == pytest.approx((6 / 16, 2 / 12))
    x = torch.arange(16).view(4, 4)
    assert p.pack(x, fill=-9).tolist() == [[4, 5, 6, 7], [13, 14, 15, 11], [2, 3, -9, -9]]
    assert torch.equal(p.unpack(p.pack(x)), torch.where(valid, x, 0))
    assert segment_positions(p.segments_PT).tolist() == [[0, 1, 2, 3], [0, 1, 2, 0],
                                                         [0, 1, 0, 1]]
    m = segment_mask(p.segments_PT)[1, 0]
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]


def test_a_row_longer_than_the_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity=3"):
        Packing.of(torch.ones(2, 4, dtype=torch.bool), capacity=3)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=7), st.integers(9, 14))
def test_pack_then_unpack_keeps_every_real_token(lengths, capacity):
    ids, valid = left_padded(lengths, 9, 100)
    p = Packing.of(valid, capacity)
    packed = p.pack(ids, fill=-1)
    assert (packed >= 0).sum() == valid.sum()
    assert p.packed_shape[1] <= capacity
    assert torch.equal(p.unpack(packed), torch.where(valid, ids, 0))
    for row in p.segments_PT:  # each sample one run of its own id
        runs = torch.unique_consecutive(row[row >= 0])
        assert len(runs) == len(set(runs.tolist()))


ARCHS = {
    "llama": dict(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, out_bias=False,
                  mlp_bias=False),
    "gpt2": dict(),  # learned positions
    # Mistral's sliding window, shorter than the rows, in one layer of two
    "sliding": dict(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, out_bias=False,
                    mlp_bias=False, sliding_window=4, sliding_layers=[1]),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_and_padded_give_the_same_values_and_gradients(arch):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, seq_len=16, n_layer=2, n_head=4, d_model=32, **ARCHS[arch])
    ids, valid = left_padded([16, 3, 9, 1, 12, 5], 16, 97)

    def run(packed: bool):
        model = GPT(cfg, seed=0).double()
        if packed:
            p = Packing.of(valid)
            h = p.unpack(model.hidden(p.pack(ids), segments_BT=p.segments_PT)[0])
        else:
            h = model.hidden(ids, valid_BS=valid)[0]
        h = torch.where(valid[..., None], h, 0)
        logits = model.logits(h)
        loss = (logits.log_softmax(-1)[..., 0] * valid).sum()
        loss.backward()
        return h, {n: q.grad for n, q in model.named_parameters()}

    (h1, g1), (h2, g2) = run(False), run(True)
    torch.testing.assert_close(h2, h1, rtol=0, atol=1e-6)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=0, atol=1e-6, msg=name)
