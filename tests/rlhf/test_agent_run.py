"""Step 3 with an environment (env.function) through the driver: GRPO and PPO train on
two-turn trajectories (tests/rlhf/agent_envs.py: Retry asks for a second answer and rewards it),
the records carry the turns, the share of tool turns and how the trajectories ended, a prompt
that breaks the environment is a counted failure, the held-out evaluation reports the
environment's reward, and the weights change."""

import json

import pytest
import torch

from troupe.models.io import read_module_file
from troupe.rlhf import driver as rlhf
from troupe.rlhf.config import RLHFConfig

def _rows(path, hazards: str):
    """Sorting prompts; one in four breaks the environment (with each of ``hazards`` in turn)."""
    with open(path, "w") as f:
        for i in range(32):
            prompt = f"sort {i * 7919 % 1000:03d}" + (hazards[i // 4 % len(hazards)]
                                                       if i % 4 == 1 else ":")
            f.write(json.dumps({"prompt": prompt, "chosen": "".join(sorted(prompt[5:8])),
                                "rejected": prompt[5:8]}) + "\n")


@pytest.mark.parametrize("algorithm, replicas, hazards", [
    ("grpo", 0, "!~%^"), ("ppo", 0, "!"), ("rloo", 0, "!"), ("reinforce_pp", 0, "!"),
    ("grpo", 1, "!")])
def test_agent_rollouts_train(rlhf_graphs, tmp_path, algorithm, replicas, hazards):
    """With hazards, environments that raise, hang, die and run out of memory: each a counted
    failure with its cause (and those sharing a replaced process lost with it), the run goes
    on. With a rollout replica: one-step-off, the trajectories generated on an actor of their
    own while the policy trains. RLOO's rollouts speculate (prompt lookup, batches of 4): the
    second turns continue the first, and the records count the passes."""
    _rows(tmp_path / "tasks.jsonl", hazards)
    cfg = RLHFConfig(
        algorithm=algorithm, steps=["sft", "step3"], sft=dict(steps=4, batch_size=4),
        model=dict(gpt=dict(seq_len=96, n_layer=2, n_head=2, d_model=32)),
        data=dict(path=str(tmp_path / "tasks.jsonl"), eval_fraction=0.25),
        env=dict(function="tests.rlhf.agent_envs:Retry", max_turns=3, max_tokens=64,
                 workers=4, timeout_s=3, memory_mb=1024),
        step3=dict(iterations=2, prompts_per_iter=8, max_new_tokens=6, eval_every=2,
                   checkpoint_every=2, temperature=1.0,
                   rollout=dict(replicas=replicas, max_staleness=replicas),
                   **(dict(speculate=4, generation_batch=4) if algorithm == "rloo" else {})),
        workers=2, out_dir=str(tmp_path / algorithm))
    assert "reward" not in rlhf.roles(cfg)  # the environment gives the rewards
    rlhf_graphs.run(cfg)
    records = rlhf.MetricsLog(tmp_path / algorithm / "metrics.jsonl").records()
    steps = [r for r in records if r["kind"] == "step3"]
    assert len(steps) == 2
    for r in steps:
        ends, failed = r["trajectory_ends"], r["env_failures"]
        assert set(ends) <= {"done", "failed"} and sum(ends.values()) == 8 * cfg.samples_per_prompt()
        causes = r["env_failure_causes"]
        assert ends.get("failed", 0) == failed == sum(causes.values())
        assert set(causes) <= ({"raised"} if hazards == "!" else
                               {"raised", "timeout", "exited", "lost"})
        if hazards == "!":  # each failure at its first step
            assert r["turns_mean"] == pytest.approx(2 - failed / sum(ends.values()))
        assert r["tool_call_fraction"] == 0.0
        assert 0 < r["response_length"] <= 2 * 6  # the model's tokens only
        assert r["prefill_tokens"] < r["prompt_tokens"]  # the second turns reuse the first
        if replicas:  # generated on the replica, one step off at most
            assert r["staleness_max"] <= 1 and "staleness_mean" in r
        if algorithm == "rloo":
            assert r["spec_passes"] > 0 and 0 <= r["spec_accept_rate"] <= 1
    assert sum(r["env_failures"] for r in steps) > 0
    seen = {c for r in steps for c in r["env_failure_causes"]}
    assert "raised" in seen and (len(hazards) == 1 or seen & {"timeout", "exited"})
    [last] = [r for r in records if r["kind"] == "step3_eval"][-1:]
    assert "tool_call_fraction" in last and (last["env_reward"] > 0 or len(hazards) > 1)
    _, start = read_module_file(tmp_path / algorithm / "sft" / "policy.trp")
    _, final = read_module_file(tmp_path / algorithm / "step3" / "iter-00002" / "policy.trp")
    assert any(not torch.equal(final[k], start[k]) for k in final)
