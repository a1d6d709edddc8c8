"""The decode step in a few native calls per layer (troupe.kernels.decode_layers) gives the
hidden states of GPT.hidden for one new token per sequence, for fp32 packed and W8A8 layers,
with grouped-query heads, a qkv bias, widths that are not multiples of 16, heads that do not
span the width, q and k norms, YaRN's scaled rotations and a sliding window, over left-padded
rows; the engine's tokens are the same with it and without it."""

import pytest
import torch

from troupe.compression.quantize import quantize_model
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.kernels import small_gemm
from troupe.generation.decode_layers import DecodeLayers, _extension
from troupe.models import GPT, GPTConfig, KVCache

pytestmark = pytest.mark.skipif(_extension() is None or not small_gemm.available(),
                                reason="no C++ compiler")



@pytest.fixture(autouse=True, params=["packed", "mkl"])
def product(request, monkeypatch):
    """Both products a layer may have been given on a machine (small_gemm.choices)."""
    monkeypatch.setenv("TROUPE_DECODE_PRODUCT", request.param)
    return request.param


LLAMA = dict(positions="rope", norm="rmsnorm", mlp="swiglu", out_bias=False, mlp_bias=False)


def _model(seed=0, **kw):
    cfg = dict(vocab_size=97, seq_len=64, n_layer=3, n_head=4, d_model=64, d_ff=88, **LLAMA)
    return GPT(GPTConfig(**{**cfg, **kw}), seed=seed).eval()


def _steps(model, fused, steps=5):
    """Prefill three left-padded prompts, then ``steps`` decode steps; each step's hidden
    states from GPT.hidden and from ``fused`` on copies of the same cache."""
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 5]
    P = max(lengths)
    idx = torch.randint(0, model.cfg.vocab_size, (3, P), generator=g)
    valid = torch.tensor([[c >= P - n for c in range(P)] for n in lengths])
    cache = KVCache.empty(model.cfg, 3, P + steps)
    with torch.no_grad():
        model.hidden(idx, valid_BS=valid, cache=cache)
        twin = KVCache([t.clone() for t in cache.k], [t.clone() for t in cache.v], cache.length)
        out = []
        for _ in range(steps):
            valid = torch.cat([valid, valid.new_ones(3, 1)], 1)
            tok = torch.randint(0, model.cfg.vocab_size, (3, 1), generator=g)
            want, _ = model.hidden(tok, valid_BS=valid, cache=cache)
            got = fused.hidden(tok, valid, twin)
            out.append((got, want[:, 0]))
        assert twin.length == cache.length
        for a, b in zip(twin.k + twin.v, cache.k + cache.v):
            torch.testing.assert_close(a[:, :, :cache.length], b[:, :, :cache.length],
                                       rtol=1e-5, atol=1e-5)
    return out


@pytest.mark.parametrize("kw", [
    dict(n_kv_head=2), dict(n_kv_head=1, qkv_bias=True), dict(n_kv_head=4, d_ff=40),
    dict(n_kv_head=2, head_dim=32),  # 4 heads of 32 over a width of 64 (Mistral-Nemo's layout)
    dict(n_kv_head=2, qk_norm=True),  # Qwen3
    dict(n_kv_head=2, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                        original_max_position_embeddings=16)),
    dict(n_kv_head=2, sliding_window=4, sliding_layers=[1, 2])])  # rows of up to 12 tokens
