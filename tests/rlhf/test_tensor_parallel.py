"""RLHF roles split by tensor parallelism (``tensor_parallel``): three ranks (threads with gloo
groups) holding a Llama of SmolLM2's head layout (9 query, 3 key/value heads) between them
train, generate and score as the whole model does; through the driver, a policy split over two
ranks sends its weights, put together, to a whole rollout replica."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.models.tiny import save_tiny_llama  # noqa: E402
from troupe.collectives.threads import run_ranks  # noqa: E402
from troupe.config import ConfigError  # noqa: E402
from troupe.models import GPT  # noqa: E402
from troupe.models.io import read_module_file  # noqa: E402
from troupe.parallel import weight_sync  # noqa: E402
from troupe.rlhf import driver as rlhf  # noqa: E402
from troupe.rlhf.config import RLHFConfig  # noqa: E402
from troupe.rlhf.data.datasets import SortTask  # noqa: E402
from troupe.rlhf.data.experience import Experience, RolloutRequest  # noqa: E402
from troupe.rlhf.plan import plan  # noqa: E402
from troupe.rlhf.roles.policy import Policy  # noqa: E402
from troupe.rlhf.roles.value import Reward  # noqa: E402

PROMPTS = ["sort 321:", "sort 9:", "sort 5501:", "sort 70:"]


@pytest.fixture(scope="module")
def smol_heads(tmp_path_factory):
    """A tiny random Llama with SmolLM2's 9 query and 3 key/value heads (weights drawn wide
    enough that greedy decoding varies)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tp") / "llama-9-3",
                           num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                           intermediate_size=96, initializer_range=0.3)


def _cfg(path, T, step3=None, **over) -> RLHFConfig:
    return RLHFConfig(model=dict(pretrained=str(path)), sft=dict(steps=4, batch_size=8),
                      reward=dict(steps=2, batch_size=8),
                      step3=dict(max_new_tokens=12, temperature=0.0, **(step3 or {})),
                      workers=1, tensor_parallel=T, **over)


def _policy_run(path, out, tp):
    """Greedy rollouts, four SFT steps, greedy rollouts again, their log-probabilities, one
    GRPO-style update, the weights saved and exported: what T ranks give (rank 0's)."""
    T = 1 if tp is None else tp.world_size
    pol = Policy(_cfg(path, T), None, 0 if tp is None else tp.rank, tp)
    before = pol.generate(RolloutRequest(PROMPTS, [0, 1, 2, 3]))
    pol.train.use_optimizer(pol.cfg.sft.optimizer, 4)
    demos = SortTask().demonstrations(32, 0)
    losses = [pol.sft_step(demos[8 * s:8 * s + 8], s + 1).loss for s in range(4)]
    after = pol.generate(RolloutRequest(PROMPTS, [0, 1, 2, 3]))
    logp = pol.logprobs(after.ids, after.valid, after.action, after.prompt_len)
    pol.train.use_optimizer(pol.cfg.step3.actor, 1)
    adv = torch.linspace(-1, 1, len(PROMPTS))[:, None] * after.action
    stats = pol.rl_step(Experience(after.ids, after.valid, after.action, adv,
                                   old_logp=logp, prompt_len=after.prompt_len), 1, None)
    pol.save(str(out / f"policy-{T}.trp"))
    pol.export(str(out / f"hf-{T}"))
    return (before.ids.tolist(), losses, after.ids.tolist(), logp, stats,
            after.engine_logp)


