"""Hugging Face checkpoints through troupe's decoder: the same logits as transformers (fp32)
on tiny random Llama, Qwen2, Qwen3, Mistral, GPT-2, Mixtral, Qwen2-MoE and Qwen3-MoE models
built offline (among them rotary scaling linear, llama3 and yarn, sliding windows, and heads
wider than hidden_size / num_attention_heads), and an export that transformers loads back to
the same logits."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from troupe.config import ConfigError  # noqa: E402
from troupe.models import GPT, GPTConfig, from_pretrained, save_pretrained  # noqa: E402
from troupe.models.hf_config import check_pretrained  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128)


def _llama(**over):
    return transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 2, **over})


CONFIGS = {
    "llama-gqa": lambda: (transformers.LlamaForCausalLM, _llama()),
    "llama3-rope-scaling-untied": lambda: (transformers.LlamaForCausalLM, _llama(
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-linear-rope": lambda: (transformers.LlamaForCausalLM, _llama(
        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # YaRN as DeepSeek's configs give it: an attention factor from mscale and mscale_all_dim
    "llama-yarn-mscale": lambda: (transformers.LlamaForCausalLM, _llama(
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                      "beta_fast": 16, "mscale": 0.707, "mscale_all_dim": 1.0})),
    "qwen2": lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **TINY, num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen2.5's long-context recipe, as its model cards give it
    "qwen2-yarn": lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **TINY, num_key_value_heads=2, rope_scaling={
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral": lambda: (transformers.MistralForCausalLM, transformers.MistralConfig(
        **TINY, num_key_value_heads=1, sliding_window=None)),
    # Mistral 7B v0.1's sliding window (4096 there), shorter than the tests' sequences
    "mistral-sliding-window": lambda: (transformers.MistralForCausalLM, transformers.MistralConfig(
        **TINY, num_key_value_heads=2, sliding_window=6)),
    "qwen2-sliding-window": lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **TINY, num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
        max_window_layers=1)),
    # heads wider than hidden_size / num_attention_heads, as Mistral-Nemo's 32 x 128 over 5120
    "mistral-head-dim": lambda: (transformers.MistralForCausalLM, transformers.MistralConfig(
        **TINY, num_key_value_heads=2, head_dim=16, sliding_window=None)),
    "gpt2": lambda: (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=97, n_positions=128, n_embd=32, n_layer=2, n_head=4)),
    "mixtral": lambda: (transformers.MixtralForCausalLM, MIXTRAL()),
    # q and k RMS-normalised per head, heads of 16 over a width of 32, as Qwen3's 128 over 1024
    "qwen3": lambda: (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        **TINY, num_key_value_heads=2, head_dim=16)),
    # no shared expert; top-k weights renormalised; block 1 dense
    "qwen3-moe": lambda: (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        **{**TINY, "num_hidden_layers": 3}, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
        mlp_only_layers=[1], norm_topk_prob=True)),
    # a shared expert, top-k weights not renormalised, block 1 dense, narrower experts
    "qwen2-moe": lambda: (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
        **{**TINY, "num_hidden_layers": 3}, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False)),
}


def MIXTRAL():
    return transformers.MixtralConfig(**TINY, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=None)


@pytest.fixture(params=list(CONFIGS))
def hf_dir(request, tmp_path):
    cls, cfg = CONFIGS[request.param]()
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", model


def _ids():
    return torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(1))


def test_same_logits_as_transformers(hf_dir):
    path, reference = hf_dir
    ours = from_pretrained(path)
    ids = _ids()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        got = ours(ids)[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mistral-sliding-window", "qwen2-sliding-window",
                                  "llama-yarn-mscale", "qwen3", "mistral-head-dim"])
def test_same_logits_on_cuda(name, tmp_path):
    """The attention variants on the GPU (masks, scaled rotations and q/k norms built on the
    device): transformers' CPU logits, left-padded rows too."""
    cls, cfg = CONFIGS[name]()
    torch.manual_seed(0)
    reference = cls(cfg).eval()
    reference.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf").cuda()
    ids = _ids()
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[0, :4] = False
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=valid.long()).logits
        got = ours.logits(ours.hidden(ids.cuda(), valid_BS=valid.cuda())[0]).cpu()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)


