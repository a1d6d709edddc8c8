"""RLHF with zero_stage 3 (and 2, the same partitions kept whole through a step): every
trained role (policy, reward model, critic) and the frozen reference partitioned over their
groups give stage 1's run, steps 1 and 2 bit for bit (two
ranks), step 3 within rounding (the partitioned policy runs a group's shared prompt once per
row, stage 1 once per group); the policy's weights are whole only while it generates."""

import json

import pytest

from tests.rlhf.test_driver import _cfg


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(records, kind, key):
    return [r[key] for r in records if r["kind"] == kind]


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_stage3_gives_stage1s_pipeline(rlhf_graphs, tmp_path, algorithm):
    over = dict(algorithm=algorithm, sft=dict(steps=6, batch_size=8),
                reward=dict(steps=6, batch_size=8),
                step3=dict(iterations=2, prompts_per_iter=8, max_new_tokens=6, eval_every=2,
                           checkpoint_every=2))
    if algorithm == "grpo":
        over["steps"] = ["sft", "step3"]
    one = rlhf_graphs.run(_cfg(tmp_path, "one", **over))
    a = _records(tmp_path / "one")
    for stage in (3, 2) if algorithm == "ppo" else (3,):  # stage 2: the same partitions
        name = f"stage{stage}"
        out = rlhf_graphs.run(_cfg(tmp_path, name, zero_stage=stage, **over))
        b = _records(tmp_path / name)
        assert _losses(b, "sft", "loss") == _losses(a, "sft", "loss")
        assert _losses(b, "reward", "loss") == _losses(a, "reward", "loss")
        for key in ("policy_loss", "response_length", "entropy"):
            got, want = _losses(b, "step3", key), _losses(a, "step3", key)
            assert len(got) == len(want) == 2
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), key
        assert out["exported"] and (tmp_path / name / "policy-hf" / "config.json").is_file()
        assert one.keys() == out.keys()
