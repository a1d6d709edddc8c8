"""Quantized replacements for nn.Linear and a function that swaps them into a model.

Modes: "w8a8" (INT8 weights per output channel, token-wise INT8 activations, INT8 GEMM;
optionally a few calibrated outlier input channels kept in fp32, below),
"w8a16" and "w4a16" (weight-only: group-wise INT8 / packed INT4 weights with 16-bit
activations: token-wise INT16 in the native VNNI kernel; elsewhere fp32 activations, a portable
row-at-a-time loop for a few tokens and the dequantized weight's fp32 GEMM for more),
"ternary" and "binary" (XTC's extreme compression, troupe.compression.lowbit: weights in
{-1, 0, +1} or {-1, +1} times one scale a row, packed 1.6 or 1 bit a weight, token-wise INT8
activations, troupe.kernels.lowbit's product), "fp8" (e4m3 weights and activations with
row-wise scales, one torch._scaled_mm: troupe.compression.fp8; dense layers only), "fp32"
(leave the layer alone). MoE experts (stacked weights) are quantized expert by expert, each
expert's two matrices like Linears (QuantizedExperts).

LoRC (ZeroQuant-V2's low-rank compensation, ``lorc_rank`` > 0): the quantization error
E = W - dq(q(W)) is approximated by its best rank-r factors U_r S_r V_r^T (truncated SVD), kept
in fp32 beside the integer weight, and y = quantized(x) + (x V_r) (U_r S_r)^T. It costs
r * (I + O) fp32 values per layer.

Outlier channels (W8A8, LLM.int8()'s decomposition with a static channel set): a few input
channels of an LLM's activations run 10-100x the median (SmolLM2's down-projection inputs reach
490 where the median is 9), so a token's INT8 scale, set by its largest value, leaves the other
channels a handful of levels. The k channels with the largest calibrated max|x| (``outliers``,
from ``outlier_channels``) stay fp32: y = int8(x without them) @ int8(W without them)^T
+ x[:, k] @ W[:, k]^T, a (T, k) x (k, O) fp32 product beside the INT8 GEMM. SmoothQuant's
alternative (scaling the channels into the weights) was tried on SmolLM2 and did not help:
+3.96% perplexity at alpha 0.5, +51% at 0.8, where the weights' columns took on the outliers."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Callable, Iterable

import torch
from torch import nn

from troupe.compression.embedding import QuantizedEmbedding
from troupe.compression.fp8 import Fp8Linear
from troupe.compression.lowbit import quantize_lowbit
from troupe.config import ConfigError
from troupe.kernels.grouped_mlp import activation
from troupe.kernels.lowbit import LowbitWeight, lowbit_weight_linear, native_layout
from troupe.kernels.quant import (QuantizedWeight, dequantize_weight, group_divisor,
                                  int8_linear, quantize_weight, row_layout, vnni_layout,
                                  weight_only_linear)
from troupe.models.moe.experts import Experts
from troupe.models.moe.gate import TopKGate

MODES = ("fp32", "w8a8", "w8a16", "w4a16", "ternary", "binary", "fp8")
LOWBIT = ("ternary", "binary")
EMBEDDINGS = {"fp32": None, "int8": "w8a16", "int4": "w4a16"}  # -> the tied output's mode


class QuantizedLinear(nn.Module):
    """An nn.Linear held as integer weights plus scales (bias kept in fp32)."""

    def __init__(self, linear: nn.Linear, mode: str, group_size: int = 64, lorc_rank: int = 0,
                 outliers: torch.Tensor | None = None):
        super().__init__()
        if mode not in MODES[1:]:
            raise ValueError(f"mode must be one of {MODES[1:]}, got {mode!r}")
        O, I = linear.weight.shape
        if not 0 <= lorc_rank <= min(O, I):
            raise ValueError(f"lorc_rank must be in 0..{min(O, I)} for a {O}x{I} layer, "
                             f"got {lorc_rank}")
        self.mode, self.in_features, self.out_features = mode, I, O
        self.group_size = group_size
        w = linear.weight.detach().float()
        self.outliers: torch.Tensor | None = None  # (k,) input channels kept in fp32 (w8a8)
        self.outlier_w: torch.Tensor | None = None  # (k, O) their weight columns, as rows
        if outliers is not None and len(outliers) and mode == "w8a8":
            self.outliers = outliers.to(device=w.device, dtype=torch.long).contiguous()
            self.outlier_w = w[:, self.outliers].t().contiguous()
            w = w.clone()
            w[:, self.outliers] = 0  # the INT8 part never sees them: its scales ignore them
        self.qw = quantize_for(w, mode, group_size)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)
        self.lorc_down: torch.Tensor | None = None  # (r, I): V_r^T
        self.lorc_up: torch.Tensor | None = None    # (O, r): U_r S_r
        if lorc_rank:
            U, S, Vh = torch.linalg.svd(w - self.dequantized_weight(), full_matrices=False)
            self.lorc_down = Vh[:lorc_rank].contiguous()
            self.lorc_up = (U[:, :lorc_rank] * S[:lorc_rank]).contiguous()

    @property
    def weight_nbytes(self) -> int:
        extra = 0 if self.lorc_down is None else 4 * (self.lorc_down.numel() + self.lorc_up.numel())
        if self.outlier_w is not None:
            extra += 4 * self.outlier_w.numel() + 8 * self.outliers.numel()
        return self.qw.nbytes + extra

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight | LowbitWeight, mode: str,
                       bias: torch.Tensor | None = None, group_size: int = 64
                       ) -> "QuantizedLinear":
        """A layer around weights quantized already (read from a quantized model directory,
        troupe.compression.artifact), laid out for this machine's kernels."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.mode, layer.group_size = mode, group_size
        layer.out_features, layer.in_features = qw.shape
        layer.qw = native_layout(qw) if isinstance(qw, LowbitWeight) else vnni_layout(qw)
        layer.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        layer.outliers = layer.outlier_w = layer.lorc_down = layer.lorc_up = None
        return layer

    def dequantized_weight(self) -> torch.Tensor:
        if isinstance(self.qw, LowbitWeight):
            return self.qw.dequantize()
        return dequantize_weight(self.qw)

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)``, ``.cuda()`` and the like move the integer weights, their scales
        and the LoRC factors too (they are not parameters)."""
        super()._apply(fn, recurse)
        if isinstance(self.qw, LowbitWeight):
            self.qw = self.qw.map(fn)
            return self
        rows = row_layout(self.qw)  # packed for the CPU kernel only while on the CPU
        # a cast (``.to(torch.float64)``) moves them but leaves them fp32: the integer
        # product's scales, the LoRC factors and the outlier columns are fp32 by design
        self.qw = vnni_layout(dataclasses.replace(rows, q=fn(rows.q),
                                                  scales=fn(rows.scales).float()))
        if self.lorc_down is not None:
            self.lorc_down, self.lorc_up = fn(self.lorc_down).float(), fn(self.lorc_up).float()
        if self.outliers is not None:
            self.outliers, self.outlier_w = fn(self.outliers), fn(self.outlier_w).float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.mode in LOWBIT:
            y = lowbit_weight_linear(x2, self.qw, self.bias)
        elif self.mode == "w8a8":
            y = int8_linear(x2, self.qw, self.bias, None if self.outliers is None else
                            (self.outliers, self.outlier_w))
        else:
            y = weight_only_linear(x2, self.qw, self.bias)
        if self.lorc_down is not None:
            y = y + (x2.float() @ self.lorc_down.t()) @ self.lorc_up.t()
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def int8_operands(self) -> tuple | None:
        """What the native W8A8 kernel takes for this layer, in its order (the packed weight,
        column sums, scales, bias, outputs, outlier channels and their rows), for a decode step
        that runs it without Python (troupe.generation.decode_layers); None unless the layer is
        W8A8 without LoRC factors, packed for the kernel on a CPU that has it."""
        if not (self.mode == "w8a8" and self.lorc_down is None and self.qw.layout == "vnni"):
            return None
        f32 = lambda t: None if t is None else t.detach().float().contiguous()  # noqa: E731
        return (self.qw.q, self.qw.colsum, f32(self.qw.scales), f32(self.bias), self.qw.shape[0],
                self.outliers, f32(self.outlier_w))


def requantize(quantized: nn.Module, source: nn.Module) -> None:
    """Bring ``quantized`` (a ``quantize_model`` copy of ``source``) up to date with source's
    current weights in place: each QuantizedLinear re-quantized from the nn.Linear of the same
    name, every other parameter and buffer copied. What RLHF's INT8 rollouts do after each
    policy update instead of copying and quantizing the whole model again. ValueError naming
    the layer when the two models do not match."""
    layers = dict(source.named_modules())
    for name, q in quantized.named_modules():
        if not isinstance(q, QuantizedLinear):
            continue
        lin = layers.get(name) or (tied_output(source) if name == "lm_head" else None)
        if not isinstance(lin, nn.Linear) or lin.weight.shape != (q.out_features, q.in_features):
            raise ValueError(f"requantize: {name!r} is not a {q.in_features} -> "
                             f"{q.out_features} nn.Linear in the source model")
        if q.lorc_down is not None or q.outliers is not None:
            raise ValueError(f"requantize: {name!r} has LoRC factors or outlier channels, "
                             "which need calibration: quantize a fresh copy")
        q.qw = quantize_for(lin.weight.detach().float().to(q.qw.scales.device), q.mode,
                            q.group_size)
    # the biases (parameters of the same names), embeddings, norms: copied as they are
    tensors = dict(source.named_parameters()) | dict(source.named_buffers())
    for name, t in [*quantized.named_parameters(), *quantized.named_buffers()]:
        src = tensors.get(name)
        if src is not None and src.shape == t.shape:
            t.data.copy_(src.detach())


class QuantizedExperts(nn.Module):
    """A layer's local MoE experts with integer weights: expert e's up and down projections
    become QuantizedLinears (each quantized on its own, so any expert-parallel split of the
    layer holds the same integer weights)."""

    def __init__(self, experts: Experts, mode: str, group_size: int = 64, lorc_rank: int = 0):
        super().__init__()
        self.num_local, self.first, self.mode = experts.num_local, experts.first, mode
        self.mlp = experts.mlp

        def linear(w_IO: torch.Tensor, b_O: torch.Tensor | None) -> QuantizedLinear:
            lin = nn.Linear(*w_IO.shape, bias=b_O is not None, device="meta")  # x @ w + b
            lin.weight = nn.Parameter(w_IO.detach().t(), requires_grad=False)
            if b_O is not None:
                lin.bias = nn.Parameter(b_O.detach(), requires_grad=False)
            return QuantizedLinear(lin, mode, group_size, lorc_rank)

        def bias(b: torch.Tensor | None, e: int) -> torch.Tensor | None:
            return None if b is None else b[e]

        self.up = nn.ModuleList(linear(experts.w1[e], bias(experts.b1, e))
                                for e in range(self.num_local))
        self.down = nn.ModuleList(linear(experts.w2[e], bias(experts.b2, e))
                                  for e in range(self.num_local))

    def forward(self, x_AM: torch.Tensor, counts: list[int]) -> torch.Tensor:
        swiglu = self.mlp == "swiglu"
        outs = [self.down[e](activation(self.up[e](x), swiglu))
                for e, x in enumerate(x_AM.split(counts))]
        return torch.cat(outs) if outs else x_AM


def quantize_for(w_OI: torch.Tensor, mode: str, group_size: int = 64
                 ) -> QuantizedWeight | LowbitWeight:
    """The weight quantization a mode uses: one scale per output channel for w8a8 (the INT8
    GEMM is rescaled per column anyway, so finer costs nothing; groups of 64 rows sharing one
    scale cost SmolLM2 +1.4 points of perplexity), groups along the input for the weight-only
    modes, one scale a row for ternary and binary (packed)."""
    O, I = w_OI.shape
    if mode in LOWBIT:
        return native_layout(quantize_lowbit(w_OI, mode))
    if mode == "w8a8":
        return vnni_layout(quantize_weight(w_OI, 8, 1, axis=0))
    if mode in ("w8a16", "w4a16"):
        return vnni_layout(quantize_weight(w_OI, 8 if mode == "w8a16" else 4,
                                           group_divisor(I, group_size), axis=1))
    raise ValueError(f"mode must be one of {MODES[1:]}, got {mode!r}")


def quantize_model(model: nn.Module, rules: dict[str, str], group_size: int = 64,
                   lorc_rank: int = 0,
                   outliers: dict[str, torch.Tensor] | None = None,
                   embedding: str = "fp32") -> dict[str, str]:
    """Replace each nn.Linear whose qualified name matches a rule's glob pattern (first match
    wins) by a QuantizedLinear of that rule's mode (with LoRC factors of ``lorc_rank``), and
    each MoE Experts module likewise by QuantizedExperts; returns {module name: mode} for the
    replaced ones. Example: {"*.attn.*": "w8a8", "*.ffn.*": "w4a16"} (ZeroQuant's W4/8).
    MoE gates stay fp32 whatever the rules say: they are tiny, and routing is where a small
    error changes a token's whole path. A tied output projection (``tied_output``) is
    quantized only by a rule named exactly "lm_head". ``outliers``: {layer name: input
    channels to keep in fp32} for the w8a8 layers (``outlier_channels``). ``embedding``:
    "int8" or "int4" holds the token embedding as QuantizedEmbedding (listed as "tok_emb");
    a tied output projection then gets the same integers (w8a16 / w4a16) unless a rule names
    "lm_head"."""
    if embedding not in EMBEDDINGS:
        raise ValueError(f"embedding must be one of {tuple(EMBEDDINGS)}, got {embedding!r}")
    rules = gates_stay_fp32(model, rules)
    outliers = outliers or {}
    done = replace_linears(model, rules, lambda lin, mode, name: Fp8Linear(lin) if mode == "fp8"
                           else QuantizedLinear(lin, mode, group_size, lorc_rank,
                                                outliers.get(name)))
    done.update(quantize_experts(model, rules, group_size, lorc_rank))
    tied = tied_output(model)
    mode = rules.get("lm_head", EMBEDDINGS[embedding] or "fp32")
    if tied is not None and embedding != "fp32" and mode == "fp32":
        raise ValueError(f"embedding={embedding!r} with an fp32 lm_head rule: this model's "
                         "output projection is its embedding matrix, which would be INT")
    emb = None
    if embedding != "fp32" and isinstance(getattr(model, "tok_emb", None), nn.Embedding):
        emb = QuantizedEmbedding.of(model.tok_emb, 8 if embedding == "int8" else 4, group_size)
    if tied is not None and emb is not None and "lm_head" not in rules:
        model.lm_head = QuantizedLinear.from_quantized(emb.qw, mode, None, group_size)
        done["lm_head"] = mode  # the embedding's own integers and scales
    elif mode != "fp32" and tied is not None:
        model.lm_head = Fp8Linear(tied) if mode == "fp8" else QuantizedLinear(
            tied, mode, group_size, lorc_rank, outliers.get("lm_head"))
        done["lm_head"] = mode
    if emb is not None:
        model.tok_emb = emb
        done["tok_emb"] = embedding
    return done


def tied_output(model: nn.Module) -> nn.Linear | None:
    """A model's output projection when it is the input embedding's matrix (no Linear of its
    own; GPT with ``tie_embeddings``), as a Linear sharing that matrix; else None. A rule
    named exactly "lm_head" quantizes it into a separate ``model.lm_head`` (the embedding stays
    fp32 for the lookups): at 49152 x 576, SmolLM2's is a fifth of its weights and, in fp32,
    a quarter of a W4/8A16 decode step (benchmarks/RESULTS.md)."""
    cfg, emb = getattr(model, "cfg", None), getattr(model, "tok_emb", None)
    if not getattr(cfg, "tie_embeddings", False) or emb is None or \
            getattr(model, "lm_head", None) is not None:
        return None
    V, C = emb.weight.shape
    lin = nn.Linear(C, V, bias=False, device="meta")
    lin.weight = nn.Parameter(emb.weight.detach(), requires_grad=False)
    return lin


def gates_stay_fp32(model: nn.Module, rules: dict[str, str]) -> dict[str, str]:
    """``rules`` with an "fp32" rule for every MoE gate put first."""
    gates = {f"{name}.wg": "fp32" for name, m in model.named_modules() if isinstance(m, TopKGate)}
    return {**gates, **rules}


def quantize_experts(model: nn.Module, rules: dict[str, str], group_size: int = 64,
                     lorc_rank: int = 0) -> dict[str, str]:
    """Replace each MoE Experts module that a rule matches by QuantizedExperts."""
    done: dict[str, str] = {}

    def pick(name: str, module: nn.Module) -> nn.Module | None:
        if not isinstance(module, Experts):
            return None
        mode = next((md for pat, md in rules.items() if fnmatch.fnmatch(name, pat)), "fp32")
        if mode == "fp32":
            return None
        if mode == "fp8":
            raise ValueError(f"{name}: fp8 holds dense layers; MoE experts take w8a8, w8a16, "
                             "w4a16, ternary or binary")
        done[name] = mode
        return QuantizedExperts(module, mode, group_size, lorc_rank)

    replace_modules(model, pick)
    return done


def known_modes(rules: dict[str, str]) -> dict[str, str]:
    """``rules`` when every mode is one of MODES; ValueError naming the first pattern whose mode
    is not (the config validators of apps/serve.py and apps/compress.py)."""
    for pattern, mode in rules.items():
        if mode not in MODES:
            raise ValueError(f"pattern {pattern!r}: mode {mode!r} is not one of {MODES}")
    return rules


def check_patterns(model: nn.Module, rules: dict[str, str], whose: str = "the model") -> None:
    """ConfigError naming the first pattern of ``rules`` (the ``quantize`` key) that matches no
    layer of ``model`` (``unmatched_patterns``), with a few of the layers' names."""
    missing = unmatched_patterns(model, rules)
    if missing:
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:3]
        raise ConfigError(f"quantize: pattern {missing[0]!r} matches no layer of {whose} "
                          f"(layers are named like {', '.join(names)})")


