"""A decode step of a Llama-style decoder with few Python calls per layer.

At batch 1 a decode step reads every weight once, so its floor is the weights' bytes over the
memory bandwidth. The products reach that speed (troupe.kernels.small_gemm for fp32, the INT8
kernel for W8A8); what kept SmolLM2's step well above the floor was the rest: thirty layers of
norms, rotary positions, cache writes, activations and residual adds, each a few torch ops of a
few microseconds of dispatch, about a third of the step (benchmarks/RESULTS.md, "Decoding at
batch 1"). ``DecodeLayers`` runs a layer as nine calls: four products (each the packed kernel,
or the layer's own forward when it is quantized or left to MKL) and five native ones
(troupe/kernels/csrc/decode_layer.cpp and decode_attention.cpp), on buffers it reads in place.

``DecodeLayers.of(model, packed)`` returns None for a model it does not cover (a norm other
than RMSNorm, positions other than rotary, an MLP other than SwiGLU, MoE layers, a head size the
attention kernel lacks, no compiler); ``hidden`` then gives what ``GPT.hidden`` gives for one
new token per sequence (the same numbers to float rounding: sums run in another order).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from troupe.kernels import _native, small_gemm
from troupe.kernels.decode_attention import _extension as _attention_extension


def _extension():
    return _native.load_extension("decode_layer")


class DecodeLayers:
    """Per layer: the four products as callables (rows, K) -> (rows, N) and the norms'
    weights; ``hidden(idx, valid, cache)`` is one decode step through all of them."""

    def __init__(self, model: nn.Module, layers: list[dict], glue, attention):
        self.model, self.layers, self.glue, self.attention = model, layers, glue, attention
        cfg = model.cfg
        self.H, self.Hkv, self.D = cfg.n_head, cfg.kv_heads, cfg.d_model // cfg.n_head
        self.eps, self.scale = float(model.ln_f.eps), 1.0 / math.sqrt(self.D)
        self.inv_freq = model.blocks[0].attn.inv_freq
        self.final_norm = model.ln_f.weight.detach()

    @classmethod
    def of(cls, model: nn.Module, packed: "small_gemm.DecodeWeights | None") -> "DecodeLayers | None":
        from troupe.models.gpt import Block
        from troupe.models.layers import MLP, RMSNorm
        cfg = getattr(model, "cfg", None)
        blocks = getattr(model, "blocks", None)
        if cfg is None or blocks is None or cfg.positions != "rope" or cfg.norm != "rmsnorm":
            return None
        D = cfg.d_model // cfg.n_head
        glue, attention = _extension(), _attention_extension()
        if glue is None or attention is None or not attention.supports(D) \
                or model.ln_f.weight.dtype != torch.float32 or model.device.type != "cpu":
            return None

        def product(module: nn.Module):  # the packed kernel, a quantized layer's, or MKL's
            if packed and module in packed.layers:
                return packed.product(module)
            rows = getattr(module, "rows_product", None)
            return rows() if rows is not None else module.forward

        layers = []
        for block in blocks:
            if not (type(block) is Block and type(block.ffn) is MLP and block.ffn.kind == "swiglu"
                    and type(block.ln1) is RMSNorm and type(block.ln2) is RMSNorm):
                return None
            attn, mlp = block.attn, block.ffn
            layers.append({"ln1": block.ln1.weight.detach(), "ln2": block.ln2.weight.detach(),
                           "qkv": product(attn.qkv), "proj": product(attn.proj),
                           "fc": product(mlp.fc), "down": product(mlp.proj)})
        return cls(model, layers, glue, attention)

    def hidden(self, idx_B1: torch.Tensor, valid_BS: torch.Tensor, cache) -> torch.Tensor:
        """The final hidden states (B, C) (after the last norm) of one new token per sequence,
        its keys and values written to column ``cache.length`` (then counted); ``valid_BS``
        (B, cache.length + 1) says which columns hold real tokens, the last one this token."""
        glue, attention, eps = self.glue, self.attention, self.eps
        L = cache.length
        valid = valid_BS.contiguous()
        pos = valid.sum(1, keepdim=True) - 1                    # (B, 1)
        angles = pos.float() * self.inv_freq                   # (B, D/2)
        cos, sin = angles.cos(), angles.sin()
        x = self.model.embed(idx_B1, pos)[:, 0].contiguous()    # (B, C), the residual stream
        B, C = x.shape
        h = glue.rms_norm(x, self.layers[0]["ln1"], eps)
        for i, layer in enumerate(self.layers):
            k, v = cache.k[i], cache.v[i]
            q = glue.rope_store(layer["qkv"](h), cos, sin, self.H, self.Hkv, k, v, L)
            y = attention.decode(q, k[:, :, :L + 1], v[:, :, :L + 1], valid, self.scale)
            h = glue.add_rms_norm(x, layer["proj"](y.view(B, C)), layer["ln2"], eps)
            down = layer["down"](glue.silu_mul(layer["fc"](h)))
            norm = self.layers[i + 1]["ln1"] if i + 1 < len(self.layers) else self.final_norm
            h = glue.add_rms_norm(x, down, norm, eps)
        cache.length += 1
        return h
