"""A decoder-only GPT: pre-LN blocks, causal attention through scaled_dot_product_attention,
dense or MoE feed-forward layers, optional random layerwise token dropping (random-LTD)."""

from __future__ import annotations

import math
import zlib
from typing import Any, Literal

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from pydantic import Field, field_validator, model_validator
from torch import nn

from troupe.collectives import Communicator, copy_in, gather_vocab, reduce_out
from troupe.config import Config
from troupe.devices import precision_dtype
from troupe.models.attention import (Attention, KVCache, PrefixTree, RowCache, attention_mask,
                                     within_window)
from troupe.models.layers import (ROPE_TYPES, MLP, norm, rope_angles, rope_frequencies,
                                  rope_type, vocab_parallel_cross_entropy)
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


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, ffn: nn.Module, window: int | None = None):
        super().__init__()
        self.ln1 = norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ln2 = norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn, self.ffn = Attention(cfg, window), ffn
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_BTC: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | RowCache | PrefixTree | None = None, layer: int = 0,
                pos: torch.Tensor | None = None, angles=None) -> tuple[torch.Tensor, torch.Tensor]:
        x_BTC = x_BTC + self.drop(self.attn(self.ln1(x_BTC), mask, cache, layer, pos, angles))
        y, aux = self.ffn(self.ln2(x_BTC))
        return x_BTC + self.drop(y), aux


class GPT(nn.Module):
    """GPT with tied input/output embeddings, built whole (troupe.parallel splits its experts,
    and its layers over a tensor-parallel group ``tp``).

    forward(idx_BT, targets_BT=None, ltd=None) returns (logits_BTV, lm_loss, aux_loss); lm_loss
    is None without targets. ``ltd`` = (keep, layers, generator): in those layers only ``keep``
    random tokens per sequence (kept in order) pass through the block; the rest skip it.
    Tensor-parallel, the loss is the vocabulary-parallel cross-entropy and forward with
    targets returns no logits (None: they are never gathered); ``logits`` gathers them.
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
        # set by troupe.parallel.apply_tensor_parallel: the group, and which rows or columns
        # of each split parameter this rank holds
        self.tp: Communicator | None = None
        self.tp_layout: dict = {}
        self.init_weights(seed)
        # Recompute each block's activations in the backward instead of keeping them
        # (training only): a block's input per layer is kept, not its internals.
        self.checkpoint_activations = False

    def init_weights(self, seed: int, only: set[str] | None = None) -> None:
        """N(0, 0.02) weights (output projections scaled by 1/sqrt(2 * n_layer)), zero biases,
        unit LayerNorms; every tensor from its own generator, so the expert-parallel split
        does not change any value, nor does initialising a few at a time: ``only`` names the
        parameters to set (the rest are left as they are), for a model built on the meta
        device and materialised block by block (troupe.parallel.zero3). A tensor-parallel
        parameter gets its shard of the whole tensor drawn (the same model as one rank's)."""
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
                    split = self.tp_layout.get(name)
                    shape = list(p.shape)
                    if split is not None:
                        shape[split.dim] = split.whole
                    # drawn with a CPU generator: every device starts from the same weights
                    w = torch.randn(shape, generator=g) * s  # host: then copied into p
                    p.copy_(w if split is None else split.shard(w, self.tp.rank))

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None,
                ltd: tuple[int, range, torch.Generator] | None = None, **kw):
        """Logits (B, T, V), the mean next-token loss against ``targets_BT`` (None without),
        and the MoE auxiliary loss. Keywords as for ``hidden``."""
        h, aux = self.hidden(idx_BT, ltd=ltd, **kw)
        if self.tp is not None and targets_BT is not None:
            shard = self.logits_shard(h)
            loss = vocab_parallel_cross_entropy(shard.reshape(-1, shard.shape[-1]),
                                                targets_BT.reshape(-1), self.tp,
                                                self.cfg.vocab_size)
            return None, loss, aux
        logits = self.logits(h)  # (B, T, V)
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets_BT.reshape(-1))
        return logits, loss, aux

    def materialize(self, device: torch.device | str) -> "GPT":
        """A model built on the meta device given uninitialised memory on ``device`` (to be
        initialised or loaded), its buffers recomputed and its experts' parameters still
        marked as experts (``to_empty`` makes new parameters, without the mark). In place."""
        self.to_empty(device=device)
        self.reset_buffers()
        for m in self.modules():
            if isinstance(m, Experts):
                for p in m.parameters():
                    p.expert = True
        return self

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
        x = self.tok_emb(idx_BT) if self.tp is None else self._embed_shard(idx_BT)
        if self.cfg.positions == "learned":
            x = x + self.pos_emb(torch.arange(idx_BT.shape[1], device=idx_BT.device)
                                 if pos is None else pos)
        return self.drop(x)

    def _embed_shard(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Token embeddings from this rank's vocabulary rows (zero for the others' tokens),
        summed over the tensor-parallel group."""
        rows = self.tok_emb.weight.shape[0]
        local = idx_BT - self.tp.rank * rows
        mine = (local >= 0) & (local < rows)
        x = self.tok_emb(local.clamp(0, rows - 1)) * mine[..., None]  # called: ZeRO-3's hook
        return reduce_out(x, self.tp)

    @property
    def device(self) -> torch.device:
        """Where the model computes (read from the final norm: the embedding may be held
        quantized, troupe.compression.QuantizedEmbedding)."""
        return self.ln_f.weight.device

    @property
    def cache_heads(self) -> int:
        """The key/value heads a layer's cache holds here: the config's, or a tensor-parallel
        rank's own."""
        return self.blocks[0].attn.n_kv

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
        if self.tp is not None:
            return gather_vocab(self.logits_shard(h), self.tp, self.cfg.vocab_size)
        head = getattr(self, "lm_head", None)
        return F.linear(h, self.tok_emb.weight) if head is None else head(h)

    def logits_shard(self, h: torch.Tensor) -> torch.Tensor:
        """Tensor-parallel: this rank's columns of the logits (..., padded vocabulary / T),
        from its rows of the output head (the tied embedding's, or lm_head's)."""
        head = getattr(self, "lm_head", None)  # a Linear, or the quantized tied projection's
        h = copy_in(h, self.tp)
        return F.linear(h, self.tok_emb.weight) if head is None else head(h)

    def hidden(self, idx_BT: torch.Tensor, ltd: tuple[int, range, torch.Generator] | None = None,
               valid_BS: torch.Tensor | None = None,
               cache: KVCache | RowCache | PrefixTree | None = None,
               segments_BT: torch.Tensor | None = None):
        """Final hidden states (B, T, C) after ln_f, and the MoE auxiliary loss.

        valid_BS: which of the S = cache.length + T positions hold real tokens (False for
        padding, on the left or between a shared prefix and what follows it); positions are
        then counted over real tokens only, so a left-padded prompt is embedded as if it
        started at position 0. cache: KVCache to extend with these T tokens, a RowCache (each
        row from its own length; no valid_BS), or a PrefixTree whose packed tokens these are
        (positions and attention then come from the tree).
        """
        B, T = idx_BT.shape
        if isinstance(cache, RowCache) and valid_BS is not None:
            raise ValueError("a RowCache's rows have no padding before their tokens: no valid_BS")
        L = cache.length if isinstance(cache, (KVCache, PrefixTree)) else 0
        span = self._span(T, L, valid_BS, cache, segments_BT)
        pos, mask, keys = _positions(idx_BT, valid_BS, cache, segments_BT, L)
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
            cache.advance(T)
        return self.ln_f(x), aux


    def _span(self, T: int, L: int, valid_BS: torch.Tensor | None,
              cache: KVCache | RowCache | PrefixTree | None, segments_BT: torch.Tensor | None
              ) -> int:
        """The longest row's positions, checked against the context."""
        span = cache.span if isinstance(cache, (PrefixTree, RowCache)) else L + T
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
        return span

