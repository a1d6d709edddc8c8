"""Two-layer MLPs of many experts over rows grouped by expert, with a hand-written backward.

    GELU:   y[rows of e] = gelu(x[rows of e] @ w1[e] + b1[e]) @ w2[e] + b2[e]
    SwiGLU: g | u = x[rows of e] @ w1[e] (gate and up stacked, w1 is (M, 2H)),
            y[rows of e] = (silu(g) * u) @ w2[e]            (Mixtral's experts; biases optional)

Indexing stacked weights per expert under autograd (``w1[e]`` in a loop) makes every index's
backward allocate a zero gradient of the whole stack and autograd add them up: E^2 work. Here
the backward writes each expert's gradient straight into its slice of one buffer per stacked
weight, so time follows the tokens. Only x and each expert's pre-activation are kept for the
backward (the activation's output is recomputed one expert at a time), and the backward releases each
pre-activation once its expert is done while that expert's gradients fill in, so the two never
peak together; per-expert temporaries live for one expert. A second backward through the same
graph (retain_graph=True) is therefore refused.

Where a weight already has a ``.grad`` that this backward would add into (``loss.backward()``
with gradients kept between steps, as troupe's flat gradient buffers are), the expert gradients
are added into it in place, as Megatron's gradient-accumulation fusion does: no fresh
experts-sized buffer (whose first touch costs page faults on every step) and no separate add.
``torch.autograd.grad`` and ``backward(inputs=...)`` without the weight still get a gradient
returned the ordinary way; tensor hooks on the stacked weights do not see in-place additions.

Torch ops only: the same code runs on CPU and CUDA tensors, any float dtype. Under
``torch.autocast`` (bf16 mixed precision) the rows and weights are cast to the autocast dtype
first, as autocast casts a Linear's, and the experts run in it; the casts carry the gradients
back to the fp32 weights (without the in-place accumulation above).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.autograd.graph import get_gradient_edge


class _GroupedMLP(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_AM, w1_EMH, b1_EH, w2_EHM, b2_EM, counts: list[int], swiglu: bool,
                accumulators):
        y_AM = x_AM.new_empty(x_AM.shape[0], w2_EHM.shape[2])
        h_pre = []  # each expert's (n_e, H) pre-activation, kept for the backward; one tensor
        # per expert rather than one (A, H) buffer, so that the allocator can reuse its blocks
        for e, (lo, hi) in enumerate(_spans(counts)):
            h = _linear(x_AM[lo:hi], w1_EMH[e], None if b1_EH is None else b1_EH[e])
            a = activation(h, swiglu)
            if b2_EM is None:
                torch.mm(a, w2_EHM[e], out=y_AM[lo:hi])
            else:
                torch.addmm(b2_EM[e], a, w2_EHM[e], out=y_AM[lo:hi])
            h_pre.append(h)
        ctx.save_for_backward(x_AM, w1_EMH, w2_EHM)
        ctx.h_pre = h_pre  # intermediates: released expert by expert in the backward
        ctx.weights = (w1_EMH, b1_EH, w2_EHM, b2_EM)
        ctx.counts, ctx.swiglu, ctx.accumulators = counts, swiglu, accumulators
        return y_AM

    @staticmethod
    @once_differentiable
    def backward(ctx, gy_AM):
        x_AM, w1_EMH, w2_EHM = ctx.saved_tensors
        h_pre, ctx.h_pre = ctx.h_pre, None
        if h_pre is None:
            raise RuntimeError("grouped_mlp releases its activations during the backward: a "
                               "second backward through it (retain_graph=True) is not supported")
        gy_AM = gy_AM.contiguous()
        gx_AM = torch.empty_like(x_AM) if ctx.needs_input_grad[0] else None
        # per weight: (buffer, True when it is the weight's own .grad and we add into it)
        grads = [_grad_buffer(w, node, needed) for w, node, needed in
                 zip(ctx.weights, ctx.accumulators, ctx.needs_input_grad[1:5])]
        (gw1, add1), (gb1, addb1), (gw2, add2), (gb2, addb2) = grads
        for e, (lo, hi) in enumerate(_spans(ctx.counts)):
            if hi == lo:  # an expert that got no rows: zero gradient, nothing to add
                for g, adds in grads:
                    if g is not None and not adds:
                        g[e].zero_()
                continue
            x, h, gy = x_AM[lo:hi], h_pre[e], gy_AM[lo:hi]  # (n, M), (n, H | 2H), (n, M)
            h_pre[e] = None  # freed once h is
            if gw2 is not None:
                _mm_into(gw2[e], activation(h, ctx.swiglu).t(), gy, add2)  # (H, M)
            if gb2 is not None:
                _sum_into(gb2[e], gy, addb2)
            gh = _activation_backward(gy @ w2_EHM[e].t(), h, ctx.swiglu)  # like h
            if gw1 is not None:
                _mm_into(gw1[e], x.t(), gh, add1)  # (M, H | 2H)
            if gb1 is not None:
                _sum_into(gb1[e], gh, addb1)
            if gx_AM is not None:
                torch.mm(gh, w1_EMH[e].t(), out=gx_AM[lo:hi])
        w1g, b1g, w2g, b2g = (None if adds else g for g, adds in grads)
        return gx_AM, w1g, b1g, w2g, b2g, None, None, None


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x @ w if b is None else torch.addmm(b, x, w)


def activation(h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """An expert's activation of its pre-activation ``h``: GELU, or SwiGLU of the stacked
    gate and up halves."""
    if not swiglu:
        return F.gelu(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _activation_backward(ga: torch.Tensor, h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """The gradient at the pre-activation ``h`` from the gradient ``ga`` at its output."""
    if not swiglu:
        return torch.ops.aten.gelu_backward(ga, h)
    gate, up = h.chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    silu = gate * s
    # d silu(g) / dg = s * (1 + g * (1 - s))
    return torch.cat([ga * up * s * (1 + gate * (1 - s)), ga * silu], dim=-1)


def _grad_buffer(w: torch.Tensor, node, needed: bool) -> tuple[torch.Tensor | None, bool]:
    """``(w.grad, True)`` when this backward will accumulate into ``w.grad`` anyway, else a new
    buffer; ``(None, True)`` when ``w`` needs no gradient (nothing is written)."""
    if not needed or w is None:
        return None, True
    g = w.grad if node is not None else None  # node: the leaf's AccumulateGrad
    if (g is not None and not torch.is_grad_enabled() and g.shape == w.shape
            and g.dtype == w.dtype and g.device == w.device and g.is_contiguous()
            and _engine_accumulates(node)):
        return g, True
    return torch.empty_like(w), False


def _engine_accumulates(node) -> bool:
    """Whether the running backward executes ``node`` (a leaf's AccumulateGrad): true for
    ``backward()``, false under ``autograd.grad`` or ``backward(inputs=...)`` without it."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # raised for leaves during torch.autograd.grad
        return False


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    if add:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _sum_into(out: torch.Tensor, g: torch.Tensor, add: bool) -> None:
    if add:
        out.add_(g.sum(0))
    else:
        torch.sum(g, 0, out=out)


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    spans, lo = [], 0
    for n in counts:
        spans.append((lo, lo + n))
        lo += n
    return spans


def grouped_mlp(x_AM: torch.Tensor, counts: list[int], w1_EMH: torch.Tensor,
                b1_EH: torch.Tensor | None, w2_EHM: torch.Tensor, b2_EM: torch.Tensor | None,
                swiglu: bool = False) -> torch.Tensor:
    """Each expert's MLP on its rows: ``x_AM`` holds ``counts[e]`` rows for expert e, in
    expert order (sum(counts) == A); returns (A, M_out). GELU by default; ``swiglu`` reads
    w1 as the gate and up projections stacked along its last dimension (M, 2H). Biases may be
    None."""
    if len(counts) != w1_EMH.shape[0] or sum(counts) != x_AM.shape[0]:
        raise ValueError(f"counts {counts} do not fit {x_AM.shape[0]} rows of "
                         f"{w1_EMH.shape[0]} experts")
    weights = (w1_EMH, b1_EH, w2_EHM, b2_EM)
    device = x_AM.device.type
    if torch.is_autocast_enabled(device):  # one dtype for everything, as autocast's matmuls
        dtype = torch.get_autocast_dtype(device)
        x_AM = x_AM.to(dtype)
        weights = tuple(None if w is None else w.to(dtype) for w in weights)
    track = torch.is_grad_enabled()
    accumulators = tuple(get_gradient_edge(w).node if track and w is not None and
                         w.requires_grad and w.is_leaf else None for w in weights)
    with torch.autocast(device, enabled=False):  # the ops run in the dtype just chosen
        return _GroupedMLP.apply(x_AM.contiguous(), *weights, counts, swiglu, accumulators)
