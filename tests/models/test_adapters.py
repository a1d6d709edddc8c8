"""Many LoRA adapters over one base (troupe.models.adapters): a PEFT directory's adapter, applied
per row in a batch that mixes four adapters and the base, gives each sequence the tokens of its
adapter merged into the base weights (merged in Hugging Face's layout, apart from troupe's
mapping) and served alone."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.generation.prefix_cache import PrefixCache
from troupe.models import from_pretrained
from troupe.models.adapters import Adapters, load_peft

transformers = pytest.importorskip("transformers")
PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
        "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("llama"))


def make_base(d):
    """A tiny random Llama saved as a Hugging Face directory ``d``, the adapters' base."""
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def write_adapter(base_dir, out, seed: int, targets=tuple(PROJ), r=4, alpha=8):
    """A PEFT LoRA directory with random A and B, and the base merged with it (HF layout)."""
    g = torch.Generator().manual_seed(seed)
    weights = load_file(str(base_dir / "model.safetensors"))
    lora = {}
    for i in range(2):
        for proj in targets:
            name = f"model.layers.{i}.{PROJ[proj]}.{proj}"
            W = weights[f"{name}.weight"]
            A = torch.randn(r, W.shape[1], generator=g) * 0.3
            B = torch.randn(W.shape[0], r, generator=g) * 0.3
            lora[f"base_model.model.{name}.lora_A.weight"] = A
            lora[f"base_model.model.{name}.lora_B.weight"] = B
            weights[f"{name}.weight"] = W + alpha / r * (B @ A)
    (out / "adapter").mkdir(parents=True)
    save_file(lora, str(out / "adapter" / "adapter_model.safetensors"))
    (out / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets)}))
    (out / "merged").mkdir()
    save_file(weights, str(out / "merged" / "model.safetensors"), metadata={"format": "pt"})
    (out / "merged" / "config.json").write_text((base_dir / "config.json").read_text())
    return out / "adapter", out / "merged"


def greedy(engine, requests):
    for sid, prompt, adapter in requests:
        engine.add(sid, prompt, SamplingParams(max_tokens=8, adapter=adapter))
    out = {}
    while engine.has_work():
        for ev in engine.step():
            assert ev.error is None, ev.error
            out.setdefault(ev.seq_id, []).append(ev.token)
    return out


def test_four_adapters_in_one_batch_equal_each_merged_alone(base, tmp_path):
    targets = [tuple(PROJ), ("q_proj", "v_proj"), ("o_proj", "down_proj"), ("gate_proj",)]
    dirs = [write_adapter(base, tmp_path / f"a{i}", i, t) for i, t in enumerate(targets)]
    model = from_pretrained(base).eval()
    adapters = Adapters(model)
    for i, (adapter_dir, _) in enumerate(dirs):
        adapters.add(load_peft(adapter_dir, model, name=f"a{i}"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (6 + i,), generator=g).tolist() for i in range(10)]
    requests = [(f"r{i}", p, None if i % 5 == 4 else f"a{i % 5}") for i, p in enumerate(prompts)]
    for cache in (None, PrefixCache(block=4)):
        mixed = greedy(ContinuousBatcher(model, None, max_batch=10, prefix_cache=cache,
                                         adapters=adapters),
                       requests + [(f"again{i}", p, a) for i, (_, p, a) in
                                   enumerate(requests)])
        for i, (_, merged_dir) in enumerate(dirs + [(None, base)]):
            alone = from_pretrained(merged_dir).eval()
            mine = [(sid, p) for sid, p, a in requests if a == (f"a{i}" if i < 4 else None)]
            want = greedy(ContinuousBatcher(alone, None), [(sid, p, None) for sid, p in mine])
            for sid, _ in mine:
                assert mixed[sid] == want[sid], (sid, i)
                assert mixed[f"again{sid[1:]}"] == want[sid]
    # the base's weights are untouched: without an adapter the base's tokens
    assert adapters.slots == {"a0": 0, "a1": 1, "a2": 2, "a3": 3}


