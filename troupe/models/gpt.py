"""A decoder-only GPT: pre-LN blocks, causal attention through scaled_dot_product_attention,
dense or MoE feed-forward layers, optional random layerwise token dropping (random-LTD)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from pydantic import Field, field_validator, model_validator
from torch import nn

from troupe.config import Config
from troupe.devices import precision_dtype
from troupe.kernels.decode_attention import decode_attention
from troupe.models.layers import (ROPE_TYPES, MLP, RMSNorm, apply_rope, norm, rope_angles,
                                  rope_attention_factor, rope_frequencies, rope_type)
from troupe.models.moe import Experts, MoE, MoEConfig, ResidualMoE
from troupe.models.packing import segment_mask, segment_positions


class GPTConfig(Config):
    """One decoder for the GPT-2 and Llama families. d_ff defaults to 4 * d_model; moe=None
    gives a dense model. Sizes are bounded so that a typo fails here, not as a 50 GB
    allocation. The defaults are troupe's own GPT; the family knobs:
    - norm (layernorm | rmsnorm, with norm_eps);
    - positions (learned | rope, with rope_theta and rope_scaling: linear, llama3 or yarn);
    - mlp (gelu | gelu_tanh | swiglu; MoE experts follow it, as in Mixtral);
    - n_kv_head (grouped-query attention); qk_norm (each head's q and k RMS-normalised before
      rotation, as in Qwen3); head_dim, each head's width when it is not
      d_model / n_head (Mistral-Nemo's 32 heads of 128 over a width of 5120; without it
      n_head must divide d_model);
    - sliding_window: each token attends to itself and the sliding_window - 1 before it, as
      in Mistral, in the layers sliding_layers lists (all when None);
    - the biases of the attention's qkv and output and of the MLP (and experts), and tied
      embeddings.
    troupe.models.from_pretrained builds it from a Hugging Face config.json."""

    vocab_size: int = Field(default=257, ge=2, le=1 << 22)
    seq_len: int = Field(default=128, ge=1, le=1 << 20)
    n_layer: int = Field(default=4, ge=1, le=1024)
    n_head: int = Field(default=4, ge=1, le=1024)
    d_model: int = Field(default=128, ge=1, le=1 << 16)
    d_ff: int | None = Field(default=None, ge=1, le=1 << 18)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    moe: MoEConfig | None = None
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = Field(default=1e-5, gt=0, lt=1)
    positions: Literal["learned", "rope"] = "learned"
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: dict[str, Any] | None = None
    mlp: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu"
    n_kv_head: int | None = Field(default=None, ge=1, le=1024)
    head_dim: int | None = Field(default=None, ge=1, le=1 << 12)
    sliding_window: int | None = Field(default=None, ge=1)
    sliding_layers: list[int] | None = None
    qk_norm: bool = False
    qkv_bias: bool = False
    out_bias: bool = True
    mlp_bias: bool = True
    tie_embeddings: bool = True

    @field_validator("rope_scaling")
    @classmethod
    def _known_rope_scaling(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """The kinds troupe computes (troupe.models.layers.rope_frequencies): linear, llama3
        and yarn, each with the numbers it needs positive. "default" is no scaling."""
        if not v:
            return None
        kind = rope_type(v)
        if kind == "default":
            return None
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)} "
                             "are)")
        need = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"),
                "yarn": ("factor", "original_max_position_embeddings")}[kind]
        optional = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
        bad = [k for k in need if not _positive(v.get(k))]
        if bad:
            raise ValueError(f"{kind} scaling needs positive numbers {', '.join(need)}; "
                             f"{bad[0]}={v.get(bad[0])!r}")
        bad = [k for k in optional if kind == "yarn" and v.get(k) is not None
               and not _positive(v[k])]
        if bad:
            raise ValueError(f"{kind} scaling: {bad[0]}={v[bad[0]]!r} must be a positive number")
        if kind == "llama3" and v["high_freq_factor"] <= v["low_freq_factor"]:
            raise ValueError("llama3 scaling needs high_freq_factor > low_freq_factor")
        return v

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "GPTConfig":
        if self.head_dim is None and self.d_model % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide d_model={self.d_model}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        if self.positions == "rope" and self.head_size % 2:
            raise ValueError(f"positions=rope needs an even head size, not {self.head_size}")
        if self.sliding_layers is not None:
            if self.sliding_window is None:
                raise ValueError("sliding_layers needs a sliding_window")
            bad = [i for i in self.sliding_layers if not 0 <= i < self.n_layer]
            if bad:
                raise ValueError(f"sliding_layers: {bad[0]} is not a layer of "
                                 f"0..{self.n_layer - 1}")
        if self.moe is not None and self.mlp == "gelu_tanh":
            raise ValueError("MoE experts are exact-GELU or SwiGLU MLPs: mlp=gelu_tanh has none")
        if self.moe is not None and self.moe.residual and self.mlp != "gelu":
            raise ValueError("moe.residual (Residual MoE) is built with GELU MLPs only")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        """Each attention head's width: head_dim, else d_model / n_head."""
        return self.head_dim or self.d_model // self.n_head

    def window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to every earlier token)."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    def moe_layers(self) -> list[int]:
        """Indices of the blocks whose feed-forward is MoE."""
        if self.moe is None:
            return []
        k = self.moe.expert_interval
        return [i for i in range(self.n_layer)
                if (i + 1) % k == 0 and i not in self.moe.dense_layers]


