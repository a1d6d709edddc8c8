"""The RLHF pipeline on the graph: all three steps with two workers per role; a policy worker
killed during PPO, or the driver interrupted, going on from the last PPO checkpoint exactly as the
uninterrupted run (or, without restarts, failing by name with failure.json)."""

import json
from pathlib import Path

import pytest
import ray
import torch

from tests.runtime.helpers import kill_worker
from troupe.errors import RunFailedError
from troupe.models.io import read_module_file
from troupe.rlhf import driver as rlhf
from troupe.rlhf.algorithms import Advantages, Algorithm
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.pipeline.step3 import setup_roles
from troupe.rlhf.roles.actors import PolicyActor
from troupe.rlhf.roles.topology import RLHFTopology
from troupe.runtime import checkpoint


def _cfg(tmp_path, name, **over) -> RLHFConfig:
    base = dict(model=dict(gpt=dict(seq_len=32, n_layer=2, n_head=2, d_model=32)),
                task=dict(sft_examples=500, preference_examples=500, eval_examples=16),
                sft=dict(steps=10, batch_size=8), reward=dict(steps=10, batch_size=8),
                step3=dict(iterations=3, prompts_per_iter=8, max_new_tokens=6, eval_every=2,
                         checkpoint_every=1),
                workers=2, out_dir=str(tmp_path / name))
    base.update(over)
    return RLHFConfig(**base)


