"""The algorithm objects: what each resolves from a recipe, DAPO's and GSPO's arithmetic by hand,
dynamic sampling dropping and refilling groups, and recipes refused at validation."""

import math
import random

import pytest
import torch

from troupe.config import ConfigError, validate
from troupe.rlhf import algorithms
from troupe.rlhf.algorithms import (
    Scores,
    overlong_penalty,
    sequence_policy_loss,
    spread_groups,
)
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.datasets import Data
from troupe.rlhf.data.experience import Rollout
from troupe.rlhf.pipeline.rewards import Rewards
from troupe.rlhf.pipeline.scoring import sample

FN = dict(reward=dict(function="apps.rewards:sort_digits"))


def test_each_algorithm_states_its_roles_scores_and_kl():
    def resolved(name, **over):
        cfg = RLHFConfig(algorithm=name, **over)
        return (cfg.samples_per_prompt(), cfg.kl_coef(), cfg.kl_in_loss(), cfg.clip(),
                cfg.uses_critic(), cfg.uses_reference(), sorted(cfg.algo().scores(cfg)))

    assert resolved("ppo") == (1, 0.05, False, (0.2, 0.2), True, True, ["logp", "ref", "values"])
    assert resolved("grpo") == (4, 0.05, True, (0.2, 0.2), False, True, ["ref"])
    assert resolved("rloo") == (4, 0.05, False, (0.2, 0.2), False, True, ["logp", "ref"])
    assert resolved("reinforce_pp") == (1, 0.05, False, (0.2, 0.2), False, True, ["logp", "ref"])
    assert resolved("dapo") == (4, 0.0, True, (0.2, 0.28), False, False, [])
    assert resolved("gspo") == (4, 0.0, True, (3e-4, 4e-4), False, False, [])
    assert resolved("gspo", step3=dict(ppo_epochs=2)) == (4, 0.0, True, (3e-4, 4e-4), False, False,
                                                        ["logp"])
    assert resolved("dpo", step3=dict(kl_coef=0.0))[5] is True  # its reference is its baseline
    # a recipe's own values win over the algorithm's
    assert RLHFConfig(algorithm="dapo", step3=dict(kl_coef=0.1)).uses_reference()
    assert RLHFConfig(algorithm="dapo", step3=dict(policy_clip=0.1)).clip() == (0.1, 0.1)
    assert RLHFConfig(algorithm="dapo").dynamic_sampling()
    assert RLHFConfig(algorithm="dapo", step3=dict(max_new_tokens=8)).overlong_buffer() == 2
    assert RLHFConfig(algorithm="grpo").overlong_buffer() == 0


@pytest.mark.parametrize("over, match", [
    (dict(algorithm="sarsa"), "algorithm: 'sarsa': expected one of ppo, .*dapo, gspo, dpo"),
    (dict(algorithm="no_such_module:X"), "cannot import it"),
    (dict(algorithm="math:pi"), "is a float, not an Algorithm"),
    (dict(algorithm="grpo", step3=dict(samples_per_prompt=1)), "needs at least 2"),
    (dict(algorithm="gspo", reward_in_critic=True), "gspo has no critic"),
    (dict(algorithm="dpo", **FN), "uses no reward"),
    (dict(algorithm="dapo", reward=dict(model_coef=0)), "would have no reward"),
])
def test_recipes_that_make_no_sense_are_refused_in_one_line(over, match):
    with pytest.raises(ConfigError, match=match) as e:
        validate(RLHFConfig, over, "recipe")
    assert "\n" not in str(e.value)


def test_dapo_keeps_groups_whose_rewards_differ():
    reward = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([5, 5, 7, 7, 9, 9, 3, 3, 3, 3])
    assert spread_groups(reward, groups).tolist() == [True, True, False, False, False, False,
                                                      True, True, True, True]
    dapo, grpo = algorithms.get("dapo"), algorithms.get("grpo")
    assert dapo.keep(reward, groups).tolist() == spread_groups(reward, groups).tolist()
    assert grpo.keep(reward, groups).all()


def test_overlong_penalty_by_hand():
    # max 8 tokens, buffer 2: nothing up to 6 tokens, -0.5 at 7, the whole penalty at 8
    got = overlong_penalty(torch.tensor([3, 6, 7, 8]), max_len=8, buffer=2, factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5]))
    assert overlong_penalty(torch.tensor([8]), 8, 0).item() == 0.0