def test_fp32_packed_layers_give_the_hidden_states_of_the_model(kw):
    model = _model(**kw)
    fused = DecodeLayers.of(model, small_gemm.DecodeWeights(model))
    assert fused is not None
    for got, want in _steps(model, fused):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_w8a8_layers_give_the_hidden_states_of_the_quantized_model():
    model = _model(n_kv_head=2)
    quantize_model(model, {"*": "w8a8"})
    want = [m.qw.q.clone() for m in model.modules() if hasattr(m, "int8_operands")]
    # a server's copy: the INT8 weights move onto huge pages, the same values
    fused = DecodeLayers.of(model, small_gemm.DecodeWeights(model, huge_pages=True))
    assert all(torch.equal(a, m.qw.q) for a, m in zip(
        want, [m for m in model.modules() if hasattr(m, "int8_operands")]))
    for got, want in _steps(model, fused):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layers_of_other_kinds_are_called_back_and_mixed_with_the_native_ones():
    """Weight-only INT4 attention (its own kernel, called back through Python) beside W8A8
    MLPs (the native kernel) and fp32 products of another model's rows."""
    model = _model(n_kv_head=2)
    quantize_model(model, {"*.attn.*": "w4a16", "*.ffn.*": "w8a8"})
    fused = DecodeLayers.of(model, small_gemm.DecodeWeights(model))
    # the step's norms sum in another order than the model's, and where a token's value sits
    # at a rounding edge of the W8A8 quantization the last bits move its integer by one: 1e-4
    for got, want in _steps(model, fused):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_weights_changed_in_place_or_replaced_are_decoded_from():
    """The engine's step after ``weights_changed``: the tokens of a fresh engine on the new
    weights (trained in place, and with a bias replaced by a new tensor)."""
    model = _model(seed=3, n_kv_head=2, vocab_size=257, qkv_bias=True)
    prompt = list(b"sort 4213:")
    engine = ContinuousBatcher(model, 256, max_batch=2)
    engine.add("a", prompt, SamplingParams(max_tokens=16))
    before = engine.run()["a"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        block = model.blocks[1].attn.qkv
        block.bias = torch.nn.Parameter(torch.randn_like(block.bias))
    engine.weights_changed()
    engine.add("b", prompt, SamplingParams(max_tokens=16))
    after = engine.run()["b"]
    fresh = ContinuousBatcher(model, 256, max_batch=2)
    fresh.add("c", prompt, SamplingParams(max_tokens=16))
    assert after == fresh.run()["c"] != before


def test_the_step_gives_logits_greedy_tokens_and_which_rows_are_finite():
    """The step's logits are the model's (an output projection of its own here: the tied one
    is the engine test's), its greedy tokens their argmax; a row whose token embeds to an
    infinity is reported not finite, alone."""
    model = _model(n_kv_head=2, tie_embeddings=False)
    fused = DecodeLayers.of(model, small_gemm.DecodeWeights(model))
    assert fused.has_logits and fused.own_embedding
    prompt = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(3, 7, dtype=torch.bool)
    valid[0, :2] = False                               # a left-padded row
    tokens = torch.tensor([[5], [9], [11]])
    with torch.no_grad():
        for poisoned in (False, True):
            if poisoned:
                model.tok_emb.weight[9, 3] = float("inf")  # the step reads it in place
            cache = KVCache.empty(model.cfg, 3, 8)
            model.hidden(prompt, valid_BS=valid[:, :6], cache=cache)
            twin = KVCache([t.clone() for t in cache.k], [t.clone() for t in cache.v], 6)
            h, _ = model.hidden(tokens, valid_BS=valid, cache=cache)
            want = model.logits(h[:, 0])
            logits, greedy, finite = fused.logits(tokens, valid, twin)
            assert finite == [True, not poisoned, True]
            rows = [0, 2] if poisoned else [0, 1, 2]
            torch.testing.assert_close(logits[rows], want[rows], rtol=1e-5, atol=1e-5)
            assert [greedy[r] for r in rows] == want[rows].argmax(-1).tolist()


def test_models_it_does_not_cover_get_none():
    assert DecodeLayers.of(GPT(GPTConfig(vocab_size=97, seq_len=32, n_layer=1, n_head=2,
                                         d_model=32)), None) is None          # GPT-2 style
    assert DecodeLayers.of(_model(d_model=40, n_head=4), None) is None        # head size 10


def test_engine_tokens_with_and_without_the_fused_step():
    model = _model(seed=3, n_kv_head=2, vocab_size=257)
    prompts = [list(b"sort 4213:"), list(b"hello"), list(b"a")]
    out = []
    for fused in (False, True):
        engine = ContinuousBatcher(model, 256, max_batch=4)
        assert engine.fused is not None
        if not fused:
            engine.fused = None
        for i, p in enumerate(prompts):
            engine.add(str(i), p, SamplingParams(max_tokens=24))
        out.append(engine.run())
    assert out[0] == out[1]


def test_adapters_apply_per_row_and_a_rows_step_does_not_depend_on_its_neighbours():
    """LoRA adapters (troupe.models.adapters) over W8A8 layers in the native step: the hidden
    states of GPT.hidden with each row's adapter, and a row's step bit for bit the same alone
    as beside others (the INT8 product is per row; the adapters' products pad one row to two,
    whose sums the kernel orders as any other count's)."""
    from troupe.kernels.quant import vnni_available
    from troupe.models.adapters import Adapter, Adapters

    if not vnni_available():
        pytest.skip("the native W8A8 product needs AVX-512 VNNI")
    model = _model(n_kv_head=2)
    quantize_model(model, {"*": "w8a8"})
    adapters, g = Adapters(model), torch.Generator().manual_seed(1)
    for i, r in enumerate((4, 8)):
        pairs = {name: (torch.randn(r, m.in_features, generator=g) * 0.2,
                        torch.randn(m.out_features, r, generator=g) * 0.2)
                 for name, m in model.named_modules() if name.endswith(("qkv", "ffn.proj"))}
        adapters.add(Adapter(f"a{i}", pairs))
    fused = DecodeLayers.of(model, small_gemm.DecodeWeights(model))
    assert fused is not None and not fused.routed
    names = ["a1", None, "a0"]
    idx = torch.randint(0, 97, (3, 6), generator=g)
    valid = torch.ones(3, 7, dtype=torch.bool)
    tok = torch.randint(0, 97, (3, 1), generator=g)
    with torch.no_grad():
        cache = KVCache.empty(model.cfg, 3, 8)
        with adapters.routed(names):
            model.hidden(idx, valid_BS=valid[:, :6], cache=cache)
        copies = [KVCache([t.clone() for t in cache.k], [t.clone() for t in cache.v], 6)
                  for _ in range(2)]
        with adapters.routed(names):
            want, _ = model.hidden(tok, valid_BS=valid, cache=cache)
        got = fused.hidden(tok, valid, copies[0], adapters.slot_ids(names))
        torch.testing.assert_close(got, want[:, 0], rtol=1e-4, atol=1e-4)
        first = KVCache([t[:1].clone() for t in copies[1].k], [t[:1].clone() for t in copies[1].v],
                        6)
        alone = fused.hidden(tok[:1], valid[:1], first, adapters.slot_ids(names[:1]))
    assert torch.equal(alone[0], got[0])
    assert not torch.allclose(got[0], fused.hidden(tok[:1], valid[:1], KVCache(
        [t[:1].clone() for t in copies[1].k], [t[:1].clone() for t in copies[1].v], 6))[0])
