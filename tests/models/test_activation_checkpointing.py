"""Activation checkpointing (GPT.checkpoint_activations; pretraining's
train.activation_checkpointing, RLHF's model.activation_checkpointing) recomputes each block in
the backward: the loss and every gradient are those of the plain backward, bit for bit."""

import pytest
import torch

from troupe.models import GPT, GPTConfig
from troupe.models.moe import MoEConfig
from troupe.pretrain.config import PretrainConfig


@pytest.mark.parametrize("arch", [
    dict(dropout=0.1),  # troupe's GPT; dropout: the recompute must draw the same masks
    dict(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, out_bias=False),
    dict(moe=MoEConfig(num_experts=4, expert_interval=1, top_k=2, noisy_gate="jitter"),
         dropout=0.1),  # the gate noise too
])
def test_the_same_gradients_bit_for_bit(arch):
    cfg = GPTConfig(seq_len=32, n_layer=3, n_head=4, d_model=64, **arch)
    ids = torch.randint(0, 257, (4, 32), generator=torch.Generator().manual_seed(0))

    def grads(on: bool):
        model = GPT(cfg, seed=0).train()
        model.checkpoint_activations = on
        torch.manual_seed(1)  # dropout and gate noise: the same draws in both runs
        _, loss, aux = model(ids[:, :-1], ids[:, 1:])
        (loss + 0.01 * aux).backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}

    (loss, plain), (loss_ckpt, ckpt) = grads(False), grads(True)
    assert torch.equal(loss, loss_ckpt)
    assert plain.keys() == ckpt.keys() and len(plain) > 10
    for name in plain:
        assert torch.equal(plain[name], ckpt[name]), name


def test_pretraining_turns_it_on_from_the_config():
    from troupe.pretrain.rank import Trainer
    for on in (False, True):
        cfg = PretrainConfig(model={"d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 16},
                             train={"activation_checkpointing": on}, workers=1)
        assert Trainer(cfg, 0, 1, None).model.checkpoint_activations is on