def test_three_steps_end_to_end(rlhf_graphs, tmp_path):
    cfg = _cfg(tmp_path, "e2e")
    summary = rlhf_graphs.run(cfg)
    out = tmp_path / "e2e"
    for f in ("sft/policy.trp", "reward/reward.trp", "step3/iter-00003/policy.trp",
              "step3/iter-00003/critic.trp", "rlhf.png", "metrics.jsonl", "summary.json"):
        assert (out / f).is_file(), f
    kinds = {json.loads(line)["kind"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert {"sft", "sft_eval", "reward", "reward_eval", "step3", "step3_eval"} <= kinds
    assert 0.0 <= summary["reward_accuracy"] <= 1.0
    ppo = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
           if '"kind": "step3"' in line]
    assert [r["step"] for r in ppo] == [1, 2, 3]
    assert all(r["generate_s"] > 0 and r["score_s"] > 0 and r["train_s"] > 0 for r in ppo)
    # fp32 policy and engine: the trainer's log-probabilities are the engine's
    assert all(r["logprob_mismatch_max"] < 1e-3 and r["tis_truncated"] == 0 for r in ppo)
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"kind": "step3_eval"' in line and '"peak_memory_mb"' in line]
    assert evals and set(evals[-1]["peak_memory_mb"]) == set(rlhf.roles(cfg))
    assert all(mb > 50 for mb in evals[-1]["peak_memory_mb"].values())  # torch alone is more
    # step 3 alone reuses the weights of steps 1 and 2
    again = rlhf_graphs.run(cfg, ("ppo",))  # step 3's older name
    assert "after" in again["step3"] and again["ppo"] == again["step3"]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["ppo"] == saved["step3"] == json.loads(json.dumps(again["step3"]))


def _once(at: int, action):
    """An on_iteration hook doing ``action(graph)`` before iteration ``at``, the first time only
    (a recovered run calls the hook again for the iterations it redoes)."""
    fired = []

    def hook(it, graph):
        if it == at and not fired:
            fired.append(it)
            action(graph)
    return hook


def _kill_rank1(role: str):
    return lambda graph: kill_worker(graph[role].actors[1], restart=True)


class Interrupted(Exception):
    """The driver stopping (Ctrl-C, a lost head node) in the middle of PPO."""


def _interrupt(graph):
    raise Interrupted


@pytest.fixture(scope="module")
def trained(cluster, tmp_path_factory):
    """Steps 1 and 2 done once; a graph with restarts allowed; the uninterrupted PPO run."""
    cfg = _cfg(tmp_path_factory.mktemp("ppo"), "base")
    graph = rlhf.build_graph(cfg)
    try:
        rlhf.run(cfg, ("sft", "reward"), graph=graph)  # the same processes then run PPO
        _, full = _ppo(graph, cfg, Path(cfg.out_dir) / "full")
        yield cfg, graph, full
    finally:
        graph.shutdown()


def _ppo(graph, cfg, out, hook=None, resume=False):
    """PPO from step 1's and 2's weights into ``out``, with every role built afresh first (as
    in a new graph); returns the run's result and its records, one per (kind, step): the last,
    which for a redone iteration is the redo, without the timings."""
    setup_roles(graph, RLHFTopology.of(list(graph.roles), cfg.workers, cfg.zero_stage))
    base, log = Path(cfg.out_dir), rlhf.MetricsLog(out / "metrics.jsonl")
    try:
        res = rlhf.run_step3(graph, cfg, rlhf.prepare_data(cfg), log, out,
                           base / "sft" / "policy.trp", base / "reward" / "reward.trp",
                           on_iteration=hook, resume=resume)
    except Interrupted:
        res = None
    final = {}
    for r in log.records():
        if r["kind"] in ("step3", "step3_eval"):
            final[(r["kind"], r["step"])] = {k: v for k, v in r.items()
                                             if not k.endswith("_s") and k != "peak_memory_mb"}
    return res, final


def _pids(group):
    return [ray.get(a.ready.remote())["pid"] for a in group.actors]


def test_killed_policy_rank_recovers_and_repeats_the_uninterrupted_run(trained):
    cfg, graph, full = trained
    out = Path(cfg.out_dir) / "killed"
    before = _pids(graph["policy"])
    res, got = _ppo(graph, cfg, out, _once(3, _kill_rank1("policy")))
    assert res["restarts"] == 1
    after = _pids(graph["policy"])
    assert after[0] == before[0] and after[1] != before[1]  # rank 1 is a new process
    [rec] = [r for r in rlhf.MetricsLog(out / "metrics.jsonl").records()
             if r["kind"] == "recovery"]
    assert (rec["role"], rec["rank"], rec["step"], rec["failed_step"]) == ("policy", 1, 2, 3)
    assert got == full  # every PPO and evaluation record, exactly
    assert sorted(k[1] for k in got if k[0] == "step3") == [1, 2, 3]
    _assert_same_weights(out, Path(cfg.out_dir) / "full")


def test_interrupted_ppo_resumes_from_its_checkpoint(trained):
    cfg, graph, full = trained
    out = Path(cfg.out_dir) / "interrupted"
    res, _ = _ppo(graph, cfg, out, _once(3, _interrupt))
    assert res is None and checkpoint.latest(out / "step3" / "checkpoints").name == \
        "step-00000002"
    res, got = _ppo(graph, cfg, out, resume=True)
    assert got == full and res["restarts"] == 0
    _assert_same_weights(out, Path(cfg.out_dir) / "full")


def _assert_same_weights(out, reference):
    """The final policy and critic weights of two runs are bit for bit the same."""
    for name in ("policy", "critic"):
        _, mine = read_module_file(out / "step3" / "iter-00003" / f"{name}.trp")
        _, theirs = read_module_file(reference / "step3" / "iter-00003" / f"{name}.trp")
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), name


def test_killed_critic_without_restarts_fails_by_name(trained, tmp_path):
    base = Path(trained[0].out_dir)  # steps 1 and 2 as the module's run did them
    cfg = _cfg(tmp_path, "norestart", max_restarts=0)
    graph = rlhf.build_graph(cfg)
    out = tmp_path / "norestart"
    try:
        with pytest.raises(RunFailedError, match="critic") as err:
            rlhf.run_step3(graph, cfg, rlhf.prepare_data(cfg),
                         rlhf.MetricsLog(out / "m.jsonl"), out, base / "sft" / "policy.trp",
                         base / "reward" / "reward.trp",
                         on_iteration=_once(2, _kill_rank1("critic")))
    finally:
        graph.shutdown()
    assert err.value.failures[-1]["role"] == "critic"
    report = json.loads((out / "failure.json").read_text())  # the one failure policy's report
    assert report["failures"] == err.value.failures


