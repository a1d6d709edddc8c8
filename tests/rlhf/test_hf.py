"""A Hugging Face causal LM from a local directory in every role: a tiny GPT-2 and a word-level
tokenizer that the test builds and saves itself (no hub access)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from troupe.rlhf.config import RLHFConfig  # noqa: E402
from troupe.rlhf.data import SortTask  # noqa: E402
from troupe.rlhf.experience import RolloutRequest  # noqa: E402
from troupe.rlhf.roles import Critic, Policy, Reward  # noqa: E402


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    chars = list("0123456789sort: ")
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                                pad_token="<eos>")
    fast.save_pretrained(path)
    cfg = transformers.GPT2Config(vocab_size=len(vocab), n_positions=32, n_embd=32, n_layer=2,
                                  n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def test_hf_model_trains_generates_and_scores(tiny_hf):
    cfg = RLHFConfig(model=dict(kind="hf", path=str(tiny_hf)), sft=dict(steps=20),
                     reward=dict(steps=5), ppo=dict(max_new_tokens=6))
    policy = Policy(cfg, None, 0)
    assert policy.tok.encode("sort 31:") == [policy.tok.encode(c)[0] for c in "sort 31:"]
    policy.train.use_optimizer(cfg.sft.optimizer, 20)
    demos = SortTask().demonstrations(32, 0)
    losses = [policy.sft_step(demos, s).loss for s in range(1, 21)]
    assert losses[-1] < losses[0]
    g = policy.generate(RolloutRequest(["sort 321:", "sort 9:"], [0, 1]))
    assert g.ids.shape[1] == len(policy.tok.encode("sort 321:")) + 6
    reward, critic = Reward(cfg, None, 0), Critic(cfg, None, 0)
    reward.train.use_optimizer(cfg.reward.optimizer, 5)
    pairs = [(e.prompt, e.chosen, e.rejected) for e in SortTask().preferences(8, 0)]
    assert reward.rm_step(pairs, 1).loss > 0
    assert reward.score(g.ids, g.valid).shape == (2,)
    assert critic.values(g.ids, g.valid).shape == g.action.shape
