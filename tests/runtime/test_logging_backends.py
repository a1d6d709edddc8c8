"""logging.backends (troupe.runtime.metrics): the records of metrics.jsonl also reach
TensorBoard event files and an offline Weights & Biases run, read back here value for value;
a backend whose package is missing is a config error naming it."""

import importlib.util
import json
from pathlib import Path

import pytest

from troupe.config import ConfigError, load_config
from troupe.pretrain import driver as pretrain
from troupe.pretrain.config import PretrainConfig
from troupe.runtime.metrics import LoggingConfig, MetricsLog

pytestmark = pytest.mark.waits  # one process writing its logs

RECORDS = [{"kind": "sft", "step": 1, "loss": 2.5}, {"kind": "sft", "step": 2, "loss": 2.0},
           {"kind": "step3", "step": 1, "gold": 0.25, "algorithm": "grpo", "note": None,
            "skipped": True, "padding": 0.5}]
EXPECTED = {("sft/loss", 1): 2.5, ("sft/loss", 2): 2.0, ("step3/gold", 1): 0.25,
            ("step3/padding", 1): 0.5}  # numbers only: no strings, None or booleans


def tensorboard_scalars(directory: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def wandb_history(directory: Path) -> tuple[dict[tuple[str, int], float], dict]:
    """The logged values of the offline run under ``directory`` (each at its kind's step)
    and its config, read from the run's .wandb file: a LevelDB-style log of protobuf records
    (a 7-byte header, then records of crc32, length, type in 32 KiB blocks)."""
    from wandb.proto.wandb_internal_pb2 import Record
    (path,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, buf, records = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    values, config = {}, {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            item = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item}
            kind = next(k.split("/")[0] for k in item if k.endswith("/step"))
            values.update({(k, item[f"{kind}/step"]): v for k, v in item.items()
                           if "/" in k and not k.endswith("/step")})
        elif rec.WhichOneof("record_type") == "run":
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                           for i in rec.run.config.update})
    return values, config


def test_the_records_reach_tensorboard_and_an_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(backends=["tensorboard", "wandb"], project="troupe-test")
    assert cfg.backends == ["jsonl", "tensorboard", "wandb"]  # jsonl always
    log = MetricsLog(tmp_path / "metrics.jsonl", cfg, {"seed": 3, "model": {"d_model": 32}})
    for r in RECORDS:
        log.write(r)
    log.close()
    assert log.records() == RECORDS
    assert tensorboard_scalars(tmp_path / "tensorboard") == EXPECTED
    values, config = wandb_history(tmp_path)
    assert values == EXPECTED
    assert config["seed"] == 3 and config["model"] == {"d_model": 32}


def test_a_missing_package_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match=r"mlflow needs the mlflow package.*troupe\[mlflow\]"):
        LoggingConfig(backends=["mlflow"])
    with pytest.raises(ConfigError, match="logging.backends"):
        load_config(PretrainConfig, None, ["logging.backends=[mlflow]"])
    with pytest.raises(ConfigError, match="logging.backends"):
        load_config(PretrainConfig, None, ["logging.backends=[csv]"])


def test_an_app_logs_its_training_records_to_tensorboard(cluster, tmp_path):
    cfg = PretrainConfig(model=dict(seq_len=16, n_layer=1, n_head=2, d_model=16),
                         data=dict(max_chars=50_000), workers=1, out_dir=str(tmp_path / "run"),
                         train=dict(steps=3, batch_size=2, eval_every=3, eval_batches=1,
                                    checkpoint_every=0),
                         logging=dict(backends=["tensorboard"]))
    records = pretrain.run(cfg, resume=None, progress=False)
    got = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    for r in records:
        if r["kind"] == "train":
            assert got[("train/loss", r["step"])] == pytest.approx(r["loss"], rel=1e-6)
        if r["kind"] == "eval":
            assert got[("eval/val_loss", r["step"])] == pytest.approx(r["val_loss"], rel=1e-6)


def test_the_records_reach_an_mlflow_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")  # an extra: troupe[mlflow]
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the run's files go to its out_dir, none to the working dir
    log = MetricsLog(tmp_path / "metrics.jsonl", LoggingConfig(backends=["mlflow"]),
                     {"seed": 3})
    for r in RECORDS:
        log.write(r)
    log.close()
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("troupe").experiment_id])
    got = {(key, m.step): m.value for key in run.data.metrics
           for m in client.get_metric_history(run.info.run_id, key)}
    assert got == EXPECTED
    assert list(elsewhere.iterdir()) == []
    assert json.loads((tmp_path / "mlartifacts" / run.info.run_id / "artifacts"
                       / "config.json").read_text()) == {"seed": 3}
