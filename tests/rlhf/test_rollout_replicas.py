"""Step 3 with rollout replicas of their own (step3.rollout): in the synchronous order they
give today's runs to every digit (a stage-3 policy too); one-step-off batches are one update
stale and corrected; a replica killed mid-run is restarted, re-synced and asked again, and the
run completes; calls that reach a replica during a sync wait for it and carry the new
version."""

import json
from pathlib import Path

import pytest

from tests.runtime.helpers import kill_worker
from troupe.rlhf import driver as rlhf
from troupe.rlhf.experience import RolloutRequest
from troupe.rlhf.topology import RLHFTopology
from troupe.rlhf.workers import PolicyActor, RolloutActor
from troupe.rlhf.config import RLHFConfig

_TIMINGS = ("generate_s", "score_s", "train_s", "generated_tokens_per_s")


def _cfg(out: Path, **over) -> RLHFConfig:
    base = dict(model=dict(gpt=dict(seq_len=32, n_layer=2, n_head=2, d_model=32)),
                task=dict(sft_examples=300, preference_examples=300, eval_examples=8),
                sft=dict(steps=6, batch_size=8), reward=dict(steps=6, batch_size=8),
                step3=dict(iterations=3, prompts_per_iter=4, max_new_tokens=6, eval_every=3,
                           checkpoint_every=0),
                workers=2, out_dir=str(out))
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return RLHFConfig(**base)


@pytest.fixture(scope="module")
def base(cluster, tmp_path_factory):
    """Steps 1 and 2 once; each test copies their weights."""
    out = tmp_path_factory.mktemp("replicas") / "base"
    rlhf.run(_cfg(out), ("sft", "reward"))
    return out


def _step3(base: Path, out: Path, **over) -> list[dict]:
    """Step 3 alone from ``base``'s weights into ``out``; its step-3 records."""
    out.mkdir(parents=True)
    for d in ("sft", "reward"):
        (out / d).symlink_to(base / d)
    rlhf.run(_cfg(out, **over), ("step3",))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] in ("step3", "step3_eval")]


def _numbers(records: list[dict]) -> list[dict]:
    """The records without timings and without what only replicas report."""
    skip = {"sync_s", "sync_bytes", "sync_buckets", "weight_version", "staleness_mean",
            "staleness_max", "rollout_s", "rollout_restarts", "peak_memory_mb", *_TIMINGS}
    return [{k: v for k, v in r.items() if k not in skip and not k.endswith("_s")}
            for r in records]


@pytest.mark.parametrize("algorithm,zero_stage", [("grpo", 1), ("ppo", 3)])
def test_synchronous_replicas_give_todays_run_to_every_digit(base, tmp_path, algorithm,
                                                             zero_stage):
    """PPO with a stage-3 policy: its partitioned weights gathered once per sync."""
    today = _step3(base, tmp_path / "today", algorithm=algorithm, zero_stage=zero_stage,
                   step3=dict(iterations=2))
    got = _step3(base, tmp_path / "replicas", algorithm=algorithm, zero_stage=zero_stage,
                 step3=dict(iterations=2, rollout=dict(replicas=2, max_staleness=0)))
    assert _numbers(got) == _numbers(today)
    steps = [r for r in got if r["kind"] == "step3"]
    assert steps[0]["staleness_max"] == 0 and steps[0]["weight_version"] == 1
    assert steps[0]["sync_bytes"] > 0 and steps[0]["logprob_mismatch_max"] < 1e-4


def test_one_step_off_with_a_replica_killed_mid_run(base, tmp_path, monkeypatch):
    """One replica for two policy ranks (its batch cut in two), one-step-off: the batches
    after the first are one update stale and corrected (tis_cap 2 by default); the replica
    killed before iteration 3 is restarted and its batch asked again."""
    out = tmp_path / "stale"
    out.mkdir()
    for d in ("sft", "reward"):
        (out / d).symlink_to(base / d)
    cfg = _cfg(out, algorithm="grpo",
               step3=dict(iterations=4, rollout=dict(replicas=1, max_staleness=1,
                                                     sync_timeout_s=30)))
    killed = []

    def hook(it, graph):
        if it == 3 and not killed:
            killed.append(it)
            kill_worker(graph["rollout"].actors[0], restart=True)

    graph = rlhf.build_graph(cfg, steps=("step3",))
    try:
        log = rlhf.MetricsLog(out / "metrics.jsonl")
        res = rlhf.run_step3(graph, cfg, rlhf.prepare_data(cfg), log, out,
                             out / "sft" / "policy.trp", out / "reward" / "reward.trp",
                             on_iteration=hook)
        calls_during_a_sync_wait_for_it(graph)
    finally:
        graph.shutdown()
    records = log.records()
    steps = [r for r in records if r["kind"] == "step3"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["staleness_max"] for r in steps] == [0, 1, 1, 1]
    assert all(r["tis_truncated"] >= 0 and r["logprob_mismatch_mean"] >= 0 for r in steps)
    assert steps[1]["logprob_mismatch_max"] > 1e-4  # the weights moved between
    [restart] = [r for r in records if r["kind"] == "rollout_restart"]
    assert restart["replica"] == 0 and restart["step"] == 3
    assert res["rollout_restarts"] == 1 and res["restarts"] == 0
    assert [r["weight_version"] for r in steps[:3]] == [1, 2, 3]


def calls_during_a_sync_wait_for_it(graph):
    """A sync to version 7 and, sent while it runs, requests to the replica: every one is
    answered, with the new version."""
    topo = RLHFTopology.of(list(graph.roles), 2, 1, 1)
    recv = graph["rollout"].invoke_async(RolloutActor.receive_weights, topo, 7)
    send = graph["policy"].invoke_async(PolicyActor.send_weights, topo, 7)
    asked = [graph["rollout"].invoke_async(
        RolloutActor.generate, RolloutRequest([f"say {i}"] * 4, list(range(4))))
        for i in range(3)]
    send.result(), recv.result()
    answers = [ro for call in asked for ro in call.result()]
    assert len(answers) == 3 and all(ro.versions == [7] * 4 for ro in answers)
