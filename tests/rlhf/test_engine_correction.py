"""The rollout engine's log-probabilities beside the trainer's: each sampled token's is the
trainer's own (fp32: the same model), truncated importance sampling weighs the advantages by
min(p_trainer / p_engine, cap), and the mismatch is counted whether it is on or not."""

import math

import pytest
import torch

from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.datasets import SortTask
from troupe.rlhf.data.experience import RolloutRequest
from troupe.rlhf.roles.policy import Policy, _engine_correction, action_logprobs


def test_the_engine_reports_the_trainers_logprobs_of_what_it_sampled():
    cfg = RLHFConfig(model=dict(gpt=dict(seq_len=48, n_layer=2, n_head=2, d_model=32)),
                     step3=dict(max_new_tokens=8, temperature=0.8, top_p=0.9))
    policy = Policy(cfg, None, 0)
    prompts = SortTask().prompts(6, 3)
    rollout = policy.generate(RolloutRequest(prompts, [11 * i for i in range(len(prompts))]))
    trainer = action_logprobs(policy.lm, rollout.ids, rollout.valid, rollout.action, None)
    on = rollout.action.bool()
    assert rollout.engine_logp.shape == rollout.action.shape
    assert (rollout.engine_logp[~on] == 0).all() and (rollout.engine_logp[on] < 0).all()
    # the model's own distribution (not the tempered, top-p one it sampled from)
    torch.testing.assert_close(rollout.engine_logp, trainer, rtol=0, atol=1e-4)
    part = rollout.rows([4, 1])  # rows keep their log-probabilities
    assert torch.equal(part.engine_logp, rollout.engine_logp[[4, 1]])


def test_truncated_importance_weights_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    trainer = torch.tensor([[-1.0, -0.5, -2.0, -3.0]])
    engine = torch.tensor([[-1.0, -2.0, -1.0, 0.0]])  # ratios 1, e^1.5 (> 2: truncated), e^-1
    adv = torch.tensor([[2.0, 2.0, 2.0, 2.0]])
    counts = [0.0, 0.0, 0.0]
    out = _engine_correction(trainer, engine, mask, adv, 2.0, counts)
    assert out[0].tolist() == pytest.approx([2.0, 4.0, 2 * math.exp(-1), 2.0])
    assert counts == pytest.approx([2.5, 1.5, 1.0])
    counts = [0.0, 0.0, 0.0]  # off: the advantages untouched, the mismatch still counted
    assert torch.equal(_engine_correction(trainer, engine, mask, adv, None, counts), adv)
    assert counts == pytest.approx([2.5, 1.5, 0.0])


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="tis_cap"):
        RLHFConfig(step3=dict(tis_cap=0.5))


def test_top_k_narrows_what_rollouts_sample():
    """step3.top_k reaches the rollout engine: with top_k 1 a rollout at temperature 1 draws
    the greedy tokens, whatever the seeds; without it the seeds draw others."""
    responses = {}
    for top_k, temperature in ((1, 1.0), (0, 1.0), (0, 0.0)):
        cfg = RLHFConfig(model=dict(gpt=dict(seq_len=48, n_layer=2, n_head=2, d_model=32)),
                         step3=dict(max_new_tokens=8, temperature=temperature, top_k=top_k))
        policy = Policy(cfg, None, 0)
        prompts = SortTask().prompts(6, 3)
        responses[top_k, temperature] = policy.generate(
            RolloutRequest(prompts, [11 * i for i in range(len(prompts))])).responses
    assert responses[1, 1.0] == responses[0, 0.0] != responses[0, 1.0]
