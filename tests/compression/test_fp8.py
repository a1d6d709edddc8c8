"""FP8 (e4m3, row-wise scales) layers (troupe.compression.fp8): torch._scaled_mm gives the
product of the dequantized operands, close to the fp32 layer's; quantize_model's "fp8" rules
make a model that decodes; what fp8 cannot hold is refused by name."""

import pytest
import torch
from torch import nn

from troupe.compression import quantize_model
from troupe.compression.artifact import save_quantized
from troupe.compression.fp8 import E4M3_MAX, Fp8Linear, quantize_rows
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.models import GPT, GPTConfig


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_product_is_the_dequantized_operands_product(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(200, 72)
    layer = Fp8Linear(lin)
    x = torch.randn(4, 17, 200) * torch.logspace(-2, 1, 200)  # rows of uneven channels
    y = layer(x.to(dtype))
    assert y.dtype == dtype and y.shape == (4, 17, 72)
    xq, xs = quantize_rows(x.reshape(-1, 200).to(dtype))
    assert float(xq.float().abs().max()) <= E4M3_MAX and xq.dtype == torch.float8_e4m3fn
    want = (xq.float() * xs) @ layer.dequantized_weight().t() + lin.bias
    torch.testing.assert_close(y.reshape(-1, 72).float(), want,
                               **({} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)))
    with torch.no_grad():
        exact = lin(x).reshape(-1, 72)
    assert float((y.reshape(-1, 72).float() - exact).norm() / exact.norm()) < 0.06
    assert not y.requires_grad
    assert layer.weight_nbytes == 72 * 200 + 4 * 72  # a byte a weight, a scale a row


def test_an_fp8_model_decodes_and_keeps_the_fp32_models_choices_mostly():
    cfg = GPTConfig(vocab_size=97, seq_len=64, n_layer=2, n_head=4, d_model=64,
                    positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2)
    fp32, fp8 = GPT(cfg, seed=4).eval(), GPT(cfg, seed=4).eval()
    done = quantize_model(fp8, {"*": "fp8"})
    assert done and set(done.values()) == {"fp8"}
    ids = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = fp32(ids)[0], fp8(ids)[0]
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.8
    engine = ContinuousBatcher(fp8, None, max_batch=2)
    engine.add("x", ids[0].tolist(), SamplingParams(max_tokens=6))
    assert len(engine.run()["x"]) == 6


def test_what_fp8_cannot_hold_is_named(tmp_path):
    moe = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32,
                        moe=dict(num_experts=2, expert_interval=1)), seed=0)
    with pytest.raises(ValueError, match=r"blocks\.\d\.ffn.*: fp8 holds dense layers"):
        quantize_model(moe, {"*": "fp8"})
    dense = GPT(GPTConfig(vocab_size=97, seq_len=32, n_layer=1, n_head=2, d_model=32), seed=0)
    quantize_model(dense, {"*.attn.*": "fp8"})
    with pytest.raises(ValueError, match=r"blocks.0.attn.qkv is fp8"):
        save_quantized(dense, tmp_path / "q")