FLAKY_REWARD = '''
import os
import time

def flaky(prompt, response, **fields):
    """Exact match, except that the first call hangs, prompts with a 3 raise and prompts with a
    5 return text."""
    try:
        os.close(os.open(os.path.join(os.path.dirname(__file__), "hung"),
                         os.O_CREAT | os.O_EXCL))
        time.sleep(30)
    except FileExistsError:
        pass
    if "3" in prompt:
        raise RuntimeError("no threes")
    if "5" in prompt:
        return "five"
    return float(response == "".join(sorted(c for c in prompt if c.isdigit())))
'''


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "reinforce_pp", "gspo", "dpo"])
def test_each_algorithm_end_to_end(rlhf_graphs, tmp_path, algorithm):
    """Each algorithm's pipeline; GRPO's and RLOO's rollouts speculate (step3.speculate,
    batches of 4: prompt lookup over each prompt's digits, and a W8A8 copy of the policy as the
    draft) and their records say how it went."""
    spec = {"grpo": dict(speculate=4), "rloo": dict(speculate=4, speculate_draft="w8a8")}
    over = dict(step3=dict(_cfg(tmp_path, "").step3.model_dump(exclude_unset=True),
                           generation_batch=4, **spec[algorithm])) if algorithm in spec else {}
    cfg = _cfg(tmp_path, algorithm, algorithm=algorithm, dpo=dict(steps=4, batch_size=8),
               **over)
    assert rlhf.roles(cfg) == {"dpo": ["policy", "reference"], "gspo": ["policy", "reward"]
                               }.get(algorithm, ["policy", "reference", "reward"])
    summary = rlhf_graphs.run(cfg)
    assert {"sft", "step3", "reward_accuracy"} - set(summary) == (
        {"reward_accuracy"} if algorithm == "dpo" else set())
    assert "gold" in summary["step3"]["before"] and "gold" in summary["step3"]["after"]
    records = rlhf.MetricsLog(tmp_path / algorithm / "metrics.jsonl").records()
    kind = "dpo" if algorithm == "dpo" else "step3"
    steps = [r for r in records if r["kind"] == kind]
    assert len(steps) == (4 if algorithm == "dpo" else 3)
    if algorithm == "dpo":
        assert all(0 <= r["accuracy"] <= 1 for r in steps)
        assert summary["step3"]["reference_scored"] <= 4 * 8  # each pair scored once
    else:
        assert all(r["algorithm"] == algorithm and r["entropy"] > 0 and r["response_length"] > 0
                   and r["generated_tokens_per_s"] > 0 and "gold" in r for r in steps)
        if algorithm in spec:
            assert sum(r.get("spec_passes", 0) for r in steps) > 0
            assert all(0 <= r["spec_accept_rate"] <= 1 for r in steps if "spec_passes" in r)
        assert not (tmp_path / algorithm / "step3" / "iter-00003" / "critic.trp").exists()


@pytest.mark.parametrize("algorithm, source", [
    ("rloo", "function"), ("reinforce_pp", "function"), ("gspo", "function"), ("dapo", "model")])