def test_left_padded_batches_and_the_cache_agree_with_a_plain_forward(hf_dir):
    """Positions count real tokens only (rotary too), and decoding with the KV cache gives
    the logits of recomputing the whole sequence."""
    from troupe.models.attention import KVCache
    path, _ = hf_dir
    model = from_pretrained(path)
    ids = _ids()[:1, :12]
    with torch.no_grad():
        plain = model(ids)[0][0, -1]
        padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
        valid = torch.cat([torch.zeros(1, 5, dtype=torch.bool),
                           torch.ones(1, 12, dtype=torch.bool)], 1)
        left = model.logits(model.hidden(padded, valid_BS=valid)[0])[0, -1]
        cache = KVCache.empty(model.cfg, 1, 32)
        model.hidden(ids[:, :-1], cache=cache)
        step = model.logits(model.hidden(ids[:, -1:], cache=cache)[0])[0, -1]
    torch.testing.assert_close(left, plain, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(step, plain, atol=2e-5, rtol=1e-4)


def test_greedy_generation_of_64_tokens_equals_transformers(hf_dir):
    """troupe's engine (KV cache, its sampler at temperature 0) and transformers' generate
    choose the same 64 tokens after the same prompt."""
    from troupe.generation import ContinuousBatcher, SamplingParams
    path, reference = hf_dir
    prompt = _ids()[0, :9]
    reference.generation_config.eos_token_id = None  # 64 tokens whatever they are
    with torch.no_grad():
        want = reference.generate(prompt[None], attention_mask=torch.ones(1, 9, dtype=torch.long),
                                  max_new_tokens=64, do_sample=False, pad_token_id=0)[0, 9:]
    assert len(want) == 64
    engine = ContinuousBatcher(from_pretrained(path), None, max_batch=1)
    engine.add("g", prompt.tolist(), SamplingParams(max_tokens=64))
    assert engine.run()["g"] == want.tolist()


def test_export_loads_in_transformers_with_the_same_logits(hf_dir, tmp_path):
    path, _ = hf_dir
    ours = from_pretrained(path)
    save_pretrained(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ours(ids)[0], atol=2e-5,
                                   rtol=1e-4)


def test_troupes_own_gpt_exports_as_gpt2(tmp_path):
    model = GPT(GPTConfig(vocab_size=97, seq_len=32, n_layer=2, n_head=2, d_model=32), seed=3)
    save_pretrained(model, tmp_path / "gpt")
    assert json.loads((tmp_path / "gpt" / "config.json").read_text())["model_type"] == "gpt2"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt").eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, model(ids)[0], atol=2e-5,
                                   rtol=1e-4)


