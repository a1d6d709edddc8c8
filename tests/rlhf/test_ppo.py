"""PPO and reward-model arithmetic against values computed by hand."""

import pytest
import torch

from troupe.rlhf.algorithms import (
    ema_update,
    gae,
    kl_rewards,
    pairwise_loss,
    policy_loss,
    value_loss,
)


def test_kl_rewards_add_the_clipped_score_at_the_last_token():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    r = kl_rewards(logp, ref, torch.tensor([2.0, -9.0]), mask, kl_coef=0.1)
    # row 0: -0.1 * [0.5, -1.0, 0.0] + [0, 0, 2.0]; row 1: -0.1 * [1, 0, (masked)] + [0, -5, 0]
    want = torch.tensor([[-0.05, 0.1, 2.0], [-0.1, -5.0, 0.0]])
    torch.testing.assert_close(r, want)


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    d2 = 1.0 - 0.7                       # last step: next value 0
    d1 = 0.0 + 0.7 - 0.6
    d0 = 0.0 + 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.95 * a2
    a0 = d0 + 0.95 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]]))
    torch.testing.assert_close(ret, adv + values)


def test_gae_skips_padding_and_zeroes_it():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 9.0]])
    adv, ret = gae(rewards, values, torch.tensor([[1.0, 1.0, 0.0]]), 1.0, 0.95)
    a1 = 1.0 - 0.4
    a0 = 0.4 - 0.2 + 0.95 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, 0.0]]))
    assert ret[0, 2] == 0


def test_policy_loss_at_ratio_one_is_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
    adv = torch.tensor([[1.0, -2.0], [3.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss = policy_loss(logp, logp.clone(), adv, mask)
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 3.0) / 3)


def test_policy_loss_clips_large_ratios():
    old = torch.zeros(1, 1)
    new = torch.log(torch.tensor([[2.0]]))  # ratio 2: clipped at 1.2 for a positive advantage
    assert policy_loss(new, old, torch.ones(1, 1), torch.ones(1, 1)).item() == pytest.approx(-1.2)
    # a negative advantage takes the unclipped (worse) side: -(-1) * 2
    assert policy_loss(new, old, -torch.ones(1, 1), torch.ones(1, 1)).item() == pytest.approx(2.0)


def test_value_loss_clipping():
    old = torch.tensor([[1.0]])
    ret = torch.tensor([[2.0]])
    # v = 2.0 moved 1.0 from old: clipped to 1.2, whose error (0.8^2) beats the unclipped 0
    assert value_loss(torch.tensor([[2.0]]), old, ret, torch.ones(1, 1)).item() == \
        pytest.approx(0.5 * 0.8 ** 2)
    # v = 1.1 within the clip range: plain squared error
    assert value_loss(torch.tensor([[1.1]]), old, ret, torch.ones(1, 1)).item() == \
        pytest.approx(0.5 * 0.9 ** 2)


def test_ema():
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    torch.nn.init.constant_(a.weight, 1.0)
    torch.nn.init.constant_(b.weight, 3.0)
    ema_update(a, b, beta=0.9)
    torch.testing.assert_close(a.weight, torch.full((1, 2), 0.9 * 1.0 + 0.1 * 3.0))


def test_pairwise_loss_over_the_divergent_span():
    chosen_ids = torch.tensor([[5, 6, 7, 8, 0]])
    rejected_ids = torch.tensor([[5, 6, 9, 0, 0]])
    rc = torch.tensor([[9.0, 9.0, 1.0, 2.0, 9.0]])
    rr = torch.tensor([[9.0, 9.0, 0.0, 0.5, 9.0]])
    loss, sc, sr = pairwise_loss(rc, rr, chosen_ids, rejected_ids, torch.tensor([3]),
                                 torch.tensor([2]))
    # span: positions 2..3 (first difference at 2, later end at 3)
    want = -(torch.nn.functional.logsigmoid(torch.tensor(1.0))
             + torch.nn.functional.logsigmoid(torch.tensor(1.5))) / 2
    assert loss.item() == pytest.approx(want.item())
    assert sc.item() == 2.0 and sr.item() == 0.0
