"""The arithmetic of DeepSpeed-Chat's PPO and reward model, as pure tensor functions.

Shapes: B sequences, R response positions. ``mask_BR`` marks real response tokens (the prompt is
not part of R; padding after the end of a response is 0)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def kl_rewards(logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor, score_B: torch.Tensor,
               mask_BR: torch.Tensor, kl_coef: float, clip_reward: float = 5.0) -> torch.Tensor:
    """Per-token reward: -kl_coef * (logp - ref_logp) on every response token, plus the
    sequence score clipped to [-clip_reward, clip_reward] on the last one."""
    rewards = -kl_coef * (logp_BR - ref_logp_BR) * mask_BR
    last = last_index(mask_BR)
    rows = torch.arange(len(score_B), device=score_B.device)
    rewards[rows, last] += score_B.clamp(-clip_reward, clip_reward)
    return rewards


def last_index(mask_BR: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row (0 for an empty row)."""
    R = mask_BR.shape[1]
    idx = torch.arange(R, device=mask_BR.device).expand_as(mask_BR)
    return torch.where(mask_BR.bool(), idx, torch.zeros_like(idx)).max(dim=1).values


def gae(rewards_BR: torch.Tensor, values_BR: torch.Tensor, mask_BR: torch.Tensor,
        gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the response; the value after the last real token
    is 0. Returns (advantages, returns = advantages + values), zero outside the mask."""
    B, R = rewards_BR.shape
    adv = torch.zeros_like(rewards_BR)
    next_value = torch.zeros(B, device=rewards_BR.device)
    next_adv = torch.zeros(B, device=rewards_BR.device)
    m = mask_BR.float()
    for t in reversed(range(R)):
        delta = rewards_BR[:, t] + gamma * next_value - values_BR[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m[:, t]
        # through padding the recursion carries on from the next real token unchanged
        next_value = torch.where(m[:, t] > 0, values_BR[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, a, next_adv)
    return adv, (adv + values_BR) * m


def whiten(adv_list: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Advantages of several ranks' rows whitened together: minus the mean, over the standard
    deviation, of every action token in the whole batch; zero off the actions."""
    every = torch.cat([a[m > 0] for a, m in zip(adv_list, masks)])
    mean, std = every.mean(), every.std().clamp_min(1e-6)
    return [(a - mean) / std * m for a, m in zip(adv_list, masks)]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def policy_loss(logp_BR: torch.Tensor, old_logp_BR: torch.Tensor, adv_BR: torch.Tensor,
                mask_BR: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    """The clipped surrogate: mean over tokens of max(-A * ratio, -A * clip(ratio))."""
    ratio = torch.exp(logp_BR - old_logp_BR)
    loss = torch.max(-adv_BR * ratio, -adv_BR * ratio.clamp(1 - clip, 1 + clip))
    return masked_mean(loss, mask_BR)


def value_loss(values_BR: torch.Tensor, old_values_BR: torch.Tensor, returns_BR: torch.Tensor,
               mask_BR: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    """0.5 * max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2), mean over tokens."""
    clipped = torch.max(torch.min(values_BR, old_values_BR + clip), old_values_BR - clip)
    loss = torch.max((values_BR - returns_BR) ** 2, (clipped - returns_BR) ** 2)
    return 0.5 * masked_mean(loss, mask_BR)


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, beta: float = 0.992) -> None:
    """ema = beta * ema + (1 - beta) * model, parameter by parameter."""
    for e, p in zip(ema.parameters(), model.parameters()):
        e.mul_(beta).add_(p.detach(), alpha=1 - beta)


def pairwise_loss(chosen_BS: torch.Tensor, rejected_BS: torch.Tensor,
                  chosen_ids: torch.Tensor, rejected_ids: torch.Tensor,
                  chosen_end: torch.Tensor, rejected_end: torch.Tensor):
    """Reward-model loss -log sigmoid(r_chosen - r_rejected) over the span where the two
    sequences differ: from the first differing position to the later of their last real tokens
    (inclusive). Returns (loss, chosen score, rejected score), the scores being the rewards at
    each sequence's last real token."""
    B, S = chosen_ids.shape
    pos = torch.arange(S, device=chosen_ids.device).expand(B, S)
    differ = chosen_ids != rejected_ids
    first = torch.where(differ, pos, torch.full_like(pos, S)).min(dim=1).values
    first = torch.minimum(first, torch.minimum(chosen_end, rejected_end))
    end = torch.maximum(chosen_end, rejected_end)
    span = (pos >= first[:, None]) & (pos <= end[:, None])
    terms = -F.logsigmoid(chosen_BS - rejected_BS)
    loss = ((terms * span).sum(1) / span.sum(1).clamp_min(1)).mean()
    rows = torch.arange(B, device=chosen_BS.device)
    return loss, chosen_BS[rows, chosen_end], rejected_BS[rows, rejected_end]
