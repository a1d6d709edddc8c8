"""The arithmetic of the RL algorithms, as pure tensor functions: PPO with GAE (DeepSpeed-Chat),
the critic-free estimators (GRPO's group-normalized, RLOO's leave-one-out, REINFORCE++'s
globally normalized returns), the KL estimators, the clipped surrogate (token-level, with
clip-higher; GSPO's sequence-level), DAPO's overlong reward shaping, the value loss, DPO/IPO
and the pairwise reward-model loss. The algorithm objects (troupe.rlhf.algorithms) compose
them.

Shapes: B sequences, R response positions. ``mask_BR`` marks real response tokens (the prompt is
not part of R; padding after the end of a response is 0). Group estimators take a group id per
sequence, ``group_B`` (the samples of one prompt share one), so rows may come in any order."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def kl_rewards(logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor, score_B: torch.Tensor,
               mask_BR: torch.Tensor, kl_coef: float, clip_reward: float = 5.0,
               estimator: str = "k1") -> torch.Tensor:
    """Per-token reward: -kl_coef * KL estimate (k1: logp - ref_logp) on every response token,
    plus the sequence score clipped to [-clip_reward, clip_reward] on the last one."""
    rewards = -kl_coef * kl_estimate(logp_BR, ref_logp_BR, estimator) * mask_BR
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


def group_ids(B: int, n: int) -> torch.Tensor:
    """Ids for B rows that come as groups of n consecutive samples: 0, .., 0, 1, .., 1, ..."""
    if n < 1 or B % n:
        raise ValueError(f"{B} rows do not split into groups of n={n}")
    return torch.arange(B) // n  # host: ids, as the driver keeps them


def _by_group(score_B: torch.Tensor, group_B: torch.Tensor, per_group) -> torch.Tensor:
    """``per_group(g_GN) -> (G, N)`` applied to the scores arranged one group per row, the
    result put back in the rows' order. Groups of unequal sizes go one at a time (G = 1)."""
    _, inverse, counts = torch.unique(group_B.to(score_B.device), return_inverse=True,
                                      return_counts=True)
    if (counts < 2).any():
        raise ValueError(f"group estimators need at least 2 samples per group; group sizes: "
                         f"{sorted(set(counts.tolist()))}")
    out = torch.empty_like(score_B)
    if (counts == counts[0]).all():
        order = torch.argsort(inverse, stable=True)
        out[order] = per_group(score_B[order].reshape(len(counts), -1)).reshape(-1)
        return out
    for g in range(len(counts)):
        rows = (inverse == g).nonzero().squeeze(1)
        out[rows] = per_group(score_B[rows][None])[0]
    return out


def grpo_advantages(score_B: torch.Tensor, group_B: torch.Tensor, std_normalize: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024): each sample's score minus its group's mean, over the group's
    standard deviation (unbiased, as the paper's; ``std_normalize=False`` is Dr. GRPO's
    unscaled form). (B,): one advantage per sequence, given to every one of its tokens."""
    def normalize(g):
        adv = g - g.mean(1, keepdim=True)
        return adv / (g.std(1, keepdim=True) + eps) if std_normalize else adv
    return _by_group(score_B, group_B, normalize)


def rloo_advantages(score_B: torch.Tensor, group_B: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each sample's score minus the mean of the other samples of
    its group, which equals n / (n - 1) x (score - group mean) for a group of n. (B,)."""
    def leave_one_out(g):
        return g - (g.sum(1, keepdim=True) - g) / (g.shape[1] - 1)
    return _by_group(score_B, group_B, leave_one_out)


def spread_groups(score_B: torch.Tensor, group_B: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the rows whose group's scores are not all equal (DAPO's dynamic sampling
    keeps these: a group of equal rewards has zero advantage everywhere, no gradient)."""
    _, inverse = torch.unique(group_B.to(score_B.device), return_inverse=True)
    G, dev = (int(inverse.max()) + 1 if len(inverse) else 0), score_B.device
    lo = torch.full((G,), float("inf"), device=dev).scatter_reduce(0, inverse, score_B.float(),
                                                                   "amin")
    hi = torch.full((G,), float("-inf"), device=dev).scatter_reduce(0, inverse, score_B.float(),
                                                                    "amax")
    return (hi > lo)[inverse]


def overlong_penalty(length_B: torch.Tensor, max_len: int, buffer: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), (B,) <= 0: nothing for a response of
    at most max_len - buffer tokens, then falling linearly to -factor at max_len tokens (a
    response cut at the limit: it never ended), -factor beyond."""
    if buffer <= 0:
        return torch.zeros_like(length_B, dtype=torch.float)
    over = (length_B.float() - (max_len - buffer)).clamp(min=0) / buffer
    return -factor * over.clamp(max=1.0)


