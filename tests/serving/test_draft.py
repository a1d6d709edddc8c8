"""The server's speculative-decoding settings (serve's ``speculate`` and ``speculate_draft``):
the draft each names, and what cannot work refused naming the key."""

import pytest
import torch

from troupe.compression import QuantizedLinear
from troupe.config import ConfigError
from troupe.models import GPT, GPTConfig, save_pretrained
from troupe.serving.config import ServeConfig
from troupe.serving.model import load_draft, save_model


def _cfg(tmp_path, **kw):
    path = tmp_path / "m.trp"
    if not path.exists():
        save_model(GPT(GPTConfig(n_layer=1, d_model=32, n_head=2), seed=0), path)
    return ServeConfig(model={"file": str(path), "name": "m"}, device="cpu", **kw)


def test_a_draft_needs_speculation_on_and_no_lockstep(tmp_path):
    with pytest.raises(ValueError, match="speculate_draft=w8a8.*speculate=0"):
        _cfg(tmp_path, speculate_draft="w8a8")
    with pytest.raises(ValueError, match="speculate=4 with expert_parallel=2"):
        _cfg(tmp_path, speculate=4, expert_parallel=2)


def test_the_drafts_a_server_can_name(tmp_path):
    cfg = _cfg(tmp_path, speculate=4, speculate_draft="w8a8")
    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2), seed=0)
    draft = load_draft(cfg, model)
    assert any(isinstance(m, QuantizedLinear) for m in draft.modules())
    assert load_draft(_cfg(tmp_path, speculate=4), model) is None  # prompt lookup
    llama = dict(positions="rope", norm="rmsnorm", mlp="swiglu", out_bias=False,
                 mlp_bias=False)
    other = GPT(GPTConfig(vocab_size=300, n_layer=1, d_model=32, n_head=2, **llama), seed=1)
    save_pretrained(other, tmp_path / "other")
    with pytest.raises(ConfigError, match="speculate_draft=.*300 tokens is not the served"):
        load_draft(_cfg(tmp_path, speculate=4, speculate_draft=str(tmp_path / "other")), model)
    same = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, **llama), seed=2)
    save_pretrained(same, tmp_path / "same")
    got = load_draft(_cfg(tmp_path, speculate=4, speculate_draft=str(tmp_path / "same")), model)
    assert torch.equal(got.tok_emb.weight, same.tok_emb.weight)
