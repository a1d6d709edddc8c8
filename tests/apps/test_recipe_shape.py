"""One shape of recipe across the apps: the shared settings at the top level under one name,
the same overrides on every app, the older places read with a warning naming the new key."""

import logging

import pytest
import yaml

from troupe.cli import main
from troupe.config import ConfigError, load_config
from troupe.pretrain.config import PretrainConfig
from troupe.rlhf.config import RLHFConfig

SHARED = {"pretrain": ["device", "precision", "seed", "out_dir", "workers", "num_gpus",
                       "max_restarts"],
          "rlhf": ["device", "precision", "seed", "out_dir", "workers", "num_gpus",
                   "max_restarts", "decode_graphs"],
          "serve": ["device", "precision", "num_gpus", "decode_graphs"]}


@pytest.mark.parametrize("app", ["pretrain", "rlhf", "serve"])
def test_the_same_overrides_work_on_every_app(capsys, tmp_path, app):
    from troupe.models import GPT, GPTConfig
    from troupe.serving.model import save_model

    extra = []
    if app == "serve":  # the recipe's checkpoint is not trained here: a model file instead
        save_model(GPT(GPTConfig(n_layer=1, d_model=32, n_head=2)), tmp_path / "m.trp")
        extra = ["model.checkpoint=null", f"model.file={tmp_path / 'm.trp'}"]
    with pytest.raises(SystemExit) as e:
        main([app, "--print-config", "device=cpu", "precision=bf16", *extra])
    assert e.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["device"] == "cpu" and printed["precision"] == "bf16"
    assert all(key in printed for key in SHARED[app]), sorted(printed)


@pytest.mark.parametrize("app", ["rlhf", "serve"])
def test_decode_graphs_on_the_cpu_is_refused_naming_both_keys(capsys, tmp_path, app):
    """CUDA graphs of the decode step need a GPU: decode_graphs=true with device=cpu exits 2
    in one line that names both settings (with auto, a CPU run decodes as the CPU does)."""
    from troupe.models import GPT, GPTConfig
    from troupe.serving.model import save_model

    extra = []
    if app == "serve":
        save_model(GPT(GPTConfig(n_layer=1, d_model=32, n_head=2)), tmp_path / "m.trp")
        extra = ["model.checkpoint=null", f"model.file={tmp_path / 'm.trp'}"]
    with pytest.raises(SystemExit) as e:
        main([app, "--print-config", "device=cpu", "decode_graphs=true", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "decode_graphs=true" in err and "device=cpu" in err, err
    with pytest.raises(SystemExit) as e:
        main([app, "--print-config", "device=auto", "decode_graphs=true", *extra])
    assert e.value.code == 0


@pytest.mark.parametrize("cls, old, new, value", [
    (PretrainConfig, "train.device", "device", "cpu"),
    (PretrainConfig, "train.precision", "precision", "bf16"),
    (PretrainConfig, "train.num_workers", "workers", 4),
    (PretrainConfig, "train.seed", "seed", 7),
    (PretrainConfig, "train.out_dir", "out_dir", "runs/x"),
    (PretrainConfig, "train.max_restarts", "max_restarts", 3),
    (PretrainConfig, "train.num_gpus", "num_gpus", 0.5),
    (RLHFConfig, "model.precision", "precision", "fp16"),
])
def test_old_places_are_read_with_a_warning_naming_the_new_key(caplog, cls, old, new, value):
    with caplog.at_level(logging.WARNING, logger="troupe.config"):
        cfg = load_config(cls, None, [f"{old}={value}"])
    assert getattr(cfg, new) == value
    assert f"{old} is now {new}" in caplog.text
    with pytest.raises(ConfigError, match=f"{old} and {new} both given"):
        load_config(cls, None, [f"{old}={value}", f"{new}={value}"])


def test_a_stored_config_in_the_old_shape_still_loads():
    """A run's config.json or manifest written before the move (nested dicts, not overrides)."""
    old = {"train": {"num_workers": 1, "seed": 3, "out_dir": "runs/old", "steps": 5},
           "model": {"d_model": 32, "n_head": 2, "n_layer": 1}}
    cfg = PretrainConfig.model_validate(old)
    assert (cfg.workers, cfg.seed, cfg.out_dir, cfg.train.steps) == (1, 3, "runs/old", 5)
    assert old["train"]["num_workers"] == 1  # the caller's dict is left as it was


def test_a_rollout_draft_needs_speculation_and_no_int8_rollouts():
    with pytest.raises(ValueError, match=r"step3.speculate_draft=w8a8.*step3.speculate=0"):
        RLHFConfig(step3=dict(speculate_draft="w8a8"))
    with pytest.raises(ValueError, match=r"speculate_draft=w8a8.*int8_generation"):
        RLHFConfig(step3=dict(speculate=4, speculate_draft="w8a8", int8_generation=True))
    assert RLHFConfig(step3=dict(speculate=4, speculate_draft="w8a8")).step3.speculate == 4
