"""The top-k gate: which experts each token goes to, with what weight, and which assignments
fit in the experts' capacity. Routing stays sparse (tokens x k), never tokens x experts x capacity."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from troupe.models.moe.config import MoEConfig


@dataclass
class Routing:
    """The gate's decision for S tokens and k choices each.

    experts_SK: expert index of each choice; weights_SK: combine weight (0 where dropped);
    kept_SK: whether the choice fits in its expert's capacity; aux_loss: load-balancing loss;
    capacity: the per-expert limit that was applied (None when dropless).
    """

    experts_SK: torch.Tensor
    weights_SK: torch.Tensor
    kept_SK: torch.Tensor
    aux_loss: torch.Tensor
    capacity: int | None


def capacity(num_tokens: int, num_experts: int, top_k: int, factor: float,
             min_capacity: int) -> int:
    """max(ceil(top_k * factor * tokens / experts), min_capacity)."""
    return max(math.ceil(top_k * factor * num_tokens / num_experts), min_capacity)


def keep_within_capacity(experts_SK: torch.Tensor, priority_SK: torch.Tensor, num_experts: int,
                         cap: int) -> torch.Tensor:
    """True for the ``cap`` assignments of lowest priority value at each expert."""
    S, K = experts_SK.shape
    e_A, prio_A = experts_SK.reshape(-1), priority_SK.reshape(-1)
    by_prio = torch.argsort(prio_A, stable=True)
    by_expert = by_prio[torch.argsort(e_A[by_prio], stable=True)]  # expert-major, then priority
    counts_E = torch.bincount(e_A, minlength=num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    slot_A = torch.empty_like(e_A)
    slot_A[by_expert] = torch.arange(e_A.numel(), device=e_A.device) - starts_E[e_A[by_expert]]
    return (slot_A < cap).view(S, K)


class TopKGate(nn.Module):
    """Linear(M, E) in fp32, softmax, top-k, capacity, and the load-balancing loss
    E * sum_e(mean gate prob_e * fraction of tokens whose first choice is e)."""

    def __init__(self, d_model: int, num_experts: int, cfg: MoEConfig):
        super().__init__()
        if cfg.top_k > num_experts:
            raise ValueError(f"moe.top_k={cfg.top_k} exceeds the {num_experts} experts")
        self.wg = nn.Linear(d_model, num_experts, bias=False, dtype=torch.float32)
        self.num_experts, self.cfg = num_experts, cfg

    def forward(self, x_SM: torch.Tensor) -> Routing:
        cfg, E, S = self.cfg, self.num_experts, x_SM.shape[0]
        x_SM = x_SM.float()
        if self.training and cfg.noisy_gate == "jitter":
            x_SM = x_SM * torch.empty_like(x_SM).uniform_(1 - cfg.jitter_eps, 1 + cfg.jitter_eps)
        logits_SE = self.wg(x_SM)
        probs_SE = F.softmax(logits_SE, dim=-1)
        choose_SE = logits_SE
        if self.training and cfg.noisy_gate == "rsample":
            gumbel = -torch.log(-torch.log(torch.rand_like(logits_SE).clamp_min(1e-20)))
            choose_SE = logits_SE + gumbel
        experts_SK = torch.topk(choose_SE.detach(), cfg.top_k, dim=-1).indices
        probs_SK = probs_SE.gather(1, experts_SK)

        first_choice_E = torch.bincount(experts_SK[:, 0], minlength=E).float() / max(S, 1)
        aux_loss = E * torch.sum(probs_SE.mean(0) * first_choice_E)

        cap = None
        kept_SK = torch.ones_like(experts_SK, dtype=torch.bool)
        if not cfg.dropless:
            factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
            cap = capacity(S, E, cfg.top_k, factor, cfg.min_capacity)
            kept_SK = keep_within_capacity(experts_SK, self._priority(probs_SK), E, cap)
        weights_SK = probs_SK * kept_SK
        if cfg.top_k > 1 and cfg.normalize_top_k:  # the kept choices of a token share weight 1
            weights_SK = weights_SK / weights_SK.sum(-1, keepdim=True).clamp_min(
                torch.finfo(weights_SK.dtype).eps)
        return Routing(experts_SK, weights_SK, kept_SK, aux_loss, cap)

    def _priority(self, probs_SK: torch.Tensor) -> torch.Tensor:
        """Lower goes first: every first choice before any second one; within a choice, by
        token position, by falling probability, or at random (random token selection)."""
        S, K = probs_SK.shape
        dev = probs_SK.device
        choice = torch.arange(K, dtype=torch.float64, device=dev).expand(S, K) * 2
        if self.training and self.cfg.random_token_selection:
            within = torch.rand(S, K, dtype=torch.float64, device=dev)
        elif self.cfg.drop_policy == "probs":
            within = 1 - probs_SK.detach().double()
        else:
            within = (torch.arange(S, dtype=torch.float64, device=dev) / max(S, 1))[:, None].expand(S, K)
        return choice + within
