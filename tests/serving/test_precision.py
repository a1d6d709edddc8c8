"""Serving in bf16 (ServeConfig.precision): the unquantized weights and the KV cache in bf16,
quantized layers' integers and scales as they were."""

import torch

from troupe.compression import QuantizedLinear
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.models import GPT, GPTConfig
from troupe.serving.config import ServeConfig
from troupe.serving.model import load_served_model, save_model


def test_bf16_serving_holds_bf16_weights_and_decodes_like_fp32(tmp_path):
    path = tmp_path / "m.trp"
    save_model(GPT(GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=64, positions="rope",
                             norm="rmsnorm", mlp="swiglu"), seed=3), path)
    served = {}
    for precision in ("fp32", "bf16"):
        cfg = ServeConfig(model={"file": str(path), "name": "m"}, quantize={"*.ffn.*": "w8a16"},
                          precision=precision)
        served[precision], modes = load_served_model(cfg)
        assert set(modes.values()) == {"w8a16"}
    model = served["bf16"]
    assert model.tok_emb.weight.dtype == torch.bfloat16
    assert model.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    ffn = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert ffn and all(m.qw.scales.dtype == torch.float32 for m in ffn)
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = served["fp32"](ids)[0], served["bf16"](ids)[0].float()
    assert got.dtype == torch.float32 and ((got - want).norm() / want.norm()) < 0.03
    engine = ContinuousBatcher(model, eos_id=None, max_batch=2)
    assert engine.slots is None  # made at the first prefill, in the model's dtype
    engine.add("a", ids[0].tolist(), SamplingParams(max_tokens=5))
    tokens = engine.run()["a"]
    assert engine.slots.k[0].dtype == engine.slots.v[-1].dtype == torch.bfloat16
    assert len(tokens) == 5 and tokens[0] == int(got[0, -1].argmax())