def test_the_other_reward_source_runs_too(rlhf_graphs, tmp_path, monkeypatch, algorithm,
                                          source):
    """The combinations test_each_algorithm_end_to_end and the tests above leave out: every
    online algorithm runs with a learned reward model and with a reward function alone."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    reward = (dict(function="apps.rewards:sort_digits") if source == "function"
              else dict(steps=10, batch_size=8))
    cfg = _cfg(tmp_path, algorithm, algorithm=algorithm, reward=reward,
               step3=dict(iterations=1, prompts_per_iter=4, max_new_tokens=6, eval_every=1,
                          checkpoint_every=0))
    assert ("reward" in rlhf.roles(cfg)) == (source == "model")
    summary = rlhf_graphs.run(cfg)
    [step] = [r for r in rlhf.MetricsLog(tmp_path / algorithm / "metrics.jsonl").records()
              if r["kind"] == "step3"]
    assert step["algorithm"] == algorithm and "gold" in summary["step3"]["after"]
    assert ("reward_failures" in step) == (source == "function")


def test_failing_reward_function_is_counted_and_the_run_completes(rlhf_graphs, tmp_path,
                                                                   monkeypatch):
    (tmp_path / "flaky_rewards.py").write_text(FLAKY_REWARD)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cfg = _cfg(tmp_path, "flaky", algorithm="grpo",
               reward=dict(function="flaky_rewards:flaky", timeout_s=1.0, failure_score=-1.0),
               step3=dict(iterations=2, prompts_per_iter=4, max_new_tokens=6, eval_every=2,
                          checkpoint_every=0, temperature=1.5))
    assert rlhf.roles(cfg) == ["policy", "reference"]  # no reward model, no critic
    summary = rlhf_graphs.run(cfg, ("sft", "step3"))
    steps = [r for r in rlhf.MetricsLog(tmp_path / "flaky" / "metrics.jsonl").records()
             if r["kind"] == "step3"]
    assert len(steps) == 2
    failures = [r["reward_failures"] for r in steps]
    assert summary["step3"]["reward_failures"] == sum(failures) and all(f > 0 for f in failures)
    assert (tmp_path / "hung").exists()  # the hang happened and cost its time limit only


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_frozen_roles_in_the_trained_roles_processes_give_the_same_run(rlhf_graphs,
                                                                       tmp_path,
                                                                       monkeypatch, algorithm):
    """The reference inside the policy's workers (and for PPO the reward model, trained in
    step 2, inside the critic's): fewer roles in the graph, and every logged number equal to
    the run with each role in its own processes. GRPO scores with apps/rewards.py's function."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    extra = (dict(reward=dict(function="apps.rewards:sort_digits")) if algorithm == "grpo"
             else {})
    runs = {}
    for fused in (False, True):
        cfg = _cfg(tmp_path, f"{algorithm}{fused}", algorithm=algorithm,
                   reference_in_policy=fused, reward_in_critic=fused and algorithm == "ppo",
                   step3=dict(iterations=2, prompts_per_iter=4, max_new_tokens=6, eval_every=2,
                            checkpoint_every=0), **extra)
        want = {("grpo", False): ["policy", "reference"], ("grpo", True): ["policy"],
                ("ppo", False): ["policy", "reference", "reward", "critic"],
                ("ppo", True): ["policy", "critic"]}[algorithm, fused]
        assert rlhf.roles(cfg) == want
        summary = rlhf_graphs.run(cfg)
        runs[fused] = [{k: v for k, v in r.items()  # timings and memory differ
                        if not k.endswith("_s") and k != "peak_memory_mb"}
                       for r in rlhf.MetricsLog(tmp_path / f"{algorithm}{fused}" / "metrics.jsonl")
                       .records() if r["kind"] in ("reward", "reward_eval", "step3", "step3_eval")]
        runs[fused].append(summary.get("reward_accuracy"))
    assert runs[True] == runs[False]
    assert len(runs[True]) == (5 if algorithm == "grpo" else 16)  # (+ 10 reward steps, 1 eval)


def test_roles_compute_where_the_device_setting_resolves(trained, cluster):
    """device=auto with two ranks: cuda when the cluster has a GPU per rank, else the CPU;
    every worker of every role reports the same device."""
    cfg, graph, _ = trained
    want = "cuda" if cluster.num_gpus >= cfg.workers else "cpu"
    for role in rlhf.roles(cfg):
        names = graph[role].invoke(PolicyActor.device_name)  # every role's shell has it
        assert [d.split(":")[0] for d in names] == [want] * 2, role


def test_gpu_shares_and_a_device_the_cluster_lacks(cluster, tmp_path):
    colocated = _cfg(tmp_path, "gpus")
    assert rlhf.gpus_per_worker(colocated, "cpu") == 0
    assert rlhf.gpus_per_worker(colocated, "cuda") == 1 / 4  # policy, reference, reward, critic
    assert rlhf.gpus_per_worker(_cfg(tmp_path, "apart", colocate=False), "cuda") == 1
    assert rlhf.gpus_per_worker(_cfg(tmp_path, "given", num_gpus=0.5), "cuda") == 0.5
    if cluster.num_gpus == 0:
        with pytest.raises(ValueError, match="device=cuda: the workers need 2 GPUs"):
            rlhf.build_graph(_cfg(tmp_path, "cuda", device="cuda"))