def _positive(x: Any) -> bool:
    """A number above zero (not a bool, which Python counts as an int)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@dataclass
class KVCache:
    """Keys and values of every layer for a batch, (B, Hkv, max_len, head size) each; ``length``
    positions are filled."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, cfg: GPTConfig, batch: int, max_len: int, device=None,
              dtype: torch.dtype = torch.float32) -> "KVCache":
        shape = (batch, cfg.kv_heads, max_len, cfg.head_size)
        return cls([torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
                   [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)])

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this step's keys and values after the ``length`` filled positions (in place,
        no autograd) and return views of everything so far."""
        L, T = self.length, k.shape[2]
        self.k[layer][:, :, L:L + T] = k
        self.v[layer][:, :, L:L + T] = v
        return self.k[layer][:, :, :L + T], self.v[layer][:, :, :L + T]


class PrefixTree:
    """Rows that share prefixes, each prefix computed once, in one pass: GRPO's samples of a
    prompt continue that prompt, and prompts that open with the same system prompt continue
    that opening. The tree is a list of levels, each a (rows, width) block of tokens whose
    row i continues row ``parents[i]`` of the level before (the first level has no parent);
    ``valid`` (rows, width) marks each level's real tokens (the rest is padding).

    ``GPT.hidden(tree.pack(ids), cache=tree)`` runs every level's tokens side by side as one
    sequence: every weight is read, and its gradient written, once a
    layer, as for one batch (a pass per level would write each weight's gradient once per
    level). Only attention sees the levels: a row attends causally to its own tokens and to
    all of its ancestors' (their keys and values gathered for it), as if the row held its
    whole path. Values and gradients are those of running every row whole, up to the order
    of float sums, for each prefix's compute once (Prefix Grouper, Liu et al. 2025).
    ``unpack`` splits the hidden states back into the levels.
    """

    def __init__(self, levels: list[tuple[torch.Tensor | None, torch.Tensor]]):
        """``levels``: (parents, valid) per level, root first (its parents None)."""
        self.valid = [v for _, v in levels]
        self.length = 0  # GPT.hidden's cache protocol: positions come from the tree
        device = self.valid[0].device
        # index[l][j]: for each row of level l, its ancestor row in level j (j <= l)
        self.index: list[list[torch.Tensor]] = []
        for parents, valid in levels:
            own = torch.arange(len(valid), device=device)
            up = [i.index_select(0, parents) for i in self.index[-1]] if self.index else []
            self.index.append(up + [own])
        # each level's keys: its ancestors' columns, then its own; masks and positions
        self.masks, self.key_positions, pos = [], [], []
        for l, valid in enumerate(self.valid):
            path = torch.cat([self.valid[j].index_select(0, self.index[l][j])
                              for j in range(l)] + [valid], 1)
            self.masks.append(attention_mask(path, valid.shape[1]))
            self.key_positions.append((path.long().cumsum(1) - 1).clamp_min(0))
            pos.append(self.key_positions[-1][:, -valid.shape[1]:])
        self.positions = torch.cat([p.reshape(1, -1) for p in pos], 1)  # (1, tokens)
        self.windowed: dict[int, list[torch.Tensor]] = {}  # window -> each level's mask
        self.sizes = [v.numel() for v in self.valid]
        self.span = sum(v.shape[1] for v in self.valid)  # a row's whole path, padding included

    def pack(self, ids: list[torch.Tensor]) -> torch.Tensor:
        """(1, all levels' positions): the levels' (rows, width) ids laid end to end."""
        return torch.cat([x.reshape(1, -1) for x in ids], 1)

    def unpack(self, h_1TC: torch.Tensor) -> list[torch.Tensor]:
        """Per level, its (rows, width, C) part of a packed (1, tokens, C)."""
        return [x.view(*v.shape, -1)
                for x, v in zip(h_1TC[0].split(self.sizes), self.valid)]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
               gqa: bool, window: int | None = None) -> torch.Tensor:
        """Attention over the tree: q (1, H, tokens, D), k and v (1, Hkv, tokens, D) of the
        packed sequence -> (1, H, tokens, D); within ``window`` positions when given."""
        def levels(x):  # (1, h, tokens, D) -> per level (rows, h, width, D)
            return [part.view(x.shape[1], *val.shape, x.shape[3]).transpose(0, 1)
                    for part, val in zip(x[0].split(self.sizes, 1), self.valid)]
        qs, ks, vs = levels(q), levels(k), levels(v)
        masks = self.masks
        if window is not None and window < self.span:
            if window not in self.windowed:
                self.windowed[window] = [
                    within_window(m, kp[:, -v.shape[1]:], kp, window)
                    for m, kp, v in zip(self.masks, self.key_positions, self.valid)]
            masks = self.windowed[window]
        out = []
        for l in range(len(qs)):
            keys = torch.cat([ks[j].index_select(0, self.index[l][j]) for j in range(l + 1)], 2)
            values = torch.cat([vs[j].index_select(0, self.index[l][j])
                                for j in range(l + 1)], 2)
            y = F.scaled_dot_product_attention(qs[l], keys, values, attn_mask=masks[l],
                                               dropout_p=dropout, enable_gqa=gqa)
            out.append(y.transpose(0, 1).reshape(y.shape[1], -1, y.shape[3]))
        return torch.cat(out, 1).unsqueeze(0)


class Attention(nn.Module):
    """Causal self-attention; q, k and v come from one projection (q heads, then k and v with
    ``n_kv_head`` heads each); rotary positions when the config says so."""

    def __init__(self, cfg: GPTConfig, window: int | None = None):
        super().__init__()
        self.n_head, self.n_kv, self.dropout = cfg.n_head, cfg.kv_heads, cfg.dropout
        self.head_dim = cfg.head_size
        self.window = window  # sliding: keys fewer than ``window`` positions back (GPT.hidden)
        # troupe's own GPT has no qkv bias: a key bias gets exactly zero gradient (softmax
        # ignores a shift shared by all keys), so its frozen variance would be zero and 1-bit
        # momentum noise would blow it up. Qwen2 has one.
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * self.n_kv) * self.head_dim,
                             bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=cfg.out_bias)
        self.rope = cfg.positions == "rope"
        if self.rope:
            self.register_buffer("inv_freq", rope_frequencies(
                self.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False)
            self.rope_scale = rope_attention_factor(cfg.rope_scaling)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x_BTC: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | PrefixTree | None = None, layer: int = 0,
                pos: torch.Tensor | None = None, angles=None) -> torch.Tensor:
        """``angles``: the rotary cos and sin of ``pos`` when the caller computed them once
        for all layers (GPT.hidden); else they come from ``pos`` (default 0..T-1)."""
        B, T, _ = x_BTC.shape
        H, Hkv, D = self.n_head, self.n_kv, self.head_dim
        qkv = self.qkv(x_BTC).view(B, T, H + 2 * Hkv, D)
        if self.qk_norm:
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], 2)
        if self.rope:  # q and k rotated together (their heads side by side in qkv)
            if angles is None:
                pos = torch.arange(T, device=x_BTC.device) if pos is None else pos
                angles = rope_angles(pos, self.inv_freq, self.rope_scale)
            q, k = apply_rope(qkv[:, :, :H + Hkv], angles).split([H, Hkv], dim=2)
            v = qkv[:, :, H + Hkv:]
        else:
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        dropout = self.dropout if self.training else 0.0
        gqa = Hkv != H  # grouped-query attention: each k/v head serves H / Hkv query heads,
        # read in place by the attention kernel (no copy of the cache per step)
        if isinstance(cache, PrefixTree):
            return self.proj(cache.attend(q, k, v, dropout, gqa, self.window).transpose(1, 2)
                             .reshape(B, T, H * D))
        if cache is not None:  # append this step's keys and values, attend over all so far
            k, v = cache.extend(layer, k, v)
        # a decode step on the CPU: the native kernel (None where it does not apply)
        y = decode_attention(q, k, v, mask) if cache is not None and T == 1 and not dropout \
            else None
        if y is not None:
            return self.proj(y.transpose(1, 2).reshape(B, T, H * D))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, dropout_p=dropout,
                                               enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                               enable_gqa=gqa)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, ffn: nn.Module, window: int | None = None):
        super().__init__()
        self.ln1 = norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ln2 = norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn, self.ffn = Attention(cfg, window), ffn
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_BTC: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | PrefixTree | None = None, layer: int = 0,
                pos: torch.Tensor | None = None, angles=None) -> tuple[torch.Tensor, torch.Tensor]:
        x_BTC = x_BTC + self.drop(self.attn(self.ln1(x_BTC), mask, cache, layer, pos, angles))
        y, aux = self.ffn(self.ln2(x_BTC))
        return x_BTC + self.drop(y), aux


class GPT(nn.Module):
    """GPT with tied input/output embeddings, built whole (troupe.parallel splits its experts).

    forward(idx_BT, targets_BT=None, ltd=None) returns (logits_BTV, lm_loss, aux_loss); lm_loss
    is None without targets. ``ltd`` = (keep, layers, generator): in those layers only ``keep``
    random tokens per sequence (kept in order) pass through the block; the rest skip it.
    """

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        d_ff = cfg.d_ff or 4 * cfg.d_model
        moe_layers = cfg.moe_layers()
        counts = cfg.moe.experts_per_layer(len(moe_layers)) if cfg.moe else []
        blocks = []
        for i in range(cfg.n_layer):
            if i in moe_layers:
                E = counts[moe_layers.index(i)]
                if cfg.moe.residual:
                    ffn = ResidualMoE(cfg.d_model, d_ff, E, cfg.moe)
                else:
                    ffn = MoE(cfg.d_model, cfg.moe.expert_d_ff or d_ff, E, cfg.moe, cfg.mlp,
                              cfg.mlp_bias)
                blocks.append(Block(cfg, ffn, cfg.window(i)))
            else:
                blocks.append(Block(cfg, MLP(cfg.d_model, d_ff, cfg.mlp, cfg.mlp_bias),
                                    cfg.window(i)))
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions == "learned":
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.init_weights(seed)
        # Recompute each block's activations in the backward instead of keeping them
        # (training only): a block's input per layer is kept, not its internals.
        self.checkpoint_activations = False

    def init_weights(self, seed: int, only: set[str] | None = None) -> None:
        """N(0, 0.02) weights (output projections scaled by 1/sqrt(2 * n_layer)), zero biases,
        unit LayerNorms; every tensor from its own generator, so the expert-parallel split
        does not change any value, nor does initialising a few at a time: ``only`` names the
        parameters to set (the rest are left as they are), for a model built on the meta
        device and materialised block by block (troupe.parallel.zero3)."""
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, Experts) and (only is None or f"{name}.w1" in only):
                module.init_weights(seed, name, std, out_std)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if getattr(p, "expert", False) or (only is not None and name not in only):
                    continue
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln" in name or name.startswith("ln_") or name.endswith("_norm.weight"):
                    p.fill_(1.0)
                else:
                    g = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
                    s = out_std if name.endswith("proj.weight") else std
                    # drawn with a CPU generator: every device starts from the same weights
                    p.copy_(torch.randn(p.shape, generator=g) * s)  # host: then copied into p

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None,
                ltd: tuple[int, range, torch.Generator] | None = None, **kw):
        """Logits (B, T, V), the mean next-token loss against ``targets_BT`` (None without),
        and the MoE auxiliary loss. Keywords as for ``hidden``."""
        h, aux = self.hidden(idx_BT, ltd=ltd, **kw)
        logits = self.logits(h)  # (B, T, V)
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets_BT.reshape(-1))
        return logits, loss, aux

    def reset_buffers(self) -> None:
        """Recompute the buffers that are not weights (rotary frequencies), e.g. after the
        model was built on the meta device and moved with ``to_empty``."""
        for m in self.modules():
            if isinstance(m, Attention) and m.rope:
                m.inv_freq = rope_frequencies(m.head_dim, self.cfg.rope_theta,
                                              self.cfg.rope_scaling).to(m.inv_freq.device)

    def embed(self, idx_BT: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """The input of block 0 (B, T, C): token embeddings, plus learned position embeddings
        at ``pos`` (default 0..T-1) when the model has them (rotary ones act in attention)."""
        x = self.tok_emb(idx_BT)
        if self.cfg.positions == "learned":
            x = x + self.pos_emb(torch.arange(idx_BT.shape[1], device=idx_BT.device)
                                 if pos is None else pos)
        return self.drop(x)

    @property
    def device(self) -> torch.device:
        """Where the model computes (read from the final norm: the embedding may be held
        quantized, troupe.compression.QuantizedEmbedding)."""
        return self.ln_f.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The type of its unquantized weights and activations."""
        return self.ln_f.weight.dtype

    def mixed_precision(self, precision: str):
        """A context for ``precision``: "bf16" or "fp16" runs what it encloses under autocast
        to that type on this model's device (the weights stay fp32; fp16 needs loss scaling,
        troupe.optim.LossScaler), "fp32" changes nothing."""
        dtype = precision_dtype(precision)
        return torch.autocast(self.device.type, dtype=dtype,
                              enabled=dtype != torch.float32)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits of hidden states (..., C): the lm_head (a Linear, or what
        quantization made of it: a tied model gets one when its output projection is
        quantized, troupe.compression.quantize_model), else the tied embedding."""
        head = getattr(self, "lm_head", None)
        return F.linear(h, self.tok_emb.weight) if head is None else head(h)

    def hidden(self, idx_BT: torch.Tensor, ltd: tuple[int, range, torch.Generator] | None = None,
               valid_BS: torch.Tensor | None = None,
               cache: KVCache | PrefixTree | None = None,
               segments_BT: torch.Tensor | None = None):
        """Final hidden states (B, T, C) after ln_f, and the MoE auxiliary loss.

        valid_BS: which of the S = cache.length + T positions hold real tokens (False for
        padding, on the left or between a shared prefix and what follows it); positions are
        then counted over real tokens only, so a left-padded prompt is embedded as if it
        started at position 0. cache: KVCache to extend with these T tokens, or a PrefixTree
        whose packed tokens these are (positions and attention then come from the tree).
        """
        B, T = idx_BT.shape
        L = cache.length if cache is not None else 0
        span = cache.span if isinstance(cache, PrefixTree) else L + T  # the longest row
        if span > self.cfg.seq_len and cache is None:
            # a padded or packed batch may be wider than the context where no sample is:
            # positions count each sample's real tokens (rollouts lay prompts and responses
            # out in columns of their own)
            if valid_BS is not None:
                span = int(valid_BS.sum(1).max())
            elif segments_BT is not None:
                span = int(segment_positions(segments_BT).max()) + 1
        if span > self.cfg.seq_len:
            raise ValueError(f"sequence of {span} tokens exceeds seq_len={self.cfg.seq_len}")
        mask = keys = None  # keys: the keys' positions, where the branch has them at hand
        if isinstance(cache, PrefixTree):
            pos = cache.positions
        elif segments_BT is not None:
            if valid_BS is not None or cache is not None:
                raise ValueError("segments_BT (a packed batch) takes no valid_BS or cache")
            pos, mask = segment_positions(segments_BT), segment_mask(segments_BT)
            keys = pos
        elif valid_BS is None:
            pos = torch.arange(L, L + T, device=idx_BT.device)
        elif T == 1:  # one new token per sequence (decoding): it may see every real key
            pos = valid_BS.sum(1, keepdim=True) - 1  # (B, 1)
            mask = valid_BS[:, None, None, :]
        else:
            keys = (valid_BS.long().cumsum(1) - 1).clamp_min(0)  # (B, S)
            pos = keys[:, L:]  # (B, T)
            mask = attention_mask(valid_BS, T)
        # The layers that slide see only the keys less than their window behind; None where
        # no row is longer than the window (it changes nothing) or a tree attends (it has its
        # own masks). The keys' positions count real tokens, as the queries' do.
        slid = None
        window = self.cfg.sliding_window
        if window is not None and window < span and not isinstance(cache, PrefixTree):
            if keys is None:
                keys = (torch.arange(L + T, device=idx_BT.device)[None] if valid_BS is None
                        else (valid_BS.long().cumsum(1) - 1).clamp_min(0))
            slid = within_window(mask, pos if pos.dim() == 2 else pos[None], keys, window)
            if T == 1 and slid.shape[0] != B:  # the decode kernel takes one row per sequence
                slid = slid.expand(B, -1, -1, -1)
        x = self.embed(idx_BT, pos)  # (B, T, C)
        angles = None
        if self.cfg.positions == "rope":  # shared by every layer (the same frequencies)
            attn = self.blocks[0].attn
            angles = rope_angles(pos, attn.inv_freq, attn.rope_scale)
        aux = x.new_zeros(())
        for i, block in enumerate(self.blocks):
            m = slid if slid is not None and block.attn.window is not None else mask
            if ltd is not None and i in ltd[1] and ltd[0] < T:
                x, a = _through_subset(block, x, ltd[0], ltd[2])
            elif self.checkpoint_activations and self.training and torch.is_grad_enabled():
                x, a = torch.utils.checkpoint.checkpoint(block, x, m, cache, i, pos, angles,
                                                         use_reentrant=False)
            else:
                x, a = block(x, m, cache, i, pos, angles)
            aux = aux + a
        if cache is not None:
            cache.length += T
        return self.ln_f(x), aux


def attention_mask(valid_BS: torch.Tensor, T: int) -> torch.Tensor:
    """(B, 1, T, S) boolean mask for the last T of S positions: causal, real keys only, and
    each query may always see itself (so padding rows are not empty)."""
    B, S = valid_BS.shape
    q = torch.arange(S - T, S, device=valid_BS.device)[:, None]
    k = torch.arange(S, device=valid_BS.device)[None, :]
    mask = (k <= q) & valid_BS[:, None, :]
    return (mask | (k == q)).unsqueeze(1)


def within_window(mask: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  window: int) -> torch.Tensor:
    """``mask`` (B, 1, T, S) narrowed to a sliding window: a query at position p sees only
    keys at positions above p - window (itself and the window - 1 before it). Positions
    count real tokens: q_pos (B or 1, T), k_pos (B or 1, S). A mask of None is causal over
    the positions (as ``is_causal``)."""
    gap = (q_pos[:, :, None] - k_pos[:, None, :]).unsqueeze(1)  # (B, 1, T, S)
    if mask is None:
        return (gap >= 0) & (gap < window)
    return mask & (gap < window)


def _through_subset(block: Block, x_BTC: torch.Tensor, keep: int,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random-LTD: ``keep`` random positions of each sequence, in order, go through the block."""
    B, T, C = x_BTC.shape
    idx_BK = torch.rand(B, T, generator=gen, device=gen.device).argsort(dim=1)[:, :keep]
    idx_BK = idx_BK.sort(dim=1).values.to(x_BTC.device)
    idx_BKC = idx_BK[:, :, None].expand(B, keep, C)
    # causal among the kept, in order, each at its own position (and within a sliding window)
    window = block.attn.window
    mask = within_window(None, idx_BK, idx_BK, window) if window is not None else None
    y, aux = block(torch.gather(x_BTC, 1, idx_BKC), mask, pos=idx_BK)
    return x_BTC.scatter(1, idx_BKC, y), aux


def expert_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) parameters: experts reduce over expert-data-parallel, the rest over all."""
    dense, expert = [], []
    for p in model.parameters():
        (expert if getattr(p, "expert", False) else dense).append(p)
    return dense, expert