def test_errors_name_the_architecture_and_the_tensor(tmp_path, hf_dir):
    path, _ = hf_dir
    cfg = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    with pytest.raises(ValueError, match="model_type 'falcon' is not supported; troupe loads gpt2"):
        from_pretrained(bad)
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    (bad / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="is in no safetensors file"):
        from_pretrained(bad)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    """A real pretrained model (Llama architecture, GQA 9/3 heads, rope theta 1e5, tied
    embeddings): troupe's decoder gives transformers' fp32 logits, and greedy generation of 64
    tokens through troupe's engine gives transformers' greedy tokens."""
    from troupe.generation import ContinuousBatcher, SamplingParams
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    text = tok.apply_chat_template([{"role": "user", "content": "Tell me a story about a "
                                     "lighthouse keeper."}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text)])
    ours = from_pretrained(smollm2)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(smollm2).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], theirs(input_ids=ids).logits, atol=1e-4,
                                   rtol=1e-4)
        want = theirs.generate(ids, max_new_tokens=64, do_sample=False,
                               pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
    assert len(want) == 64 and tok.eos_token_id not in want.tolist()  # a long answer
    engine = ContinuousBatcher(ours, tok.eos_token_id, max_batch=1)
    engine.add("q", ids[0].tolist(), SamplingParams(max_tokens=64))
    assert engine.run()["q"] == want.tolist()


@pytest.mark.slow
def test_smollm2_streams_whole_characters_through_the_engine(smollm2):
    """With the model's tokenizer the engine's text deltas add up to the tokenizer's decode of
    the tokens (stop at eos), each delta whole characters."""
    from troupe.generation import ContinuousBatcher, SamplingParams
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    model = from_pretrained(smollm2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write café and 🎉 twice."}],
                                     tokenize=True, add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) else prompt
    engine = ContinuousBatcher(model, tok.eos_token_id, max_batch=1, tokenizer=tok)
    engine.add("s", list(prompt), SamplingParams(max_tokens=24, temperature=0.7, seed=3))
    events = engine.run_events()
    tokens = [e.token for e in events if e.token is not None]
    deltas = [e.delta for e in events]
    assert "".join(deltas) == tok.decode(tokens, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


def test_quantization_and_lkd_apply_to_every_architecture(hf_dir):
    """W8A8 (MoE experts included, gates kept fp32) stays close to the fp32 logits, and
    ZeroQuant's layer-by-layer distillation runs on each family and does not make a block's
    held-out error worse."""
    from troupe.compression import layerwise_distill, quantize_model
    from troupe.compression.quantize import QuantizedExperts
    path, _ = hf_dir
    model, ids = from_pretrained(path), _ids()
    with torch.no_grad():
        want = model(ids)[0]
    student, report = layerwise_distill(model, {"*": "w8a8"}, [ids, _ids().flip(0)],
                                        steps_per_layer=4, check_every=2)
    assert len(report) == model.cfg.n_layer and all(after <= before for before, after in report)
    done = quantize_model(model, {"*": "w8a8"})
    assert all(mode == "w8a8" for mode in done.values()) and "blocks.0.attn.qkv" in done
    if model.cfg.moe is not None:
        assert isinstance(model.blocks[0].ffn.experts, QuantizedExperts)
        assert isinstance(student.blocks[0].ffn.experts, QuantizedExperts)
        assert type(model.blocks[0].ffn.gate.wg) is torch.nn.Linear  # routing stays fp32
    with torch.no_grad():
        for got in (model(ids)[0], student(ids)[0]):
            assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.fixture
def llama_dir(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama()).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


@pytest.mark.parametrize("config, match", [
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be a positive integer"),
    ({"num_attention_heads": "4"}, "num_attention_heads='4' must be a positive integer"),
    ({"num_attention_heads": 5, "head_dim": None}, "n_head=5 must divide d_model=32"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
     "rope_type 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": "4"}}, "yarn scaling needs positive"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}},
     "yarn scaling: beta_fast=-1 must be a positive number"),
    ({"rope_scaling": {"rope_type": "linear"}}, "linear scaling needs positive numbers factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 scaling needs positive"),
    ({"hidden_size": 1 << 30, "head_dim": None}, "hidden_size: Input should be less than or"),
])
def test_a_hostile_config_json_is_one_line_naming_the_key(llama_dir, config, match):
    cfg = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**cfg, **config}))
    with pytest.raises(ValueError, match=match) as e:
        from_pretrained(llama_dir)
    assert "config.json" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=match):  # what the apps check before Ray starts
        check_pretrained(str(llama_dir))


