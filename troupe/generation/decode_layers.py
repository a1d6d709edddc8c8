"""A decode step of a Llama-style decoder in one native call.

At batch 1 a decode step reads every weight once, so its floor is the weights' bytes over the
memory bandwidth. The products reach that speed (troupe.kernels.small_gemm for fp32, the INT8
kernel for W8A8); what kept SmolLM2's step above the floor was the rest: thirty layers of norms,
rotary positions, cache writes, activations and residual adds, each a few torch ops of a few
microseconds of dispatch, about a third of the step, and still a fifth as nine calls a layer
from Python (benchmarks/RESULTS.md, "Decoding at batch 1"). ``DecodeLayers`` hands the whole
step to troupe/kernels/csrc/decode_layer.cpp: the products (the packed fp32 kernel, the W8A8
kernel, MKL where it measured faster, or a layer's own forward called back), attention over the
cache and every small operation between them, in one call.

``DecodeLayers.of(model, packed)`` returns None for a model it does not cover (a norm other
than RMSNorm, positions other than rotary, an MLP other than SwiGLU, MoE layers, a head size the
attention kernel lacks, no compiler); ``hidden`` then gives what ``GPT.hidden`` gives for one
new token per sequence (the same numbers to float rounding: sums run in another order). The
step holds the layers' tensors by reference: weights changed in place (an optimizer step,
``DecodeWeights.refresh``) are seen; weights replaced by new tensors (``requantize``, an
adapter added) need a new ``DecodeLayers``, as a new engine builds. Layers with LoRA adapters
(troupe.models.adapters) run natively too: the base layer's kernel, then each row's adapter
(its slot given to the step); one whose base has no native kernel is called back.
"""

from __future__ import annotations

import torch
from torch import nn

from troupe.kernels import _native, small_gemm  # noqa: F401 (the annotation)
from troupe.kernels.decode_attention import _extension as _attention_extension
from troupe.models.attention import RowCache


def _extension():
    return _native.load_extension("decode_layer")


