"""The packed fp32 product for decoding: equal to F.linear for few rows (odd shapes, bias),
used only inside ``active()`` and only for few-row inputs without autograd, and an engine that
decodes with it gives the tokens of one that does not."""

import pytest
import torch
import torch.nn.functional as F

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.kernels import small_gemm
from troupe.models import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not small_gemm.available(), reason="no C++ compiler")


@pytest.fixture(autouse=True)
def packed_everywhere(monkeypatch):
    """These tests are about the packed product: taken wherever it may be, whatever this
    machine measured for the tiny shapes (test_measured_choice_is_cached_and_followed)."""
    monkeypatch.setenv("TROUPE_DECODE_PRODUCT", "packed")


@pytest.mark.parametrize("N, K", [(576, 576), (1536, 576), (33, 64), (8, 16), (200, 96)])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16])
def test_packed_product_equals_linear(N, K, M):
    g = torch.Generator().manual_seed(N * K + M)
    w, b, x = (torch.randn(N, K, generator=g), torch.randn(N, generator=g),
               torch.randn(M, K, generator=g))
    packed = small_gemm.pack(w)
    assert packed.shape == ((N + 15) // 16, K, 16)
    torch.testing.assert_close(small_gemm.linear(x, packed, N, b), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(small_gemm.linear(x[:, None], packed, N),  # (M, 1, K) in
                               F.linear(x, w)[:, None], rtol=1e-5, atol=1e-4)


def test_active_switches_only_few_rows_without_grad():
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=1, n_head=2, d_model=32), seed=0)
    weights = small_gemm.DecodeWeights(model)
    lin = model.blocks[0].attn.qkv
    assert lin in weights.layers and weights.logits_weight is not None
    calls = []
    real = small_gemm.linear
    small_gemm.linear = lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1]
    try:
        with weights.active(), torch.no_grad():
            lin(torch.randn(4, 32))            # few rows: packed
            lin(torch.randn(40, 32))           # many rows: F.linear
        with weights.active():
            lin(torch.randn(4, 32))            # autograd on the weight: F.linear
        lin(torch.randn(4, 32))                # outside: the class's forward
    finally:
        small_gemm.linear = real
    assert calls == [(4, 32)]
    assert "forward" not in vars(lin)


@pytest.mark.parametrize("arch", [{}, dict(positions="rope", norm="rmsnorm", mlp="swiglu",
                                           n_kv_head=1, out_bias=False, mlp_bias=False,
                                           tie_embeddings=False)])
def test_engine_tokens_with_and_without_packed_weights(arch):
    model = GPT(GPTConfig(vocab_size=257, seq_len=64, n_layer=2, n_head=2, d_model=32, **arch),
                seed=1)
    prompts = [list(b"sort 4213:"), list(b"hello"), list(b"a")]
    out = []
    for packed in (False, True):
        engine = ContinuousBatcher(model, 256, max_batch=4, packed_decode=packed)
        for i, p in enumerate(prompts):
            engine.add(str(i), p, SamplingParams(max_tokens=20))
        out.append(engine.run())
    assert out[0] == out[1]


def test_kept_weights_refresh_in_place_after_a_change():
    """RLHF's policy keeps its packed weights between rollouts (step3.keep_decode_weights):
    after the weights change, a refresh packs them into the same buffers, and generation
    gives the tokens of freshly packed weights."""
    from troupe.rlhf.models.lm import GPTLM
    lm = GPTLM(GPT(GPTConfig(vocab_size=257, seq_len=64, n_layer=2, n_head=2, d_model=40),
                   seed=2))  # d_model 40: the qkv rows (120) are not a multiple of 16
    prompts = [list(b"sort 321:"), list(b"xy")]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in (1, 2)]
    lm.generate(prompts, params, 256, keep_packed=True)
    buffers = {id(t) for t in lm._packed.layers.values()}
    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(1.5)
    kept = lm.generate(prompts, params, 256, keep_packed=True)[0]
    assert {id(t) for t in lm._packed.layers.values()} == buffers
    fresh = small_gemm.DecodeWeights(lm.gpt)
    assert all(torch.equal(lm._packed.layers[m], fresh.layers[m]) for m in fresh.layers)
    assert kept == lm.generate(prompts, params, 256)[0]


def test_measured_choice_is_cached_and_followed(monkeypatch, tmp_path):
    """The choice between the packed product and MKL's is measured once per shape and machine
    (a file under the cache), then read; a layer uses the packed product only for the rows
    where it was chosen (here: more than SMALL_ROWS), F.linear for the others."""
    monkeypatch.delenv("TROUPE_DECODE_PRODUCT")
    monkeypatch.setenv("TROUPE_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(small_gemm, "_packed_wins",
                        lambda N, K, rows: measured.append((N, K, rows)) or rows > 4)
    assert small_gemm.choices({(96, 32), (32, 32)}) == {(96, 32): (False, True),
                                                       (32, 32): (False, True)}
    # few rows (1-4) measured at 4: one row alone favours MKL where 2-4 favour the packed one
    assert sorted(measured) == [(32, 32, 4), (32, 32, 8), (96, 32, 4), (96, 32, 8)]
    [path] = (tmp_path / "kernels").glob("decode-product-*.json")
    assert small_gemm.choices({(96, 32)}) == {(96, 32): (False, True)} and len(measured) == 4
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=1, n_head=2, d_model=32), seed=0)
    weights = small_gemm.DecodeWeights(model)
    lin = model.blocks[0].attn.qkv
    calls = []
    real = small_gemm.linear
    small_gemm.linear = lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k))[1]
    try:
        with weights.active(), torch.no_grad():
            for rows in (1, 4, 5, 16):
                x = torch.randn(rows, 32)
                torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias),
                                           rtol=1e-5, atol=1e-5)
    finally:
        small_gemm.linear = real
    assert calls == [5, 16]  # the packed product for 5 and 16 rows, F.linear for 1 and 4
