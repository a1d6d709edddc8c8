"""LoRA adapters: start equal to the base layer, fuse/unfuse exactly, merge into plain keys."""

import torch

from troupe.models import GPT, GPTConfig
from troupe.models.lora import LoRALinear, fuse_lora, inject_lora, merged_state_dict, unfuse_lora


def test_lora_fuse_unfuse_and_merge():
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=16)
    model, plain = GPT(cfg), GPT(cfg)
    x = torch.randint(0, 257, (2, 8))
    before = model(x)[0]
    n = inject_lora(model, rank=4, alpha=8)
    assert n == 2 * 4  # qkv, attn proj, mlp fc, mlp proj per block
    torch.testing.assert_close(model(x)[0], before)  # B starts at zero
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.normal_()
    adapted = model(x)[0]
    assert not torch.allclose(adapted, before)
    assert fuse_lora(model)
    torch.testing.assert_close(model(x)[0], adapted, atol=1e-5, rtol=1e-5)
    unfuse_lora(model)
    torch.testing.assert_close(model(x)[0], adapted, atol=1e-5, rtol=1e-5)
    plain.load_state_dict(merged_state_dict(model))
    torch.testing.assert_close(plain(x)[0], adapted, atol=1e-5, rtol=1e-5)
