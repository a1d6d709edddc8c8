"""Pretraining end to end on 2 ranks: losses fall, and stopping then resuming from the
sharded checkpoint reproduces an uninterrupted run exactly."""

import json

import pytest
import ray

from tests.runtime.helpers import kill_worker
from troupe.errors import RunFailedError
from troupe.pretrain import driver as pretrain
from troupe.pretrain.config import PretrainConfig
from troupe.runtime import checkpoint
from troupe.runtime.metrics import MetricsLog

MOE = dict(num_experts=4, expert_interval=1, ep_size=2, capacity_factor=1.0, min_capacity=2)


def _cfg(tmp_path, name, **over) -> PretrainConfig:
    base = dict(
        model=dict(seq_len=32, n_layer=2, n_head=2, d_model=32, moe=MOE),
        optimizer=dict(name="adamw", lr=3e-3, warmup_steps=2),
        data=dict(max_chars=200_000),
        train=dict(steps=8, batch_size=4, eval_every=4, eval_batches=2, checkpoint_every=4),
        workers=2, out_dir=str(tmp_path / name))
    for key, value in over.items():
        section, _, field = key.rpartition("__")
        if section:
            base[section] = {**base.get(section, {}), field: value}
        else:
            base[field] = value
    return PretrainConfig(**base)


