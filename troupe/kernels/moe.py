"""MoE token permutation: gather the kept (token, expert) assignments into rows grouped by
expert, and scatter expert outputs back to their tokens weighted by the gate. Index operations
only, so memory and time grow with tokens x top_k, not tokens x experts x capacity. Torch ops
on any device (the same code runs on CUDA tensors)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Plan:
    """How the rows of a permuted batch map back: ``tokens_A[a]`` is the token of row a and
    ``weights_A[a]`` its combine weight; ``counts_E[e]`` rows go to expert e."""

    tokens_A: torch.Tensor
    weights_A: torch.Tensor
    counts_E: torch.Tensor
    num_tokens: int


def permute(x_SM: torch.Tensor, experts_SK: torch.Tensor, weights_SK: torch.Tensor,
            kept_SK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, Plan]:
    """Rows of ``x_SM`` for every kept assignment, grouped by expert (first choices before
    second ones within an expert, then by token): returns (x_AM, plan)."""
    S, K = experts_SK.shape
    kept_A = kept_SK.t().reshape(-1)  # choice-major
    tokens_A = torch.arange(S, device=x_SM.device).repeat(K)[kept_A]
    experts_A = experts_SK.t().reshape(-1)[kept_A]
    weights_A = weights_SK.t().reshape(-1)[kept_A]
    order = torch.argsort(experts_A, stable=True)
    tokens_A, weights_A = tokens_A[order], weights_A[order]
    counts_E = torch.bincount(experts_A, minlength=num_experts)
    return x_SM.index_select(0, tokens_A), Plan(tokens_A, weights_A, counts_E, S)


def unpermute(y_AM: torch.Tensor, plan: Plan) -> torch.Tensor:
    """sum over a token's rows of weight * y: the (S, M) output of the MoE layer."""
    out = y_AM.new_zeros(plan.num_tokens, y_AM.shape[1])
    return out.index_add_(0, plan.tokens_A, y_AM * plan.weights_A[:, None].to(y_AM.dtype))