def test_a_policy_split_three_ways_is_the_whole_model(smol_heads, tmp_path):
    whole = _policy_run(smol_heads, tmp_path, None)
    ranks = run_ranks(3, lambda tp: _policy_run(smol_heads, tmp_path, tp))
    split = ranks[0]
    assert all(r[0] == split[0] and r[2] == split[2] for r in ranks)  # the ranks agree
    # greedy tokens identical, before and after SFT (fp32)
    assert split[0] == whole[0] and split[2] == whole[2]
    assert len({tuple(row) for row in whole[2]}) > 1  # not one repeated answer
    for a, b in zip(split[1], whole[1]):  # SFT losses
        assert abs(a - b) <= 1e-5 * abs(b)
    torch.testing.assert_close(split[3], whole[3], atol=1e-4, rtol=1e-4)  # vocab-parallel
    torch.testing.assert_close(split[5], whole[5], atol=1e-4, rtol=1e-4)  # the engine's
    assert abs(split[4].entropy - whole[4].entropy) <= 1e-5 * whole[4].entropy
    assert abs(split[4].policy_loss - whole[4].policy_loss) <= 1e-5
    # the saved file holds the whole model, the same weights as the unsplit run's
    _, saved3 = read_module_file(tmp_path / "policy-3.trp")
    _, saved1 = read_module_file(tmp_path / "policy-1.trp")
    assert saved3.keys() == saved1.keys()
    for k in saved1:
        torch.testing.assert_close(saved3[k], saved1[k], atol=2e-5, rtol=1e-4)
    # the export is a Hugging Face model with the unsplit model's logits
    ids = torch.tensor([whole[2][0]])
    logits = [transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{T}")
              .eval()(input_ids=ids).logits for T in (1, 3)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def test_a_split_reward_model_trains_as_the_whole_one_and_loads_a_whole_file(smol_heads,
                                                                               tmp_path):
    pairs = [(e.prompt, e.chosen, e.rejected) for e in SortTask().preferences(16, 0)]

    def steps(tp):
        T = 1 if tp is None else tp.world_size
        rm = Reward(_cfg(smol_heads, T), None, 0 if tp is None else tp.rank, tp)
        rm.train.use_optimizer(rm.cfg.reward.optimizer, 2)
        losses = [rm.rm_step(pairs[8 * s:8 * s + 8], s + 1).loss for s in range(2)]
        rm.save(str(tmp_path / f"reward-{T}.trp"))
        rm.load(str(tmp_path / "reward-1.trp"))  # a whole model's file, cut to shards
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        return losses, rm.score(ids, torch.ones_like(ids, dtype=torch.bool))

    whole = steps(None)
    split = run_ranks(3, steps)[0]
    for a, b in zip(split[0], whole[0]):
        assert abs(a - b) <= 1e-5 * abs(b)
    torch.testing.assert_close(split[1], whole[1], atol=1e-5, rtol=1e-4)


def test_what_tensor_parallelism_does_not_split_is_refused(smol_heads, tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel=3 with step3.lora"):
        _cfg(smol_heads, 3, step3=dict(lora=dict(enabled=True)))
    with pytest.raises(ValueError, match="tensor_parallel=3 with step3.actor.name='lamb'"):
        _cfg(smol_heads, 3, step3=dict(actor=dict(name="lamb")))
    with pytest.raises(ValueError, match="step3.rollout.tensor_parallel=3 with "
                                         "step3.int8_generation"):
        _cfg(smol_heads, 1, step3=dict(rollout=dict(replicas=1, tensor_parallel=3),
                                       int8_generation=True))
    with pytest.raises(ValueError, match="with colocate=true: colocated roles share"):
        _cfg(smol_heads, {"policy": 3})  # the critic and reward model whole, beside it
    with pytest.raises(ValueError, match="tensor_parallel.reference=1: with "
                                         "reference_in_policy"):
        _cfg(smol_heads, {"policy": 3, "reference": 1}, colocate=False,
             reference_in_policy=True)
    with pytest.raises(ValueError, match=r"sizes must be 1..1024, got \{'tensor_parallel."
                                         r"critic': 0\}"):
        _cfg(smol_heads, {"critic": 0})
    with pytest.raises(ValueError, match=r"tensor_parallel=3: model has 4 query and 2 "
                                         r"key/value heads.*\[1, 2\]"):
        RLHFConfig(model=dict(gpt=dict(n_head=4, n_kv_head=2, d_model=32)), tensor_parallel=3)
    with pytest.raises(ConfigError, match=r"tensor_parallel=2: model has 9 query .* "
                                          r"\[1, 3\].*config.json"):
        plan(_cfg(smol_heads, 2, out_dir=str(tmp_path)), ("sft",))
    # the memory plan counts a rank's shards, and a refusal names the size that fits
    shape = dict(model=dict(gpt=dict(n_layer=4, n_head=4, d_model=256, seq_len=64)),
                 memory_per_worker=0.04, workers=1, steps=["sft"], out_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"tensor_parallel=2 would plan 24.9 MiB a rank"):
        plan(RLHFConfig(**shape), ("sft",))
    assert plan(RLHFConfig(**shape, tensor_parallel=2), ("sft",)).memory[
        "policy (sft)"].total < 0.04 * 2**30


def test_a_split_policy_syncs_a_replica_split_another_way(cluster, tmp_path):
    """GRPO through the driver, each role its own size: the policy over two ranks, the
    frozen reference whole, one rollout replica over four (4 query heads, 2 key/value heads
    replicated: inference). The reference's log-probabilities of the first batch are the
    policy's (the same SFT weights, split and not: a KL of zero); each sync carries the whole
    model (the policy's shards put together by name, the replica's ranks each cutting its
    own), and the replica's log-probabilities of what it sampled are the split trainer's."""
    cfg = RLHFConfig(
        model=dict(gpt=dict(seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                            dropout=0.0, positions="rope", norm="rmsnorm", mlp="swiglu",
                            out_bias=False, mlp_bias=False)),
        algorithm="grpo", reward=dict(function="apps.rewards:sort_digits"),
        sft=dict(steps=3, batch_size=8),
        task=dict(sft_examples=64, preference_examples=64, eval_examples=8),
        step3=dict(iterations=2, prompts_per_iter=4, samples_per_prompt=2, max_new_tokens=6,
                   eval_every=2, rollout=dict(replicas=1, tensor_parallel=4, num_cpus=0.2)),
        workers=1, tensor_parallel={"policy": 2, "reference": 1}, colocate=False,
        num_cpus=0.2, out_dir=str(tmp_path / "grpo"))
    rlhf.run(cfg)
    records = [json.loads(line) for line in (tmp_path / "grpo/metrics.jsonl").open()]
    step3 = [r for r in records if r["kind"] == "step3"]
    whole = weight_sync.Layout.of(weight_sync.sync_specs(GPT(cfg.model.gpt)), 64 << 20)
    synced = [r for r in step3 if "sync_bytes" in r]  # the weights of each version to come
    assert len(step3) == 2 and synced
    assert all(r["sync_bytes"] == whole.nbytes for r in synced)
    assert all(r["logprob_mismatch_max"] < 1e-3 for r in step3)
    assert abs(step3[0]["kl_loss"]) < 1e-6  # before the first update: the same model
    assert (tmp_path / "grpo/step3/iter-00002/policy.trp").is_file()