def test_an_adapter_on_heads_wider_than_the_width_over_the_heads(tmp_path):
    """q, k and v's rows follow head_dim (Mistral-Nemo's layout), not hidden_size: an adapter
    on every projection gives the merged model's tokens."""
    cfg = transformers.MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=2, num_attention_heads=4, head_dim=32,
                                     num_key_value_heads=2, max_position_embeddings=128,
                                     sliding_window=None)
    torch.manual_seed(0)
    transformers.MistralForCausalLM(cfg).save_pretrained(tmp_path / "base")
    adapter_dir, merged_dir = write_adapter(tmp_path / "base", tmp_path / "a", seed=3)
    model = from_pretrained(tmp_path / "base").eval()
    adapters = Adapters(model)
    adapters.add(load_peft(adapter_dir, model, name="a"))
    prompt = torch.randint(0, 300, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    mixed = greedy(ContinuousBatcher(model, None, adapters=adapters), [("x", prompt, "a")])
    alone = greedy(ContinuousBatcher(from_pretrained(merged_dir).eval(), None),
                   [("x", prompt, None)])
    assert mixed == alone


def test_prompts_sharing_an_opening_under_one_adapter(base, tmp_path):
    """An opening (20 tokens) that every prompt shares, prefilled once under their adapter:
    each sequence's tokens equal the merged model's alone."""
    adapter_dir, merged_dir = write_adapter(base, tmp_path / "a", 7)
    model = from_pretrained(base).eval()
    adapters = Adapters(model)
    adapters.add(load_peft(adapter_dir, model, name="a"))
    g = torch.Generator().manual_seed(6)
    opening = torch.randint(0, 300, (20,), generator=g).tolist()
    prompts = [opening + torch.randint(0, 300, (n,), generator=g).tolist() for n in (2, 5, 3)]
    engine = ContinuousBatcher(model, None, max_batch=3, adapters=adapters)
    got = greedy(engine, [(f"r{i}", p, "a") for i, p in enumerate(prompts)])
    assert engine.prefill_tokens == 20 + 2 + 5 + 3
    want = greedy(ContinuousBatcher(from_pretrained(merged_dir).eval(), None),
                  [(f"r{i}", p, None) for i, p in enumerate(prompts)])
    assert got == want


def test_what_does_not_fit_is_named(base, tmp_path):
    model = from_pretrained(base).eval()
    adapter_dir, _ = write_adapter(base, tmp_path / "x", 0)
    with pytest.raises(ValueError, match="adapter: 'nope' is not loaded"):
        ContinuousBatcher(model, None, adapters=Adapters(model)).add(
            "x", [1, 2], SamplingParams(adapter="nope"))
    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**conf, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match="only LORA"):
        load_peft(adapter_dir, model)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_peft(tmp_path, model)


@pytest.mark.parametrize("weights", ["fp32", "w8a8"])
def test_the_native_step_runs_adapters_added_after_the_engine_was_built(base, tmp_path,
                                                                       weights):
    """A decode step in one native call (troupe.generation.decode_layers) applies each row's
    adapter there: adapters loaded after the engine was built (as the server's admin endpoint
    loads them) are seen, and every sequence gets the tokens of the step run from Python."""
    from troupe.compression import quantize_model
    from troupe.kernels.quant import vnni_available

    if weights == "w8a8" and not vnni_available():
        pytest.skip("the native W8A8 product needs AVX-512 VNNI")
    dirs = [write_adapter(base, tmp_path / f"a{i}", 10 + i, r=4 + 4 * i)[0] for i in range(2)]
    g = torch.Generator().manual_seed(8)
    requests = [(f"r{i}", torch.randint(0, 300, (5 + i,), generator=g).tolist(),
                 [None, "a0", "a1"][i % 3]) for i in range(6)]
    tokens = {}
    for native in (True, False):
        model = from_pretrained(base).eval()
        if weights == "w8a8":
            quantize_model(model, {"*": "w8a8"})
        adapters = Adapters(model)
        engine = ContinuousBatcher(model, None, max_batch=6, adapters=adapters,
                                   packed_decode=native)
        if native and engine.fused is None:
            pytest.skip("no native decode step here (no compiler)")
        for i, d in enumerate(dirs):
            adapters.add(load_peft(d, model, name=f"a{i}"))
        tokens[native] = greedy(engine, requests)
        if native:  # rebuilt with the adapters: no layer of this model is called back
            assert engine.fused is not None and not engine.fused.routed
    assert tokens[True] == tokens[False]
    assert len({tuple(t) for t in tokens[True].values()}) == len(requests)