@pytest.mark.gpu
def test_three_steps_on_cuda(cluster, tmp_path):
    """device=cuda, one rank: every role on the GPU (a third of it each, colocated), all three
    steps through, the rewards finite and the exported policy on the host's disk."""
    cfg = _cfg(tmp_path, "cuda", workers=1, device="cuda", precision="bf16",
               model=dict(gpt=dict(seq_len=32, n_layer=2, n_head=2, d_model=32)))
    graph = rlhf.build_graph(cfg)
    try:
        for role in rlhf.roles(cfg):
            assert graph[role].invoke(PolicyActor.device_name)[0].startswith("cuda"), role
    finally:
        graph.shutdown()
    summary = rlhf.run(cfg)
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["step3"]["after"].values()
               if isinstance(v, float))
    assert (tmp_path / "cuda" / "policy-hf" / "config.json").is_file()


class SignOfReward(Algorithm):
    """A toy algorithm declared here alone: each sample's advantage is the sign of its reward
    minus the batch's mean, on every token; no KL; it reports how many were positive."""

    name = "sign_of_reward"
    kl_coef = 0.0

    def advantages(self, s, cfg):
        reward = torch.cat(s.reward)
        sign = torch.sign(reward - reward.mean())
        return Advantages([a * sgn[:, None] for a, sgn in zip(s.action, sign.split(s.rows()))],
                          stats={"positive_share": (sign > 0).float().mean().item()})


def test_an_algorithm_declared_in_a_test_file_runs_through_the_driver(rlhf_graphs,
                                                                      tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    cfg = _cfg(tmp_path, "toy", algorithm=f"{__name__}:SignOfReward", **SORTED_EXACTLY)
    assert rlhf.roles(cfg) == ["policy"]  # no KL: no reference; a function: no reward model
    summary = rlhf_graphs.run(cfg, ("sft", "step3"))
    steps = [r for r in rlhf.MetricsLog(tmp_path / "toy" / "metrics.jsonl").records()
             if r["kind"] == "step3"]
    assert [r["algorithm"] for r in steps] == [cfg.algorithm] * 3
    assert all(0 <= r["positive_share"] <= 1 for r in steps)
    assert "gold" in summary["step3"]["after"]


SORTED_EXACTLY = dict(reward=dict(function="apps.rewards:sorted_exactly"))


def test_ppo_with_a_reward_function_alone_starts_its_critic_from_the_sft_policy(
        rlhf_graphs, tmp_path, monkeypatch):
    """No reward model: the critic starts from the SFT weights and a fresh value head (the
    run used to stop on "model file None does not exist")."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    cfg = _cfg(tmp_path, "ppo-fn", reward=dict(function="apps.rewards:sort_digits"))
    assert rlhf.roles(cfg) == ["policy", "reference", "critic"]
    rlhf_graphs.run(cfg, ("sft", "step3"))
    steps = [r for r in rlhf.MetricsLog(tmp_path / "ppo-fn" / "metrics.jsonl").records()
             if r["kind"] == "step3"]
    assert len(steps) == 3 and all(r["value_loss"] > 0 for r in steps)


def test_dapo_with_a_binary_reward_samples_dynamically(rlhf_graphs, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    cfg = _cfg(tmp_path, "dapo", algorithm="dapo", **SORTED_EXACTLY,
               step3=dict(iterations=2, prompts_per_iter=4, max_new_tokens=6, eval_every=2,
                        checkpoint_every=0, sample_rounds=2))
    assert rlhf.roles(cfg) == ["policy"]
    rlhf_graphs.run(cfg, ("sft", "step3"))
    steps = [r for r in rlhf.MetricsLog(tmp_path / "dapo" / "metrics.jsonl").records()
             if r["kind"] == "step3"]
    assert len(steps) == 2
    for r in steps:  # every round drew 4 groups; what was short was filled
        assert r["groups_sampled"] == 4 * r["sample_rounds"]
        assert r["groups_filled"] == max(0, 4 - r["groups_kept"])
        assert r["overlong_penalty"] <= 0