def sequence_advantages(adv_B: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    """A per-sequence advantage on each of its response tokens: (B, R)."""
    return adv_B[:, None] * mask_BR


def discounted_returns(rewards_BR: torch.Tensor, mask_BR: torch.Tensor,
                       gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE's return at each response token: the sum of its own and the later tokens'
    rewards, discounted by ``gamma`` per token; zero off the mask."""
    out = torch.zeros_like(rewards_BR)
    running = torch.zeros(rewards_BR.shape[0], dtype=rewards_BR.dtype, device=rewards_BR.device)
    m = mask_BR.bool()
    for t in reversed(range(rewards_BR.shape[1])):
        running = torch.where(m[:, t], rewards_BR[:, t] + gamma * running, running)
        out[:, t] = running * m[:, t]
    return out


def kl_estimate(logp_BR: torch.Tensor, ref_logp_BR: torch.Tensor,
                estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probabilities of tokens sampled
    from the policy (Schulman's estimators): k1 = log r, k2 = (log r)^2 / 2,
    k3 = exp(-log r) - 1 + log r (non-negative, unbiased; GRPO's), with log r = logp - ref."""
    log_ratio = logp_BR - ref_logp_BR
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl estimator {estimator!r}: expected k1, k2 or k3")


def policy_loss(logp_BR: torch.Tensor, old_logp_BR: torch.Tensor, adv_BR: torch.Tensor,
                mask_BR: torch.Tensor, clip: float = 0.2, clip_high: float | None = None
                ) -> torch.Tensor:
    """The clipped surrogate: mean over tokens of max(-A * ratio, -A * clip(ratio)), the
    ratio clipped to [1 - clip, 1 + clip_high] (DAPO's clip-higher when clip_high > clip;
    None: symmetric)."""
    ratio = torch.exp(logp_BR - old_logp_BR)
    hi = clip if clip_high is None else clip_high
    loss = torch.max(-adv_BR * ratio, -adv_BR * ratio.clamp(1 - clip, 1 + hi))
    return masked_mean(loss, mask_BR)


def sequence_policy_loss(logp_BR: torch.Tensor, old_logp_BR: torch.Tensor,
                         adv_BR: torch.Tensor, mask_BR: torch.Tensor, clip: float,
                         clip_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): the clipped surrogate on the sequence-level importance ratio
    s = exp(mean over the response's tokens of logp - old_logp), with the sequence's advantage
    (the mean of its tokens' advantages), averaged over the sequences that have a response.
    Returns (loss, share of the response tokens whose sequence is clipped)."""
    n_B = mask_BR.sum(1)
    has = n_B > 0
    log_s = ((logp_BR - old_logp_BR) * mask_BR).sum(1) / n_B.clamp_min(1)
    s = torch.exp(log_s)
    adv_B = (adv_BR * mask_BR).sum(1) / n_B.clamp_min(1)
    hi = clip if clip_high is None else clip_high
    loss_B = torch.max(-adv_B * s, -adv_B * s.clamp(1 - clip, 1 + hi))
    loss = (loss_B * has).sum() / has.sum().clamp_min(1)
    clipped = ((s.detach() > 1 + hi) & (adv_B > 0)) | ((s.detach() < 1 - clip) & (adv_B < 0))
    return loss, masked_mean(clipped[:, None].float().expand_as(mask_BR), mask_BR)


def clip_fraction(logp_BR: torch.Tensor, old_logp_BR: torch.Tensor, adv_BR: torch.Tensor,
                  mask_BR: torch.Tensor, clip: float = 0.2,
                  clip_high: float | None = None) -> torch.Tensor:
    """Share of response tokens whose surrogate is clipped (the gradient is zero there)."""
    ratio = torch.exp(logp_BR - old_logp_BR)
    hi = clip if clip_high is None else clip_high
    clipped = ((ratio > 1 + hi) & (adv_BR > 0)) | ((ratio < 1 - clip) & (adv_BR < 0))
    return masked_mean(clipped.float(), mask_BR)


def dpo_loss(logp_chosen_B: torch.Tensor, logp_rejected_B: torch.Tensor,
             ref_chosen_B: torch.Tensor, ref_rejected_B: torch.Tensor, beta: float = 0.1,
             kind: str = "sigmoid", label_smoothing: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO (Rafailov et al. 2023) on summed response log-probabilities: with
    h = (logp_c - ref_c) - (logp_r - ref_r), "sigmoid" is -log sigmoid(beta h) (with
    label_smoothing e: the conservative form, (1 - e) of it plus e of -log sigmoid(-beta h));
    "ipo" (Azar et al. 2023) is (h - 1 / (2 beta))^2. Returns (mean loss, per-pair implicit
    reward margin beta h)."""
    h = (logp_chosen_B - ref_chosen_B) - (logp_rejected_B - ref_rejected_B)
    if kind == "sigmoid":
        loss = (-(1 - label_smoothing) * F.logsigmoid(beta * h)
                - label_smoothing * F.logsigmoid(-beta * h))
    elif kind == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo loss {kind!r}: expected sigmoid or ipo")
    return loss.mean(), (beta * h).detach()


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