def _positions(idx_BT: torch.Tensor, valid_BS: torch.Tensor | None,
               cache: KVCache | RowCache | PrefixTree | None, segments_BT: torch.Tensor | None,
               L: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The new tokens' positions, the attention mask (None: causal over everything) and the
    keys' positions where the case has them at hand (else None): from a prefix tree, a packed
    batch's segments, plain columns, one decoded token per row, or a padded batch."""
    T = idx_BT.shape[1]
    if isinstance(cache, PrefixTree):
        return cache.positions, None, None
    if isinstance(cache, RowCache):  # a token's column is its position
        return (cache.positions(T), cache.mask(T),
                torch.arange(cache.span, device=idx_BT.device)[None])
    if segments_BT is not None:
        if valid_BS is not None or cache is not None:
            raise ValueError("segments_BT (a packed batch) takes no valid_BS or cache")
        pos = segment_positions(segments_BT)
        return pos, segment_mask(segments_BT), pos
    if valid_BS is None:
        return torch.arange(L, L + T, device=idx_BT.device), None, None
    if T == 1:  # one new token per sequence (decoding): it may see every real key
        return valid_BS.sum(1, keepdim=True) - 1, valid_BS[:, None, None, :], None
    keys = (valid_BS.long().cumsum(1) - 1).clamp_min(0)  # (B, S)
    return keys[:, L:], attention_mask(valid_BS, T), keys


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
