"""The pieces that tell the decoder families apart: RMSNorm, rotary position embeddings (with
Llama 3's frequency scaling), the norm a config asks for, the MLP (GELU or SwiGLU); and the
cross-entropy of logits split by vocabulary (tensor parallelism, troupe.parallel.tensor)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from troupe.collectives import Communicator, copy_in, reduce_out


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (Llama, Qwen2, Mistral). ``tp``: a
    tensor-parallel group whose ranks each normalise part of the rows with the same weight
    (Qwen3's per-head q and k norms over split heads): the weight's gradient is summed."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, tp: Communicator | None = None) -> torch.Tensor:
        weight = self.weight if tp is None else copy_in(self.weight, tp)
        if x.dtype == torch.float32:  # one fused op (a decode step has 60 of these)
            return F.rms_norm(x, weight.shape, weight, self.eps)
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * y.to(x.dtype)


def norm(kind: str, dim: int, eps: float, bias: bool = True) -> nn.Module:
    """The normalisation layer ``kind`` ("layernorm" or "rmsnorm") of width ``dim``."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    return nn.LayerNorm(dim, eps=eps, bias=bias)


ROPE_TYPES = ("linear", "llama3", "yarn")  # the rope_scaling kinds troupe computes


def rope_type(scaling: dict | None) -> str | None:
    """A Hugging Face rope_scaling dict's kind: "rope_type", or "type" in older configs."""
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) of rotary embeddings, stretched by ``scaling``
    (a Hugging Face rope_scaling dict) for a context longer than pretraining's:
    "linear" divides every frequency by ``factor`` (position interpolation);
    "llama3" (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    divides the long wavelengths only, blending in between, as Llama 3.1 does;
    "yarn" (factor, original_max_position_embeddings, beta_fast 32, beta_slow 1, truncate)
    interpolates the dimensions that turn fewer than beta_slow times over the original
    context, keeps those that turn more than beta_fast times, and ramps linearly in between
    (YaRN, Peng et al. 2023); its attention factor is ``rope_attention_factor``."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64)  # host: a buffer, moves with its module
    inv = 1.0 / theta ** (steps.float() / head_dim)
    if not scaling:
        return inv
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported "
                         f"({', '.join(ROPE_TYPES)} are)")
    factor = scaling["factor"]
    if kind == "linear":
        return inv / factor
    old = scaling["original_max_position_embeddings"]
    if kind == "yarn":
        def dim_of(turns: float) -> float:  # the dimension that turns ``turns`` times in ``old``
            return head_dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        dims = torch.arange(head_dim // 2, dtype=torch.float32)  # host: beside ``inv``
        ramp = ((dims - low) / (high - low if high != low else 0.001)).clamp(0, 1)
        return inv / factor * ramp + inv * (1 - ramp)
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old / low, old / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(between, mid, scaled)


def rope_attention_factor(scaling: dict | None) -> float:
    """What the rotary cos and sin are multiplied by (so q.k by its square): YaRN's
    attention_factor, by default 0.1 ln(factor) + 1 (or the ratio of two such with mscale and
    mscale_all_dim, as DeepSeek's configs give); 1 for every other kind."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def m(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
    factor, mscale, all_dim = (scaling["factor"], scaling.get("mscale"),
                               scaling.get("mscale_all_dim"))
    return m(factor, mscale) / m(factor, all_dim) if mscale and all_dim else m(factor)


def rope_angles(pos: torch.Tensor, inv_freq: torch.Tensor,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of positions ``pos`` ((T,) or (B, T)) as ``apply_rope`` takes it:
    (cos, cos) and (-sin, sin) of the positions times the frequencies, each (..., T, 1, D),
    broadcasting over (B, T, heads, D), times ``scale`` (``rope_attention_factor``);
    computed once per forward and shared by every layer."""
    angles = pos.to(inv_freq.device, torch.float32)[..., None] * inv_freq  # (..., T, D/2)
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat([cos, cos], -1).unsqueeze(-2), torch.cat([-sin, sin], -1).unsqueeze(-2)


def apply_rope(x_BTHD: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x (B, T, heads, D) by ``rope_angles``, half-split layout (the first D/2 features
    pair with the last D/2, as in Hugging Face's Llama): x1 cos - x2 sin, x2 cos + x1 sin,
    written as x (cos, cos) + (x2, x1) (-sin, sin) (the same numbers, in four ops)."""
    cos, sin = angles
    x = x_BTHD.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([x2, x1], -1) * sin).to(x_BTHD.dtype)


class MLP(nn.Module):
    """GELU (exact or tanh) MLP, or SwiGLU with ``fc`` holding the gate and up projections
    stacked (gate first). ``tp``: the tensor-parallel group, once troupe.parallel.tensor has
    split ``fc`` by rows and ``proj`` by columns."""

    def __init__(self, d_model: int, d_ff: int, kind: str = "gelu", bias: bool = True):
        super().__init__()
        self.kind = kind
        width = 2 * d_ff if kind == "swiglu" else d_ff
        self.fc, self.proj = nn.Linear(d_model, width, bias=bias), nn.Linear(d_ff, d_model,
                                                                              bias=bias)
        self.tp: Communicator | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x if self.tp is None else copy_in(x, self.tp))
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh" if self.kind == "gelu_tanh" else "none")
        return row_parallel(self.proj, h, self.tp), x.new_zeros(())


def row_parallel(linear: nn.Module, x: torch.Tensor, group: Communicator | None) -> torch.Tensor:
    """``linear(x)``, or with a tensor-parallel ``group`` (``linear`` holding this rank's
    columns), the partial products summed over the group and then the bias added once."""
    if group is None:
        return linear(x)
    if not isinstance(linear, nn.Linear):  # a quantized layer (troupe.compression) adds its
        # own bias: held by rank 0 alone (troupe.parallel.tensor.bias_on_first_rank)
        return reduce_out(linear(x), group)
    y = reduce_out(F.linear(x, linear.weight), group)
    return y if linear.bias is None else y + linear.bias


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 group: Communicator, vocab: int,
                                 ignore_index: int = -100) -> torch.Tensor:
    """The mean next-token loss of targets (N,) under logits (N, Vp / T) that hold this rank's
    vocabulary shard (columns rank * Vp/T ...; those at or past ``vocab`` are padding): as
    F.cross_entropy of the whole logits, without gathering them. Targets equal to
    ``ignore_index`` do not count."""
    logp, _ = vocab_parallel_logprobs(logits, targets, group, vocab)
    keep = targets != ignore_index
    return -(logp * keep).sum() / keep.sum().clamp_min(1)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, group: Communicator,
                            vocab: int, entropy: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) (N,) under logits (N, Vp / T) that hold this rank's vocabulary shard (as
    ``vocab_parallel_cross_entropy``), differentiable; with ``entropy``, also each row's
    entropy (N,), without gradient. Each rank's maximum, sum of exponentials, target logit
    (and sum of p x logit) are all-reduced: numbers per row, never the logits."""
    logits = logits.float()
    width = logits.shape[-1]
    lo = group.rank * width
    if lo + width > vocab:  # the padding rows of the vocabulary are no token
        logits = logits.masked_fill(torch.arange(lo, lo + width, device=logits.device) >= vocab,
                                    float("-inf"))
    with torch.no_grad():  # the shift changes no value (softmax ignores it)
        top = group.all_reduce(logits.max(-1).values.contiguous(), "max")
    shifted = logits - top[:, None]
    sum_exp = reduce_out(shifted.exp().sum(-1), group)
    local = targets - lo
    mine = (local >= 0) & (local < width)
    picked = torch.where(mine, shifted.gather(1, local.clamp(0, width - 1)[:, None])[:, 0], 0.0)
    logp = reduce_out(picked, group) - sum_exp.log()
    if not entropy:
        return logp, None
    with torch.no_grad():  # H = log Z - sum_v p_v s_v, with s the shifted logits
        e = shifted.exp()
        weighted = torch.where(e > 0, e * shifted, 0.0).sum(-1)  # exp(-inf) * -inf is nan
        ent = sum_exp.log() - group.all_reduce(weighted.contiguous(), "sum") / sum_exp
    return logp, ent
