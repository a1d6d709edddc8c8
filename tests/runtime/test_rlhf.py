"""The RLHF pipeline on the graph: all three steps with two workers per role, and a critic
worker killed during PPO coming back from its checkpoint (or, without restarts, failing by name)."""

import json

import pytest

from tests.runtime.helpers import kill_worker
from troupe.errors import WorkerDiedError
from troupe.rlhf.config import RLHFConfig
from troupe.runtime import rlhf


def _cfg(tmp_path, name, **over) -> RLHFConfig:
    base = dict(model=dict(gpt=dict(seq_len=32, n_layer=2, n_head=2, d_model=32)),
                task=dict(sft_examples=500, preference_examples=500, eval_examples=16),
                sft=dict(steps=10, batch_size=8), reward=dict(steps=10, batch_size=8),
                ppo=dict(iterations=3, prompts_per_iter=8, max_new_tokens=6, eval_every=2,
                         checkpoint_every=1),
                workers=2, out_dir=str(tmp_path / name))
    base.update(over)
    return RLHFConfig(**base)


def test_three_steps_end_to_end(cluster, tmp_path):
    cfg = _cfg(tmp_path, "e2e")
    summary = rlhf.run(cfg)
    out = tmp_path / "e2e"
    for f in ("sft/policy.trp", "reward/reward.trp", "ppo/iter-00003/policy.trp",
              "ppo/iter-00003/critic.trp", "rlhf.png", "metrics.jsonl", "summary.json"):
        assert (out / f).is_file(), f
    kinds = {json.loads(line)["kind"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert {"sft", "sft_eval", "reward", "reward_eval", "ppo", "ppo_eval"} <= kinds
    assert 0.0 <= summary["reward_accuracy"] <= 1.0
    ppo = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
           if '"kind": "ppo"' in line]
    assert [r["step"] for r in ppo] == [1, 2, 3]
    assert all(r["generate_s"] > 0 and r["score_s"] > 0 and r["train_s"] > 0 for r in ppo)
    # step 3 alone reuses the weights of steps 1 and 2
    again = rlhf.run(cfg, ("ppo",))
    assert "after" in again["ppo"]


def _kill_critic_rank1(at: int):
    def hook(it, graph):
        if it == at:
            kill_worker(graph["critic"].actors[1], restart=True)
    return hook


def test_killed_critic_restarts_from_checkpoint(cluster, tmp_path):
    cfg = _cfg(tmp_path, "restart")
    rlhf.run(cfg, ("sft", "reward"))
    graph = rlhf.build_graph(cfg)
    try:
        data = rlhf.prepare_data(cfg)
        log = rlhf.MetricsLog(tmp_path / "restart" / "m.jsonl")
        out = tmp_path / "restart"
        res = rlhf.run_ppo(graph, cfg, data, log, out, out / "sft" / "policy.trp",
                           out / "reward" / "reward.trp", on_iteration=_kill_critic_rank1(2))
    finally:
        graph.shutdown()
    assert res["restarts"] == 1
    rec = [r for r in log.records() if r["kind"] == "recovery"]
    assert rec and rec[0]["role"] == "critic"


def test_killed_critic_without_restarts_fails_by_name(cluster, tmp_path):
    cfg = _cfg(tmp_path, "norestart", max_restarts=0)
    rlhf.run(cfg, ("sft", "reward"))
    graph = rlhf.build_graph(cfg)
    out = tmp_path / "norestart"
    try:
        with pytest.raises(WorkerDiedError, match="critic") as err:
            rlhf.run_ppo(graph, cfg, rlhf.prepare_data(cfg),
                         rlhf.MetricsLog(out / "m.jsonl"), out, out / "sft" / "policy.trp",
                         out / "reward" / "reward.trp", on_iteration=_kill_critic_rank1(2))
    finally:
        graph.shutdown()
    assert err.value.role == "critic"
