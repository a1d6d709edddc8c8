"""The engine's per-row cache (troupe.generation.slots, troupe.models.RowCache): rows of their
own lengths, advancing by different counts, give each row the hidden states it gets alone;
sequences join by being written into free slots and leave without the other rows moving."""

import random

import pytest
import torch

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.generation.decode_layers import DecodeLayers, _extension
from troupe.generation.slots import Slots
from troupe.kernels import small_gemm
from troupe.models import GPT, GPTConfig

LLAMA = dict(positions="rope", norm="rmsnorm", mlp="swiglu", out_bias=False, mlp_bias=False)
ARCHS = [{}, dict(**LLAMA, n_kv_head=1),
         dict(**LLAMA, n_kv_head=2, sliding_window=4, sliding_layers=[1])]


def _model(**kw):
    cfg = dict(vocab_size=97, seq_len=64, n_layer=2, n_head=4, d_model=64)
    return GPT(GPTConfig(**{**cfg, **kw}), seed=1).eval()


@torch.no_grad()
def _alone(model, ids):
    """Every position's final hidden state of ``ids`` run whole, without a cache."""
    return model.hidden(torch.tensor([ids]))[0][0]


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_rows_that_advance_by_different_counts_get_what_they_get_alone(arch):
    """Three rows prefilled right-padded (7, 2, 5 tokens), then passes in which they advance
    by (1, 3, 2) and (2, 1, 1) tokens: every real token's hidden state is its row's alone,
    as speculative decoding's verification needs."""
    model = _model(**arch)
    g = random.Random(0)
    rows = [[g.randrange(97) for _ in range(n)] for n in (7, 2, 5)]
    slots = Slots(model.cfg, 4, 1, 4, "cpu", torch.float32)  # grows to fit
    for step in ([7, 2, 5], [1, 3, 2], [2, 1, 1]):
        T = max(step)
        new = [[g.randrange(97) for _ in range(n)] for n in step] if step[0] != 7 else rows
        idx = torch.tensor([x + [0] * (T - len(x)) for x in new])
        h, _ = model.hidden(idx, cache=slots.view(0, 3, T, step))
        if step[0] != 7:
            rows = [r + x for r, x in zip(rows, new)]
        for b, n in enumerate(step):
            want = _alone(model, rows[b])[-n:]
            torch.testing.assert_close(h[b, :n], want, rtol=1e-5, atol=1e-5)
    assert slots.host[:3] == [len(r) for r in rows] and slots.lengths.tolist()[:3] == slots.host[:3]


@pytest.mark.skipif(_extension() is None or not small_gemm.available(), reason="no C++ compiler")
@pytest.mark.parametrize("arch", ARCHS[1:])
@torch.no_grad()
def test_the_native_step_writes_each_row_at_its_own_column(arch):
    """The one-call decode step (troupe.generation.decode_layers) over rows of 6, 1 and 4
    positions gives GPT.hidden's states and writes each row's keys at its own column."""
    model = _model(**arch)
    fused = DecodeLayers.of(model, small_gemm.DecodeWeights(model))
    assert fused is not None
    twins = [Slots(model.cfg, 3, 3, 16, "cpu", torch.float32) for _ in range(2)]
    prompts = [[5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]
    idx = torch.tensor([p + [0] * (6 - len(p)) for p in prompts])
    for s in twins:
        model.hidden(idx, cache=s.view(0, 3, 6, [len(p) for p in prompts]))
    for token in ([[1], [2], [3]], [[4], [5], [6]]):
        want, _ = model.hidden(torch.tensor(token), cache=twins[0].view(0, 3, 1))
        got = fused.hidden(torch.tensor(token), None, twins[1].view(0, 3, 1))
        torch.testing.assert_close(got, want[:, 0], rtol=1e-5, atol=1e-5)
    assert twins[0].host == twins[1].host == [8, 3, 6]
    for a, b in zip(twins[0].k + twins[0].v, twins[1].k + twins[1].v):
        for row, n in enumerate(twins[0].host):
            torch.testing.assert_close(a[row, :, :n], b[row, :, :n], rtol=1e-5, atol=1e-5)


def test_joining_and_leaving_copy_no_other_row(monkeypatch):
    """Sequences join into free slots and leave without the cache being copied: a leaving
    sequence's slot goes to the last row (whose positions are the only ones copied), one that
    leaves from the end copies nothing, a join with room copies nothing and the cache's
    storage never moves; each sequence's greedy tokens are those it gets alone."""
    model = _model(**LLAMA, n_kv_head=2)
    copies = []
    copy = Slots.copy
    monkeypatch.setattr(Slots, "copy", lambda self, src, dst: (copies.append((src, dst)),
                                                                copy(self, src, dst))[1])
    engine = ContinuousBatcher(model, None, max_batch=4)
    prompts = {sid: [10 + i, 2, 3] for i, sid in enumerate("abcd")}
    lengths = {"a": 3, "b": 9, "c": 5, "d": 12}
    for sid, n in lengths.items():
        engine.add(sid, prompts[sid], SamplingParams(max_tokens=n))
    got: dict[str, list[int]] = {}
    orders = []
    while engine.has_work():
        for ev in engine.step():
            got.setdefault(ev.seq_id, []).append(ev.token)
        orders.append("".join(s.seq_id for s in engine.active))
        if orders[-1] == "d" and "e" not in lengths:  # a new sequence joins the one left
            storage = engine.slots.k[0].data_ptr()
            engine.add("e", [9, 9], SamplingParams(max_tokens=2))
            lengths["e"], prompts["e"] = 2, [9, 9]
    # "a" (slot 0) left: "d" took its slot; "c" (then last) and "b" left from the end
    assert [o for i, o in enumerate(orders) if i == 0 or o != orders[i - 1]] == \
        ["abcd", "dbc", "db", "d", "de", "d", ""]
    assert copies == [(3, 0)]
    assert engine.slots.k[0].data_ptr() == storage  # the cache itself never moved
    for sid, n in lengths.items():
        one = ContinuousBatcher(model, None, max_batch=1)
        one.add("x", prompts[sid], SamplingParams(max_tokens=n))
        assert got[sid] == one.run()["x"], sid