CASES = {
    "moe-adamw": {},
    "moe-onebit-adam": dict(optimizer__name="onebit_adam", optimizer__freeze_step=3),
    "moe-zero-one-adam": dict(optimizer__name="zero_one_adam", optimizer__var_freeze_step=3,
                              optimizer__var_update_scaler=1, optimizer__local_step_scaler=2),
    "dense-lamb-ltd": dict(model__moe=None, optimizer__name="onebit_lamb",
                           optimizer__freeze_step=3, curriculum__enabled=True,
                           curriculum__min_len=16, curriculum__total_steps=6,
                           random_ltd__enabled=True, random_ltd__min_tokens=8,
                           random_ltd__total_steps=6, random_ltd__last_layer=2,
                           random_ltd__first_layer=0),
    # the 1-bit state sharded over the ranks (the experts' over their edp group)
    "moe-onebit-adam-sharded": dict(optimizer__name="onebit_adam", optimizer__freeze_step=3,
                                    optimizer__shard_state=True),
    "dense-onebit-lamb-sharded": dict(model__moe=None, optimizer__name="onebit_lamb",
                                      optimizer__freeze_step=3, optimizer__shard_state=True),
    # ZeRO-3: each rank's shards and their layout in the checkpoint (troupe.parallel.zero3)
    "moe-zero3": dict(zero_stage=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_reproduces_uninterrupted_run(pretrain_graphs, tmp_path, case):
    full = pretrain_graphs.run(_cfg(tmp_path, "full", **CASES[case]), resume=None, progress=False)
    assert all(r["peak_memory_mb"] > 50 for r in full if r["kind"] == "train")  # each rank's
    over = dict(CASES[case])
    if case == "moe-zero-one-adam":  # checkpoints behind an fsspec URL, written in place
        over["train__checkpoint_dir"] = f"file://{tmp_path}/store/split"
    cfg = _cfg(tmp_path, "split", **over)
    first = pretrain_graphs.run(cfg, resume=None, stop_after=4, progress=False)
    second = pretrain_graphs.run(cfg, resume="auto", progress=False)
    assert [r["step"] for r in second if r["kind"] == "train"] == [5, 6, 7, 8]
    key = lambda r: (r["kind"], r["step"], r.get("loss"), r.get("val_loss"))  # noqa: E731
    assert [key(r) for r in first + second] == [key(r) for r in full]
    logged = [json.loads(line) for line in
              (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
              if '"kind": "placement"' not in line]  # where the ranks ran, at each start
    assert [key(r) for r in logged] == [key(r) for r in full]
    assert (tmp_path / "split" / "loss.png").stat().st_size > 1000
    if cfg.train.checkpoint_dir:
        assert str(checkpoint.latest(cfg.train.checkpoint_dir)).endswith("/step-00000008")
        assert not (tmp_path / "split" / "checkpoints").exists()


def test_losses_fall(pretrain_graphs, tmp_path):
    cfg = _cfg(tmp_path, "fall", train__steps=30, train__eval_every=10)
    records = pretrain_graphs.run(cfg, resume=None, progress=False)
    val = [r["val_loss"] for r in records if r["kind"] == "eval"]
    assert val[-1] < val[0] - 0.5, val


def test_damaged_checkpoint_is_named(pretrain_graphs, tmp_path):
    cfg = _cfg(tmp_path, "bad", train__steps=4)
    pretrain_graphs.run(cfg, resume=None, progress=False)
    directory = checkpoint.latest(tmp_path / "bad" / "checkpoints")
    victim = directory / "rank-00001.trp"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(Exception, match="rank-00001.trp does not match its manifest"):
        pretrain_graphs.run(cfg, resume=str(directory), progress=False)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_offloaded_shards_match_zero1(pretrain_graphs, tmp_path, optimizer):
    """Master weights and optimizer state on ParameterShard actors give the losses of ZeRO-1
    inside the trainers, hold 1/W of the state each, and resume exactly."""
    over = dict(optimizer__name=optimizer, model__moe=None, train__steps=6,
                train__checkpoint_every=3, train__eval_every=3)
    zero1 = pretrain_graphs.run(_cfg(tmp_path, "zero1", **over), resume=None, progress=False)
    cfg = _cfg(tmp_path, "offload", train__offload=True, **over)
    first = pretrain_graphs.run(cfg, resume=None, stop_after=3, progress=False)
    second = pretrain_graphs.run(cfg, resume="auto", progress=False)
    steps = ("train", "eval")  # not the plan record that opens a fresh run
    a = [r.get("loss", r.get("val_loss")) for r in zero1 if r["kind"] in steps]
    b = [r.get("loss", r.get("val_loss")) for r in first + second if r["kind"] in steps]
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    with pretrain_graphs.use(cfg) as built:  # the run's graph, set up afresh
        owners = built.owners
    assert all(t.optimizer_bytes == 0 for t in built.trainers)  # trainers hold no state
    total = 2 * owners[0].param_bytes
    assert [o.optimizer_bytes for o in owners] == [total] * 2  # m and v of one shard each


def test_each_trainer_computes_with_its_threads(cluster, tmp_path):
    built = pretrain.build_graph(_cfg(tmp_path, "threads", model__moe=None, workers=1,
                                      threads=2), name="threads")
    built.shutdown()
    assert [t.threads for t in built.trainers] == [2]


@pytest.mark.parametrize("optimizer", ["adamw", "onebit_adam"])
def test_full_model_from_sharded_checkpoint(pretrain_graphs, tmp_path, optimizer):
    """The single-process model rebuilt from the ranks' shards (experts from both
    expert-parallel slices) scores the run's last validation loss."""
    import torch

    from troupe.pretrain.export import load_full_model
    # one of them with its checkpoints behind an fsspec URL, away from the run's config.json:
    # the manifest carries the config
    root = f"file://{tmp_path}/store" if optimizer == "onebit_adam" else None
    cfg = _cfg(tmp_path, optimizer, model__moe={**MOE, "dropless": True},
               optimizer__name=optimizer, optimizer__freeze_step=2, train__steps=4,
               train__checkpoint_dir=root)
    records = pretrain_graphs.run(cfg, resume=None, progress=False)
    model = load_full_model(checkpoint.latest(root or tmp_path / optimizer / "checkpoints"))
    from troupe.data import TokenDataset
    data = TokenDataset(cfg.data)
    with torch.no_grad():
        losses = [model(x, y)[1].item() for x, y in data.val_batches(
            cfg.train.eval_batches, cfg.train.batch_size, cfg.model.seq_len)]
    assert sum(losses) / len(losses) == pytest.approx(records[-1]["val_loss"], abs=1e-5)
    if root:  # what apps/serve.py loads for model.checkpoint=<the URL>
        from troupe.serving.model import load_source
        from troupe.serving.config import ModelSource
        served = load_source(ModelSource(checkpoint=root, name="m"))
        x = torch.randint(0, 256, (2, cfg.model.seq_len))
        assert torch.equal(served(x)[0], model.eval()(x)[0])


def _train_key(records):
    return [(r["kind"], r["step"], r.get("loss"), r.get("val_loss")) for r in records
            if r["kind"] in ("train", "eval")]


def test_killed_rank_is_restarted_and_the_run_matches_the_uninterrupted_one(pretrain_graphs,
                                                                          tmp_path):
    """Rank 1 is killed before step 6: Ray restarts it, the groups (dp, and the expert
    groups) are rebuilt, every rank reloads step 4's checkpoint, and the logged losses are
    the uninterrupted run's, 1-bit error feedback included."""
    case = CASES["moe-onebit-adam"]
    full = pretrain_graphs.run(_cfg(tmp_path, "full", **case), resume=None, progress=False)
    pids = {}  # the run killed builds its own graph: the kept ones stay whole

    def kill_rank_1(step, graph):
        pids.setdefault(step, [ray.get(a.ready.remote())["pid"] for a in graph["trainer"].actors])
        if step == 6 and "killed" not in pids:
            pids["killed"] = True
            kill_worker(graph["trainer"].actors[1], restart=True)

    cfg = _cfg(tmp_path, "killed", max_restarts=1, **case)
    records = pretrain.run(cfg, resume=None, progress=False, on_step=kill_rank_1)
    logged = MetricsLog(tmp_path / "killed" / "metrics.jsonl").records()
    assert _train_key(logged) == _train_key(full)
    assert _train_key(records) == _train_key(full)
    [rec] = [r for r in logged if r["kind"] == "recovery"]
    assert (rec["role"], rec["rank"], rec["step"], rec["failed_step"]) == ("trainer", 1, 4, 6)
    assert rec["kind"] == "recovery" and rec["node_id"]
    assert pids[5][0] == pids[8][0] and pids[5][1] != pids[8][1]  # a new process for rank 1


def test_failures_beyond_max_restarts_stop_with_a_report(cluster, tmp_path):
    def kill(step, graph):
        if step == 3:
            kill_worker(graph["trainer"].actors[1], restart=True)

    cfg = _cfg(tmp_path, "fails", model__moe=None, max_restarts=0)
    with pytest.raises(RunFailedError) as e:
        pretrain.run(cfg, resume=None, progress=False, on_step=kill)
    [f] = e.value.failures
    assert (f["role"], f["rank"], f["step"]) == ("trainer", 1, 3) and f["node_id"]
    assert "died" in f["cause"] and "trainer" in str(e.value) and "rank 1" in str(e.value)
    report = json.loads((tmp_path / "fails" / "failure.json").read_text())
    assert report["failures"] == e.value.failures


def test_lying_manifest_is_refused_and_a_damaged_newest_checkpoint_is_skipped(pretrain_graphs,
                                                                               tmp_path):
    """A manifest whose config does not describe the saved weights is refused by export and
    serving (issue 14); resume skips a damaged newest checkpoint, says so, and goes on from the
    previous complete one to the uninterrupted run's losses."""
    from troupe.checkpoint import CheckpointError
    from troupe.models import GPTConfig
    from troupe.models.record import architecture_hash
    from troupe.pretrain.export import load_full_model
    from troupe.serving.model import load_source
    from troupe.serving.config import ModelSource

    cfg = _cfg(tmp_path, "lie", model__moe=None, train__steps=3, train__checkpoint_every=1,
               train__eval_every=0)
    full = pretrain_graphs.run(cfg, resume=None, progress=False)
    root = tmp_path / "lie" / "checkpoints"
    newest = checkpoint.latest(root)
    manifest = json.loads((newest / "manifest.json").read_text())
    honest = json.dumps(manifest)
    manifest["model"]["architecture"]["n_layer"] = 1  # edited by hand: the hash says so
    (newest / "manifest.json").write_text(json.dumps(manifest))
    for load in (load_full_model, lambda d: load_source(ModelSource(checkpoint=str(d), name="m"))):
        with pytest.raises(CheckpointError, match="does not match its sha256"):
            load(newest)
    lie = GPTConfig(**manifest["model"]["architecture"])  # a record that lies consistently
    manifest["model"]["sha256"] = architecture_hash(lie)
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not describe these weights"):
        load_full_model(newest)
    with pytest.raises(CheckpointError, match="dense parameters"):
        load_source(ModelSource(checkpoint=str(newest), name="m"))
    (newest / "manifest.json").write_text(honest)
    victim = newest / "rank-00001.trp"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    again = pretrain_graphs.run(cfg, resume="auto", progress=False)
    assert [(r["kind"], r["step"]) for r in again] == [("train", 3), ("eval", 3)]
    assert _train_key(again) == _train_key(full)[-2:]


def test_resume_refuses_a_checkpoint_of_another_architecture(pretrain_graphs, tmp_path):
    """The same run resumed with another n_head (the same tensor shapes: it would load
    silently and compute another model), or another optimizer (whose state has another
    layout), is refused naming the field, before any rank loads."""
    from troupe.checkpoint import CheckpointError

    cfg = _cfg(tmp_path, "arch", model__moe=None, train__steps=2, train__checkpoint_every=1,
               train__eval_every=0)
    pretrain_graphs.run(cfg, resume=None, progress=False)
    other = _cfg(tmp_path, "arch", model__moe=None, model__n_head=4, train__steps=3,
                 train__eval_every=0)
    with pytest.raises(CheckpointError, match=r"another model.*n_head=2 vs 4"):
        pretrain_graphs.run(other, resume="auto", progress=False)
    onebit = _cfg(tmp_path, "arch", model__moe=None, optimizer__name="onebit_adam",
                  train__steps=3, train__eval_every=0)
    with pytest.raises(CheckpointError, match="optimizer='adamw', this run has optimizer="):
        pretrain_graphs.run(onebit, resume="auto", progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adamw", "onebit_adam"])
def test_resume_on_cuda_reproduces_the_uninterrupted_run(cluster, tmp_path, optimizer):
    """device=cuda on one GPU (a dense model: one rank, so no NCCL group): stopping and
    resuming from the checkpoint (its CUDA random stream included) gives the uninterrupted
    run's losses exactly, and the ranks' peak memory is the CUDA allocator's."""
    over = dict(model__moe=None, workers=1, device="cuda",
                optimizer__name=optimizer)
    full = pretrain.run(_cfg(tmp_path, "full", **over), resume=None, progress=False)
    cfg = _cfg(tmp_path, "split", **over)
    first = pretrain.run(cfg, resume=None, stop_after=4, progress=False)
    second = pretrain.run(cfg, resume="auto", progress=False)
    key = lambda r: (r["kind"], r["step"], r.get("loss"), r.get("val_loss"))  # noqa: E731
    assert [key(r) for r in first + second] == [key(r) for r in full]
    assert all(0 < r["peak_memory_mb"] < 2000 for r in full if r["kind"] == "train")