def unmatched_patterns(model: nn.Module, rules: dict[str, str]) -> list[str]:
    """The patterns of ``rules`` that match no Linear layer nor MoE experts module of
    ``model`` (a typo that would quietly leave the model unquantized)."""
    names = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Experts))]
    if tied_output(model) is not None:
        names.append("lm_head")
    return [pat for pat in rules if not any(fnmatch.fnmatch(n, pat) for n in names)]


def replace_linears(model: nn.Module, rules: dict[str, str],
                    make: Callable[[nn.Linear, str, str], nn.Module]) -> dict[str, str]:
    """Replace each nn.Linear matched by ``rules`` (glob pattern -> mode, first match wins,
    "fp32" leaves a layer alone) with ``make(linear, mode, name)``; returns {name: mode}
    replaced."""
    for pattern, mode in rules.items():
        if mode not in MODES:
            raise ValueError(f"rule {pattern!r}: mode must be one of {MODES}, got {mode!r}")
    done: dict[str, str] = {}

    def pick(name: str, module: nn.Module) -> nn.Module | None:
        if not isinstance(module, nn.Linear):
            return None
        mode = next((md for pat, md in rules.items() if fnmatch.fnmatch(name, pat)), "fp32")
        if mode == "fp32":
            return None
        done[name] = mode
        return make(module, mode, name)

    replace_modules(model, pick)
    return done


@torch.no_grad()
def outlier_channels(model: nn.Module, batches: Iterable[torch.Tensor],
                     k: int) -> dict[str, torch.Tensor]:
    """For every nn.Linear of ``model``: the ``k`` input channels with the largest max|x| over
    the calibration batches of token ids (B, T) (forward hooks, one pass per batch)."""
    ranges: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            ranges[name] = torch.maximum(ranges[name], x) if name in ranges else x
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, nn.Linear)]
    try:
        model.eval()
        device = next(model.parameters()).device
        for ids in batches:
            model(ids.to(device))
    finally:
        for h in handles:
            h.remove()
    return {name: r.topk(min(k, r.numel())).indices.sort().values for name, r in ranges.items()}


def replace_modules(model: nn.Module,
                    pick: Callable[[str, nn.Module], nn.Module | None]) -> None:
    """Swap every submodule for which ``pick(qualified name, module)`` returns a module."""
    for name, module in list(model.named_modules()):
        new = pick(name, module) if name else None
        if new is not None:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, new)
