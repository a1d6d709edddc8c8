"""The critic-free estimators, KL estimators, clip-higher and DPO/IPO against values computed by
hand."""

import math

import pytest
import torch

from troupe.rlhf.algorithms import (
    clip_fraction,
    discounted_returns,
    dpo_loss,
    group_ids,
    grpo_advantages,
    kl_estimate,
    kl_rewards,
    policy_loss,
    rloo_advantages,
    sequence_advantages,
    whiten,
)


def test_grpo_normalizes_within_each_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    adv = grpo_advantages(scores, group_ids(8, 4))
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: mean 2.75, std 1.5
    s1 = math.sqrt(1 / 3)
    want = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, -0.5, -0.5, -0.5, 1.5]
    torch.testing.assert_close(adv, torch.tensor(want), rtol=1e-5, atol=1e-5)
    # Dr. GRPO: no division
    torch.testing.assert_close(grpo_advantages(scores, group_ids(8, 4), std_normalize=False),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]))


def test_grpo_group_with_equal_scores_gets_no_advantage():
    adv = grpo_advantages(torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0, 0.0]), group_ids(6, 3))
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[3] > 0 > adv[4]


def test_rloo_subtracts_the_mean_of_the_others():
    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])
    adv = rloo_advantages(scores, group_ids(6, 3))
    want = [1 - 4, 2 - 3.5, 6 - 1.5, 0 - 1.5, 0 - 1.5, 3 - 0]
    torch.testing.assert_close(adv, torch.tensor(want))
    # = n / (n - 1) * (score - group mean)
    g = scores.reshape(2, 3)
    torch.testing.assert_close(adv, (1.5 * (g - g.mean(1, keepdim=True))).reshape(-1))


def test_groups_are_ids_not_row_positions():
    """Shuffled rows, and groups of unequal sizes, give each row its own group's advantage."""
    scores = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    order = torch.tensor([4, 0, 5, 2, 1, 3])
    for fn in (grpo_advantages, rloo_advantages):
        torch.testing.assert_close(fn(scores[order], groups[order]), fn(scores, groups)[order])
    ragged = grpo_advantages(torch.tensor([1.0, 3.0, 0.0, 0.0, 3.0]),
                             torch.tensor([7, 7, 2, 2, 2]), std_normalize=False)
    torch.testing.assert_close(ragged, torch.tensor([-1.0, 1.0, -1.0, -1.0, 2.0]))
    # leave-one-out over groups of 2 and 3: 1 - 3, 3 - 1; 0 - 1.5, 0 - 1.5, 3 - 0
    torch.testing.assert_close(rloo_advantages(torch.tensor([1.0, 3.0, 0.0, 0.0, 3.0]),
                                               torch.tensor([7, 7, 2, 2, 2])),
                               torch.tensor([-2.0, 2.0, -1.5, -1.5, 3.0]))


def test_group_estimators_refuse_single_sample_groups():
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        grpo_advantages(torch.zeros(5), torch.tensor([0, 0, 1, 1, 2]))
    with pytest.raises(ValueError, match="do not split"):
        group_ids(5, 2)


def test_sequence_advantages_fill_the_response_tokens():
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(sequence_advantages(torch.tensor([2.0, -1.0]), mask),
                               torch.tensor([[0.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]))


def test_reinforce_pp_returns_by_hand():
    # REINFORCE++: token rewards are -kl_coef * k1 plus the clipped score at the last token;
    # returns sum the rewards from each token on; advantages are returns whitened over the batch
    logp = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = kl_rewards(logp, ref, torch.tensor([1.0, 0.0]), mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 1.0], [-0.1, 0.0, 0.0]]))
    ret = discounted_returns(rewards, mask)
    torch.testing.assert_close(ret, torch.tensor([[1.05, 1.1, 1.0], [-0.1, 0.0, 0.0]]))
    ret_g = discounted_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret_g, torch.tensor([[-0.05 + 0.5 * 0.6, 0.1 + 0.5, 1.0],
                                                    [-0.1, 0.0, 0.0]]))
    [a, b] = whiten([ret[:1], ret[1:]], [mask[:1], mask[1:]])
    every = torch.tensor([1.05, 1.1, 1.0, -0.1, 0.0])
    mean, std = every.mean(), every.std()
    torch.testing.assert_close(torch.cat([a, b]), (ret - mean) / std * mask)


def test_returns_carry_over_padding_inside_the_mask():
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask),
                               torch.tensor([[3.0, 3.0, 0.0, 2.0]]))


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    lr = torch.tensor([0.5, -1.0])
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), lr)
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), 0.5 * lr ** 2)
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"),
                               torch.tensor([math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]))
    assert (kl_estimate(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_k3_is_an_unbiased_estimate_of_the_kl():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    exact = (p * (p / q).log()).sum()
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    for est in ("k1", "k3"):
        got = kl_estimate(p.log()[x], q.log()[x], est).mean()
        assert abs(got - exact) < 0.01, est


def test_clip_higher_lets_a_positive_advantage_ratio_rise_further():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.25, 0.7]]))
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    # symmetric 0.2: token 0 clipped at 1.2 (loss -1.2), token 1 at 0.8 (loss 0.8)
    torch.testing.assert_close(policy_loss(logp, old, adv, mask, 0.2), torch.tensor(-0.2))
    # clip-higher 0.28: token 0 unclipped (-1.25); the lower bound stays 0.8
    torch.testing.assert_close(policy_loss(logp, old, adv, mask, 0.2, clip_high=0.28),
                               torch.tensor((-1.25 + 0.8) / 2))
    torch.testing.assert_close(clip_fraction(logp, old, adv, mask, 0.2), torch.tensor(1.0))
    torch.testing.assert_close(clip_fraction(logp, old, adv, mask, 0.2, 0.28), torch.tensor(0.5))


def test_dpo_and_ipo_losses_by_hand():
    pc, pr = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.0])
    rc, rr = torch.tensor([-3.5, -5.0]), torch.tensor([-3.5, -5.0])
    h = torch.tensor([(-3.0 + 3.5) - (-4.0 + 3.5), (-5.0 + 5.0) - (-4.0 + 5.0)])  # [1, -1]
    loss, margin = dpo_loss(pc, pr, rc, rr, beta=0.5)
    want = -torch.nn.functional.logsigmoid(0.5 * h).mean()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(margin, 0.5 * h)
    smooth, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    torch.testing.assert_close(smooth, (0.9 * -torch.nn.functional.logsigmoid(0.5 * h)
                                        + 0.1 * -torch.nn.functional.logsigmoid(-0.5 * h)).mean())
    ipo, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, kind="ipo")
    torch.testing.assert_close(ipo, ((h - 1.0) ** 2).mean())  # 1 / (2 beta) = 1
    # at the reference, DPO's loss is log 2 and its gradient favours the chosen response
    at = torch.zeros(1, requires_grad=True)
    loss, _ = dpo_loss(at, torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=0.1)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(math.log(2)))
    assert at.grad.item() < 0