def test_dapo_advantages_with_overlong_shaping_by_hand():
    """Two groups of 2; the sequence rewards get the overlong penalty, then GRPO's
    normalization (unbiased std of 2 samples: |a - b| / sqrt(2))."""
    cfg = RLHFConfig(algorithm="dapo", step3=dict(max_new_tokens=4, overlong_buffer=2))
    action = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1.0]])
    reward = torch.tensor([1.0, 1.0, 0.0, 1.0])
    shaped = reward + overlong_penalty(action.sum(1), 4, cfg.overlong_buffer())
    torch.testing.assert_close(shaped, torch.tensor([1.0, 0.0, -0.5, 0.0]))
    s = Scores([shaped[:2], shaped[2:]], [torch.tensor([0, 0]), torch.tensor([1, 1])],
               [action[:2], action[2:]])
    made = algorithms.get("dapo").advantages(s, cfg)
    a = 1 / math.sqrt(0.5) / (1 + 1e-6 * math.sqrt(2))  # (x - mean) / (std + eps) for |x - y| = 1, 0.5
    b = 0.25 / (0.5 / math.sqrt(2) + 1e-6)
    want = torch.tensor([a * 0.5, -a * 0.5, -b, b])[:, None] * action
    torch.testing.assert_close(torch.cat(made.advantages), want, rtol=1e-5, atol=1e-6)
    assert made.returns is None


def test_gspo_sequence_ratio_loss_by_hand():
    logp = torch.tensor([[0.1, 0.3, 0.0], [0.0, 0.0, -0.1]], requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, -2.0]])
    loss, clipped = sequence_policy_loss(logp, old, adv, mask, clip=0.1, clip_high=0.1)
    s1, s2 = math.exp(0.2), math.exp(-0.1)  # exp(mean log-ratio): 0.2 and -0.1
    # sequence 1: A = 1, s1 = 1.221 clipped to 1.1 -> -1.1; sequence 2: A = -2, s2 = 0.905 inside
    assert loss.item() == pytest.approx((-1.1 + 2 * s2) / 2, rel=1e-6)
    assert clipped.item() == pytest.approx(2 / 3)  # sequence 1's two tokens of three
    loss.backward()
    # d/dlogp of sequence 2's term (2 s2 / 2, over its one token): s2; sequence 1 is clipped
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, s2]]))
    gspo = algorithms.get("gspo")
    assert gspo.loss_units(mask).item() == 2  # averaged over sequences, not tokens
    assert s1 > 1.1


class _Policy:
    """Answers "sort D:" with a fixed table of responses by seed parity: enough to see which
    groups dynamic sampling keeps."""

    def __init__(self, answers):
        self.answers, self.asked = answers, []

    def invoke(self, method, request):
        self.asked.append(list(request.groups))
        B = len(request.prompts)
        responses = [self.answers(p, k) for k, p in enumerate(request.prompts)]
        half = B // 2
        return [Rollout(torch.zeros(n, 4, dtype=torch.long), torch.ones(n, 4, dtype=torch.bool),
                        torch.tensor([[0.0, 1.0, 1.0]] * n), request.prompts[lo:lo + n],
                        responses[lo:lo + n], prompt_len=2, groups=request.groups[lo:lo + n])
                for lo, n in ((0, half), (half, B - half))]


class _Graph(dict):
    pass


def _exact(prompts, responses, fields=None):
    return Rewards([float(r == "right") for r in responses], [])


def test_dynamic_sampling_drops_equal_groups_and_refills():
    """Prompts "a" always get right answers, "b" always wrong, "c" mixed: only "c" groups
    have rewards that differ; rounds go on until 2 such groups are kept."""
    cfg = RLHFConfig(algorithm="dapo", workers=2, reward=dict(function="m:f"),
                     step3=dict(prompts_per_iter=2, samples_per_prompt=2, sample_rounds=4))
    data = Data(sft=[], pairs=[], eval_pairs=[], prompts=["a", "c", "b", "c", "a", "c"],
                eval_prompts=[], gold=None)

    def answer(prompt, k):
        return {"a": "right", "b": "wrong"}.get(prompt, "right" if k % 2 else "wrong")

    policy = _Policy(answer)
    batch = sample(_Graph(policy=policy), cfg, data, random.Random(1), _exact)  # "c", "a" first
    kept = [g for ro in batch.rollouts for g in ro.groups]
    prompts = [q for ro in batch.rollouts for q in ro.prompts]
    assert prompts == ["c", "c", "c", "c"] and len(set(kept)) == 2
    assert batch.reward.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert batch.stats["groups_kept"] >= 2 and batch.stats["groups_filled"] == 0
    assert batch.stats["sample_rounds"] == len(policy.asked) > 1  # refilled
    assert len(set(g for ask in policy.asked for g in ask)) == 2 * len(policy.asked)  # fresh ids
    # no prompt ever gives a spread: the batch is filled with dropped groups
    policy = _Policy(lambda p, k: "right")
    batch = sample(_Graph(policy=policy), cfg, data, random.Random(0), _exact)
    assert batch.stats["groups_kept"] == 0 and batch.stats["groups_filled"] == 2
    assert batch.stats["sample_rounds"] == 4 and sum(len(r.responses) for r in batch.rollouts) == 4