def test_a_sliding_window_slides_where_config_json_says(tmp_path):
    """Which layers slide, read as transformers reads them; and the window changes the logits
    (so the sliding configurations above would fail without it)."""
    from troupe.models.hf_config import read_config
    for name, cls, cfg, layers in [
            ("nowhere", transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
                **TINY, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                max_window_layers=2), None),
            ("off", transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
                **TINY, num_key_value_heads=2, use_sliding_window=False, sliding_window=8), None),
            ("qwen2", transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
                **TINY, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                max_window_layers=1), [1]),
            ("mistral", transformers.MistralForCausalLM, transformers.MistralConfig(
                **TINY, num_key_value_heads=2, sliding_window=8), "all")]:
        cls(cfg).save_pretrained(tmp_path / name)
        ours = read_config(tmp_path / name)
        assert (ours.sliding_layers or "all" if ours.sliding_window else None) == layers, name
    windowed = from_pretrained(tmp_path / "mistral")
    unbounded = GPT(windowed.cfg.model_copy(update=dict(sliding_window=None)))
    unbounded.load_state_dict(windowed.state_dict())
    with torch.no_grad():
        assert (windowed(_ids())[0] - unbounded(_ids())[0]).abs().max() > 1e-3
        torch.testing.assert_close(windowed(_ids()[:, :8])[0], unbounded(_ids()[:, :8])[0])
    cfg = json.loads((tmp_path / "mistral" / "config.json").read_text())
    (tmp_path / "mistral" / "config.json").write_text(json.dumps({**cfg, "sliding_window": "8"}))
    with pytest.raises(ValueError, match="config.json: sliding_window='8' must be a positive"):
        read_config(tmp_path / "mistral")


@pytest.mark.parametrize("key, value", [("scale_attn_by_inverse_layer_idx", True),
                                        ("scale_attn_weights", False)])
def test_gpt2_attention_scaled_otherwise_is_refused_not_loaded(tmp_path, key, value):
    """Either flag changes GPT-2's logits; troupe's attention has neither, so it refuses."""
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=1, n_head=4, **{key: value})
    ).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=f"{key}={value!r} is not supported"):
        from_pretrained(tmp_path / "gpt2")


def test_config_json_that_is_not_an_object_or_not_json(llama_dir):
    for text, match in (("[1, 2]", "holds a list, not a JSON object"), ("{oops", "not valid JSON")):
        (llama_dir / "config.json").write_text(text)
        with pytest.raises(ConfigError, match=match):
            check_pretrained(str(llama_dir))


def test_a_model_too_big_for_the_machine_is_refused_before_allocating(llama_dir):
    import psutil
    cfg = json.loads((llama_dir / "config.json").read_text())
    big = {"hidden_size": 16384, "intermediate_size": 65536, "num_hidden_layers": 512,
           "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 1 << 17,
           "head_dim": 128}
    (llama_dir / "config.json").write_text(json.dumps({**cfg, **big}))
    have = psutil.virtual_memory().total / 2**30
    with pytest.raises(ValueError, match=rf"weights need \d+\.\d GiB in torch.float32, more "
                                         rf"than the {have:.1f} GiB of cpu memory here"):
        from_pretrained(llama_dir)


@pytest.mark.parametrize("damage", ["header size", "not json", "not an object", "offsets",
                                    "shape"])
def test_a_damaged_safetensors_header_is_named(llama_dir, damage):
    path = llama_dir / "model.safetensors"
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    name = next(k for k in header if k != "__metadata__")
    if damage == "header size":
        out = (1 << 60).to_bytes(8, "little") + data[8:]
    elif damage == "not json":
        out = data[:8] + b"\xff" * size + data[8 + size:]
    else:
        if damage == "not an object":
            header = [1, 2]
        elif damage == "offsets":
            header[name]["data_offsets"] = [0, 1 << 50]
        else:
            header[name]["shape"] = [1 << 40, 1 << 20]  # 4 PiB, if it were believed
        raw = json.dumps(header).encode()
        out = len(raw).to_bytes(8, "little") + raw + data[8 + size:]
    path.write_bytes(out)
    with pytest.raises(ValueError, match="model.safetensors") as e:
        from_pretrained(llama_dir)
    assert "not a safetensors file" in str(e.value) or repr(name) in str(e.value)
