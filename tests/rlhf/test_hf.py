"""A Hugging Face model directory in every role (model.pretrained): a tiny random Llama (and
Qwen3, Mistral) and a character-level tokenizer with a chat template, both built and saved by
the test (no hub)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.models.tiny import save_tiny_llama  # noqa: E402
from troupe.rlhf.config import RLHFConfig  # noqa: E402
from troupe.rlhf.data.datasets import SortTask  # noqa: E402
from troupe.rlhf.data.experience import RolloutRequest  # noqa: E402
from troupe.rlhf.roles.policy import Policy  # noqa: E402
from troupe.rlhf.roles.reference import Reference  # noqa: E402
from troupe.rlhf.roles.value import Critic, Reward  # noqa: E402

@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_every_role_runs_on_the_pretrained_model(family, tmp_path):
    """Llama; Qwen3 (q and k norms trained too); Mistral with a window shorter than a
    prompt, in training, generation and scoring alike."""
    pretrained = save_tiny_llama(tmp_path / family, family)
    cfg = RLHFConfig(model=dict(pretrained=str(pretrained)), sft=dict(steps=20),
                     reward=dict(steps=5), step3=dict(max_new_tokens=6))
    policy = Policy(cfg, None, 0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(pretrained)
    assert policy.tok.prompt("sort 31:") == hf_tok.encode("<user>sort 31:<end><assistant>",
                                                          add_special_tokens=False)
    policy.train.use_optimizer(cfg.sft.optimizer, 20)
    demos = SortTask().demonstrations(32, 0)
    losses = [policy.sft_step(demos, s).loss for s in range(1, 21)]
    assert losses[-1] < losses[0]
    g = policy.generate(RolloutRequest(["sort 321:", "sort 9:"], [0, 1]))
    assert g.ids.shape[1] == len(policy.tok.prompt("sort 321:")) + 6
    reward, critic, reference = Reward(cfg, None, 0), Critic(cfg, None, 0), Reference(cfg, 0)
    reward.train.use_optimizer(cfg.reward.optimizer, 5)
    pairs = [(e.prompt, e.chosen, e.rejected) for e in SortTask().preferences(8, 0)]
    assert reward.rm_step(pairs, 1).loss > 0
    reward.save(str(tmp_path / "reward.trp"))
    reward.load(str(tmp_path / "reward.trp"))  # frozen for PPO: no gradients, no optimizer
    assert all(p.grad is None and not p.requires_grad for p in reward.model.parameters())
    assert reward.train.opt is None and reward.train.flat.grad.numel() == 0
    assert reward.score(g.ids, g.valid).shape == (2,)
    assert critic.values(g.ids, g.valid).shape == g.action.shape
    assert not any(p.requires_grad for p in reference.lm.parameters())
    # the policy's logits are the transformers model's on the same (trained) weights
    policy.export(str(tmp_path / "policy-hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy-hf").eval()
    ids = torch.tensor([policy.tok.prompt("sort 4021:")])
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits,
                                   policy.lm.logits(ids, torch.ones_like(ids, dtype=torch.bool)),
                                   atol=1e-4, rtol=1e-4)
    assert (tmp_path / "policy-hf" / "tokenizer.json").is_file()
