"""model.packing: the roles' training forwards on packed micro-batches give the padded ones'
losses and gradients (1e-6, fp32), for the policy's token log-probabilities (SFT and step 3)
and the value head (reward training, critic)."""

import pytest
import torch

from troupe.models import GPT, GPTConfig
from troupe.rlhf.lm import GPTLM, ValueModel


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
    assert out[False][2] == [real, 8 * 24, 8 * 24]
    # first-fit decreasing: 24 | 20 4 | 15 9 | 12 12 | 8: five rows instead of eight
    assert out[True][2] == [real, 8 * 24, 5 * 24]


def test_nothing_is_counted_without_gradients():
    ids, valid, where = batch([5, 9], 10, CFG.vocab_size)
    lm = GPTLM(GPT(CFG, seed=0), packing=True)
    with torch.no_grad():
        lm.token_logprobs(ids, valid, where)
    assert lm.padding == [0, 0, 0]
