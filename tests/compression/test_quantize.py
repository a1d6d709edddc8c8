"""Quantized Linear layers and model quantization by name patterns."""

import pytest
import torch

from troupe.compression import QuantizedLinear, quantize_model
from troupe.models import GPT, GPTConfig


@pytest.mark.parametrize("mode,tol", [("w8a8", 0.02), ("w8a16", 0.01), ("w4a16", 0.15)])
def test_quantized_linear_close_to_fp32(mode, tol):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64)
    q = QuantizedLinear(lin, mode)
    x = torch.randn(3, 10, 128)
    want = lin(x)
    rel = ((q(x) - want).norm() / want.norm()).item()
    assert rel < tol
    assert q.weight_nbytes < lin.weight.numel() * 4 * (0.3 if "8" in mode else 0.17)


def test_quantize_model_by_patterns():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)).eval()
    x = torch.randint(0, 257, (2, 16))
    ref = model(x)[0]
    done = quantize_model(model, {"*.attn.*": "w8a8", "*.ffn.*": "w4a16"})
    assert set(done.values()) == {"w8a8", "w4a16"} and len(done) == 8
    assert all(isinstance(model.get_submodule(n), QuantizedLinear) for n in done)
    out = model(x)[0]
    assert ((out - ref).norm() / ref.norm()).item() < 0.1
    with pytest.raises(ValueError, match="mode must be one of"):
        quantize_model(model, {"*": "int3"})
