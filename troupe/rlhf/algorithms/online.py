"""The online algorithms: each samples rollouts, scores them, and updates the policy with a
clipped surrogate. They differ in the roles they need, where the KL goes and how advantages are
made; the arithmetic is troupe.rlhf.algorithms.functions.

- ``ppo``: GAE over per-token rewards (the KL penalty on every token, the sequence reward on the
  last) with a critic's values, whitened over the batch (InstructGPT, DeepSpeed-Chat).
- ``reinforce_pp``: REINFORCE++, the same token rewards' returns, whitened over the batch; no
  critic.
- ``grpo``: each sample's reward normalized within its group (the samples of one prompt); the
  KL as a k3 loss term (Shao et al. 2024).
- ``rloo``: each sample's reward minus the mean of the rest of its group (Ahmadian et al. 2024);
  the KL per token in the reward.
- ``dapo``: GRPO's advantages without a KL, with clip-higher (0.2 / 0.28), dynamic sampling
  (groups whose rewards are all equal are dropped and the batch refilled), token-level loss
  aggregation and overlong reward shaping (Yu et al. 2025).
- ``gspo``: GRPO's advantages with a sequence-level importance ratio, clipped to
  [1 - 3e-4, 1 + 4e-4], the loss averaged over sequences; no KL (Zheng et al. 2025).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from troupe.rlhf.algorithms import functions as F
from troupe.rlhf.algorithms.base import Advantages, Algorithm, Scores, register

if TYPE_CHECKING:
    from troupe.rlhf.config import RLHFConfig


def token_rewards(s: Scores, r: int, cfg: RLHFConfig) -> torch.Tensor:
    """Rank r's per-token rewards: the sequence reward, clipped to ``step3.clip_reward``, on the
    last response token, and minus kl_coef x the KL estimate on every response token when the
    KL goes in the reward."""
    p, a = cfg.step3, s.action[r]
    if cfg.kl_coef() > 0 and not cfg.kl_in_loss():
        return F.kl_rewards(s.logp[r], s.ref[r], s.reward[r], a, cfg.kl_coef(), p.clip_reward,
                            cfg.kl_estimator())
    zero = torch.zeros_like(a)
    return F.kl_rewards(zero, zero, s.reward[r], a, 0.0, p.clip_reward, cfg.kl_estimator())


def sequence_rewards(s: Scores, cfg: RLHFConfig) -> torch.Tensor:
    """(B,) every rank's sequence rewards, minus kl_coef x the sequence's summed KL estimate
    when the KL goes in the reward."""
    seq = torch.cat(s.reward).clone()
    if cfg.kl_coef() > 0 and not cfg.kl_in_loss():
        seq -= cfg.kl_coef() * torch.cat([
            (F.kl_estimate(lp, rf, cfg.kl_estimator()) * a).sum(1)
            for lp, rf, a in zip(s.logp, s.ref, s.action)])
    return seq


def per_token(adv_B: torch.Tensor, s: Scores) -> list[torch.Tensor]:
    """A per-sequence advantage (B,) on each of its response tokens, split by rank."""
    return [F.sequence_advantages(a_B, a) for a_B, a in zip(adv_B.split(s.rows()), s.action)]


@register
class PPO(Algorithm):
    name = "ppo"
    critic = True

    def advantages(self, s: Scores, cfg: RLHFConfig) -> Advantages:
        p, advs, rets = cfg.step3, [], []
        for r in range(len(s.reward)):
            adv, ret = F.gae(token_rewards(s, r, cfg), s.values[r], s.action[r], p.gamma, p.lam)
            advs.append(adv)
            rets.append(ret)
        return Advantages(F.whiten(advs, s.action), rets)


@register
class ReinforcePP(Algorithm):
    name = "reinforce_pp"

    def advantages(self, s: Scores, cfg: RLHFConfig) -> Advantages:
        returns = [F.discounted_returns(token_rewards(s, r, cfg), s.action[r], cfg.step3.gamma)
                   for r in range(len(s.reward))]
        return Advantages(F.whiten(returns, s.action))


class GroupAlgorithm(Algorithm):
    """An algorithm whose advantage is one number per sample, from the rewards of its group
    (the samples of one prompt draw), given to each of the sample's tokens."""

    samples_per_prompt = 4
    min_samples_per_prompt = 2

    def group_advantages(self, reward_B: torch.Tensor, group_B: torch.Tensor,
                         cfg: "RLHFConfig") -> torch.Tensor:
        raise NotImplementedError

    def advantages(self, s: Scores, cfg: "RLHFConfig") -> Advantages:
        adv_B = self.group_advantages(sequence_rewards(s, cfg), torch.cat(s.group), cfg)
        return Advantages(per_token(adv_B, s))


@register
class GRPO(GroupAlgorithm):
    name = "grpo"
    kl_in = "loss"

    def group_advantages(self, reward_B, group_B, cfg):
        return F.grpo_advantages(reward_B, group_B, cfg.step3.group_std)


@register
class RLOO(GroupAlgorithm):
    name = "rloo"

    def group_advantages(self, reward_B, group_B, cfg):
        return F.rloo_advantages(reward_B, group_B)


@register
class DAPO(GRPO):
    name = "dapo"
    kl_coef = 0.0
    clip_high = 0.28
    dynamic_sampling = True
    overlong_share = 0.25  # of max_new_tokens: the overlong buffer when the recipe sets none


@register
class GSPO(GRPO):
    name = "gspo"
    kl_coef = 0.0
    clip, clip_high = 3e-4, 4e-4

    def loss_units(self, mask_BR: torch.Tensor) -> torch.Tensor:
        return (mask_BR.sum(1) > 0).sum()

    def policy_loss(self, logp_BR, old_logp_BR, adv_BR, mask_BR, clip, clip_high):
        return F.sequence_policy_loss(logp_BR, old_logp_BR, adv_BR, mask_BR, clip, clip_high)
