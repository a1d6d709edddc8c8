"""model.packing: the roles' training forwards on packed micro-batches give the padded ones'
losses and gradients (1e-6, fp32), for the policy's token log-probabilities (SFT and step 3)
and the value head (reward training, critic)."""

import json

import pytest
import torch

from troupe.models import GPT, GPTConfig
from troupe.rlhf.models.lm import GPTLM, ValueModel


def batch(lengths: list[int], S: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (len(lengths), S), generator=g)
    valid = torch.zeros(len(lengths), S, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, S - n:] = True
    where = valid[:, 1:] & valid[:, :-1]  # every real next-token target
    where[:, :S // 2] = False             # ... of the "response" half
    return ids, valid, where.float()


CFG = GPTConfig(vocab_size=61, seq_len=24, n_layer=2, n_head=4, d_model=32, positions="rope",
                norm="rmsnorm", mlp="swiglu", n_kv_head=2, out_bias=False, mlp_bias=False)


def grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("head", ["policy", "value"])
def test_packed_forwards_give_the_padded_loss_and_gradients(head):
    ids, valid, where = batch([24, 20, 4, 12, 12, 9, 15, 8], 24, CFG.vocab_size)
    out = {}
    for packing in (False, True):
        lm = GPTLM(GPT(CFG, seed=0), packing=packing).train()
        if head == "policy":
            model = lm
            loss = -(lm.token_logprobs(ids, valid, where) * where).sum() / where.sum()
        else:
            model = ValueModel(lm)
            torch.nn.init.normal_(model.head.weight, std=0.1,
                                  generator=torch.Generator().manual_seed(1))
            values = model(ids, valid)
            loss = ((values[:, 1:] - 1.0) ** 2 * where).sum() / where.sum()
        loss.backward()
        out[packing] = loss.detach(), grads(model), lm.padding
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-6)
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-6, atol=1e-6, msg=name)
    real = int(valid.sum())
    assert out[False][2] == [real, 8 * 24, 8 * 24, real]
    # first-fit decreasing: 24 | 20 4 | 15 9 | 12 12 | 8: five rows instead of eight
    assert out[True][2] == [real, 8 * 24, 5 * 24, real]


def test_nothing_is_counted_without_gradients():
    ids, valid, where = batch([5, 9], 10, CFG.vocab_size)
    lm = GPTLM(GPT(CFG, seed=0), packing=True)
    with torch.no_grad():
        lm.token_logprobs(ids, valid, where)
    assert lm.padding == [0, 0, 0, 0]


def test_token_budget_micro_batches():
    from troupe.data import token_micro_batches
    assert token_micro_batches([5, 4, 3, 9, 1, 1], 9) == [slice(0, 2), slice(2, 3), slice(3, 4),
                                                          slice(4, 6)]
    assert token_micro_batches([12, 2], 9) == [slice(0, 1), slice(1, 2)]  # too long: alone
    assert token_micro_batches([], 9) == []


def test_bad_packing_settings_are_named():
    from troupe.rlhf.config import RLHFConfig
    with pytest.raises(ValueError, match="model.packing=true"):
        RLHFConfig(model=dict(packing_tokens=64))
    with pytest.raises(ValueError, match="zero_stage=3 with model.packing_tokens"):
        RLHFConfig(model=dict(packing=True, packing_tokens=64), zero_stage=3)


def test_a_packed_run_learns_what_the_padded_run_learns(cluster, tmp_path):
    """All three steps (PPO: policy and critic) on the bundled task, padded and then packed
    with a token budget (other micro-batches, the same update): SFT's losses the same through
    its Adam steps, and step 3's update computed on less padding. (The reward model and the
    critic start from a zero head, where Adam's normalised steps turn float-order noise in
    near-zero gradients into visible differences: their packed gradients are compared
    directly above.)"""
    from troupe.rlhf import driver as rlhf
    from troupe.rlhf.config import RLHFConfig

    def run(name, **model):
        cfg = RLHFConfig(model=dict(gpt=dict(seq_len=32, n_layer=2, n_head=2, d_model=32),
                                    **model),
                         task=dict(sft_examples=200, preference_examples=200, eval_examples=8),
                         sft=dict(steps=3, batch_size=8, micro_batch_size=4),
                         reward=dict(steps=2, batch_size=8, micro_batch_size=4),
                         step3=dict(iterations=2, prompts_per_iter=8, max_new_tokens=6,
                                    eval_every=2, checkpoint_every=0, micro_batch_size=4),
                         workers=1, out_dir=str(tmp_path / name))
        rlhf.run(cfg)
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]

    padded, packed = run("padded"), run("packed", packing=True, packing_tokens=40)
    assert [(r["kind"], r["step"]) for r in packed] == [(r["kind"], r["step"]) for r in padded]
    sft = [(a["loss"], b["loss"]) for a, b in zip(padded, packed) if a["kind"] == "sft"]
    assert [b for _, b in sft] == pytest.approx([a for a, _ in sft], rel=1e-6)
    for a, b in zip(padded, packed):
        if a["kind"] == "step3":
            assert b["padding"] == a["padding"] > 0
            # (the padded run's own figure is of its shared prompt opening, "sort ": another
            # layout, troupe.models.PrefixTree)
            assert b["padding_computed"] < a["padding"]
            assert b["computed_share"] < 1 and a["computed_share"] < 1  # both skip some
