"""A GRPO rollout whose groups the engine admits a pair at a time (generation_batch 2): with
step3.prefix_cache_mb each 256-token prompt runs once (its last block aside) and every sample
gets the tokens it gets without the cache; the record counts what ran."""

import torch

from troupe.data import ByteTokens
from troupe.models import GPT
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.experience import RolloutRequest
from troupe.rlhf.models.lm import GPTLM
from troupe.rlhf.rollout.engine import RolloutEngine


def test_each_prompt_of_a_group_runs_once():
    texts = ["".join(chr(97 + (i * 7 + j) % 26) for j in range(256)) for i in range(2)]
    request = RolloutRequest([t for t in texts for _ in range(4)], list(range(8)),
                             groups=[0] * 4 + [1] * 4)
    out = {}
    for mb in (0, 64):
        cfg = RLHFConfig(model=dict(gpt=dict(seq_len=320, n_layer=2, n_head=2, d_model=32)),
                         step3=dict(generation_batch=2, max_new_tokens=5, prefix_cache_mb=mb))
        lm = GPTLM(GPT(cfg.model.gpt, seed=0))
        out[mb] = RolloutEngine(cfg, ByteTokens()).generate(lm, request)
    assert out[0].responses == out[64].responses
    assert torch.equal(out[0].engine_logp, out[64].engine_logp)
    assert out[0].prompt_tokens == (8 * 256, 4 * 256)  # pairs share a prompt anyway
    # with the cache: each prompt once, its second pair only the last (partial) block
    assert out[64].prompt_tokens == (8 * 256, 2 * 256 + 2 * 16)