class DecodeLayers:
    """A model's decode step as one native call (``hidden``); ``of`` builds it."""

    def __init__(self, model: nn.Module, step, own_embedding: bool, logits: bool,
                 routed: bool = False):
        self.model, self.step = model, step
        self.own_embedding, self.has_logits = own_embedding, logits
        self.routed = routed  # a layer with adapters is called back: it reads the rows' masks

    @classmethod
    def of(cls, model: nn.Module, packed: "small_gemm.DecodeWeights | None") -> "DecodeLayers | None":
        from troupe.models.gpt import Block
        from troupe.models.layers import MLP, RMSNorm
        cfg = getattr(model, "cfg", None)
        blocks = getattr(model, "blocks", None)
        if cfg is None or blocks is None or cfg.positions != "rope" or cfg.norm != "rmsnorm":
            return None
        D = cfg.head_size
        native, attention = _extension(), _attention_extension()
        if native is None or attention is None or not attention.supports(D) \
                or model.ln_f.weight.dtype != torch.float32 or model.device.type != "cpu":
            return None
        products = _Products(native, packed)
        tp = getattr(model, "tp", None)  # tensor-parallel: the row-parallel products reduce
        layers = []
        for block in blocks:
            if not (type(block) is Block and type(block.ffn) is MLP and block.ffn.kind == "swiglu"
                    and type(block.ln1) is RMSNorm and type(block.ln2) is RMSNorm):
                return None
            attn, mlp = block.attn, block.ffn
            norms = ((attn.q_norm.weight.detach(), attn.k_norm.weight.detach())
                     if attn.qk_norm else (None, None))
            layers.append((block.ln1.weight.detach(), block.ln2.weight.detach(),
                           products.of(attn.qkv), products.row(attn.proj, tp),
                           products.of(mlp.fc), products.row(mlp.proj, tp), *norms,
                           attn.window is not None))
        emb = model.tok_emb
        embedding = (emb.weight.detach() if type(emb) is nn.Embedding and tp is None
                     and emb.weight.dtype == torch.float32 else None)
        logits = products.logits(model, embedding)
        attn = blocks[0].attn  # this rank's heads (tensor-parallel: its share)
        step = native.Step(layers, model.ln_f.weight.detach(), cfg.d_model, attn.n_head,
                           attn.n_kv, D, float(model.ln_f.eps), embedding,
                           attn.inv_freq.float(), attn.rope_scale, cfg.sliding_window or 0,
                           logits)
        return cls(model, step, embedding is not None, logits is not None,
                   bool(products.routed))

    def hidden(self, idx_B1: torch.Tensor, valid_BS: torch.Tensor | None, cache,
               slots: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states (B, C) (after the last norm) of one new token per sequence,
        its keys and values written after its row's filled positions (then counted): a
        RowCache's own lengths, or a KVCache's shared column ``cache.length``, whose
        ``valid_BS`` (B, cache.length + 1) says which columns hold real tokens, the last one
        this token (None for a RowCache: its rows have no gaps); ``slots``: each row's adapter
        (troupe.models.adapters.Adapters.slot_ids), if any."""
        h = self.step.run(*self._inputs(idx_B1, valid_BS, cache), slots)
        cache.advance(1)
        return h

    def logits(self, idx_B1: torch.Tensor, valid_BS: torch.Tensor | None, cache,
               slots: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int], list[bool]]:
        """``hidden``'s step, then the logits (B, V), each row's greedy token and whether the
        row is finite (``has_logits``: the step was given the model's output projection)."""
        logits, greedy, finite = self.step.logits(*self._inputs(idx_B1, valid_BS, cache), slots)
        cache.advance(1)
        return logits, greedy.tolist(), finite.tolist()

    def tokens(self, tokens_N: torch.Tensor, rows_N: torch.Tensor, cols_N: torch.Tensor, k, v,
               span: int, slots: torch.Tensor | None = None):
        """N tokens in one call, token n at column ``cols_N[n]`` of cache row ``rows_N[n]``
        (``k``, ``v``: every layer's whole cache), seeing that row's columns up to its own;
        several may be one row's consecutive tokens (a speculative verify: each sees the
        ones before it). ``span``: the columns read (more than the largest column). Returns
        ``logits``' triple when the step has the output projection, else the hidden states;
        the lengths are the caller's to count."""
        valid = torch.arange(span, device=cols_N.device)[None] <= cols_N[:, None]
        x = None
        if not self.own_embedding:
            x = self.model.embed(tokens_N[:, None], cols_N[:, None])[:, 0].float()
        args = (tokens_N, x, valid, k, v, cols_N.contiguous(), slots, rows_N.contiguous())
        if not self.has_logits:
            return self.step.run(*args)
        logits, greedy, finite = self.step.logits(*args)
        return logits, greedy.tolist(), finite.tolist()

    def _inputs(self, idx_B1, valid_BS, cache) -> tuple:
        tokens = idx_B1.reshape(-1)
        if isinstance(cache, RowCache):
            cols = cache.lengths
            valid_BS = torch.arange(cache.span, device=cols.device)[None] <= cols[:, None]
        else:
            B = len(tokens)
            cols = torch.full((B,), cache.length, dtype=torch.long)  # host: the C++ step's
        x = None
        if not self.own_embedding:  # a quantized embedding, say: the model's own lookup
            pos = valid_BS.sum(1, keepdim=True) - 1
            x = self.model.embed(idx_B1, pos)[:, 0].float()
        return tokens, x, valid_BS.contiguous(), cache.k, cache.v, cols.contiguous()


class _Products:
    """The native product of each Linear of a model for the one-call step: its packed kernel,
    a W8A8 layer's kernel or MKL's, with the adapters' pairs on a layer that has them, or
    else the module called back (``routed``: the adapted layers called back, which read the
    rows' masks)."""

    def __init__(self, native, packed: "small_gemm.DecodeWeights | None"):
        self.native, self.packed = native, packed
        self.routed: list[nn.Module] = []

    def kernel(self, module: nn.Module):
        """The packed kernel, a W8A8 layer's kernel or MKL's; None: no native one."""
        from troupe.compression.quantize import QuantizedLinear
        native, packed = self.native, self.packed
        if packed and module in packed.layers:
            few, more = packed.uses[module]
            return native.packed(packed.layers[module], module.weight.detach(),
                                 _detached(module.bias), module.out_features, few, more)
        if type(module) is nn.Linear and module.weight.dtype == torch.float32:
            return native.torch(module.weight.detach(), _detached(module.bias))
        int8 = module.int8_operands() if isinstance(module, QuantizedLinear) else None
        return None if int8 is None else native.int8(*int8)

    def of(self, module: nn.Module):
        from troupe.models.adapters import AdaptedLinear
        if isinstance(module, AdaptedLinear):
            base = self.kernel(module.base)
            if base is not None and module.packed is not None:
                return self.native.lora(base, *module.packed, module.R)
            self.routed.append(module)
        return self.kernel(module) or self.native.python(module.forward, module.out_features)

    def row(self, module: nn.Module, tp):
        """A row-parallel layer's product (``of``'s), or with a tensor-parallel group its
        partial products summed over the group (troupe.models.layers.row_parallel), called
        back: the all-reduce is Python's."""
        if tp is None:
            return self.of(module)
        from troupe.models.layers import row_parallel
        return self.native.python(lambda x: row_parallel(module, x, tp), module.out_features)

    def logits(self, model: nn.Module, embedding: torch.Tensor | None):
        """The output projection: the model's head, the packed tied embedding, the fp32
        embedding through MKL, or None (the engine's own); tensor-parallel, the model's own
        (each rank's vocabulary shard, gathered), called back."""
        if getattr(model, "tp", None) is not None:
            return self.native.python(model.logits, model.cfg.vocab_size)
        head = getattr(model, "lm_head", None)
        if head is not None:
            return self.of(head)
        if self.packed and self.packed.logits_weight is not None:
            return self.native.packed(self.packed.logits_weight, model.tok_emb.weight.detach(),
                                      None, model.cfg.vocab_size, *self.packed.uses[None])
        if embedding is not None:
            return self.native.torch(embedding, None)
        return None

def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()
