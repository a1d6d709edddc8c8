"""Quantized model directories: what quantize_model made, written as its integers and read
back to the same logits, for tied and untied models of several families; bad directories
refused naming the file and the layer."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from troupe.compression import quantize_model  # noqa: E402
from troupe.compression.artifact import (MANIFEST, TENSORS, is_quantized_dir,  # noqa: E402
                                         load_quantized, save_quantized)
from troupe.models import from_pretrained  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128)
FAMILIES = {
    "qwen2-tied": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **TINY, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-untied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **TINY, num_key_value_heads=2, tie_word_embeddings=False)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_positions=128, n_embd=64, n_layer=2, n_head=4)),
}
RULES = {
    "ternary-int4": ({"blocks.*": "ternary"}, "int4"),
    "binary-w8a8-int8": ({"blocks.*.attn.*": "binary", "blocks.*": "w8a8"}, "int8"),
    "w4a16-all": ({"*": "w4a16"}, "fp32"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    FAMILIES[request.param]().save_pretrained(path)
    return path


@pytest.mark.parametrize("rules", list(RULES))
def test_a_saved_model_gives_the_same_logits(hf_dir, rules, tmp_path):
    model = from_pretrained(hf_dir).eval()
    rule, embedding = RULES[rules]
    modes = quantize_model(model, rule, group_size=32, embedding=embedding)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)[0]
    save_quantized(model, tmp_path / "q", hf_dir, group_size=32)
    assert is_quantized_dir(tmp_path / "q") and not is_quantized_dir(hf_dir)
    loaded, loaded_modes = load_quantized(tmp_path / "q")
    assert loaded_modes == modes
    with torch.no_grad():
        assert torch.equal(loaded(ids)[0], want)
    manifest = json.loads((tmp_path / "q" / MANIFEST).read_text())
    if embedding != "fp32" and model.cfg.tie_embeddings:  # the head's integers stored once
        assert manifest["layers"]["lm_head"]["tied"] == "tok_emb"


def test_ternary_weights_take_a_fifth_of_a_byte(tmp_path):
    """The bytes on disk: 1.6 bits a ternary weight and one fp32 scale a row."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**TINY, "hidden_size": 320, "intermediate_size": 640},
                                   num_key_value_heads=4, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf").eval()
    quantize_model(model, {"blocks.*": "ternary"}, embedding="int8")
    save_quantized(model, tmp_path / "q")
    linears = [(O, I) for O, I in [(320, 320)] * 4 + [(640, 320)] * 2 + [(320, 640)]] * 2
    packed = sum(O * (-(-I // 5)) + 4 * O for O, I in linears)
    embedding = 97 * 320 + 97 * (320 // 64) * 4
    norms = (2 * 2 + 1) * 320 * 4
    size = (tmp_path / "q" / TENSORS).stat().st_size
    assert packed + embedding + norms <= size < packed + embedding + norms + 8192  # + header


def test_bad_directories_name_the_layer(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **TINY, num_key_value_heads=2)).save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf").eval()
    quantize_model(model, {"blocks.*": "ternary"})
    save_quantized(model, tmp_path / "q")
    manifest = json.loads((tmp_path / "q" / MANIFEST).read_text())
    bad = json.loads(json.dumps(manifest))
    bad["layers"]["blocks.0.attn.qkv"]["shape"] = [3, 3]
    (tmp_path / "q" / MANIFEST).write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="blocks.0.attn.qkv"):
        load_quantized(tmp_path / "q")
    bad = json.loads(json.dumps(manifest))
    bad["layers"]["blocks.9.ffn.fc"] = {"mode": "ternary", "shape": [4, 4]}
    (tmp_path / "q" / MANIFEST).write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="blocks.9.ffn.fc"):
        load_quantized(tmp_path / "q")
    (tmp_path / "q" / MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match=MANIFEST):
        load_quantized(tmp_path / "q")
    model.blocks[0].attn.qkv.lorc_down = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="blocks.0.attn.qkv"):
        save_quantized(model, tmp_path / "q2")
