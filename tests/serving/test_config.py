"""A serve config names exactly one model source, and a missing one is reported before any
replica starts, naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest

from troupe.config import ConfigError, validate
from troupe.serving.model import locate
from troupe.serving.protocol import ServeConfig

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("model", [{}, {"file": "a.trp", "checkpoint": "runs/x"}])
def test_model_needs_exactly_one_source(model):
    with pytest.raises(ConfigError, match="model: .*exactly one of pretrained, checkpoint and file"):
        validate(ServeConfig, {"model": model}, "serve config")


def test_pretrained_overrides_the_recipes_source(tmp_path):
    """``model.pretrained=DIR`` on the command line wins over a recipe's checkpoint, and a
    directory without config.json is named before anything starts."""
    cfg = validate(ServeConfig, {"model": {"checkpoint": "runs/x", "pretrained": str(tmp_path)}},
                   "c")
    assert cfg.model.pretrained == str(tmp_path) and cfg.model.checkpoint is None
    with pytest.raises(FileNotFoundError, match="model.pretrained=.*no config.json there"):
        locate(cfg.model)


def test_missing_model_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.file='.*nope.trp' does not exist"):
        locate(validate(ServeConfig, {"model": {"file": str(tmp_path / "nope.trp")}}, "c").model)
    with pytest.raises(FileNotFoundError, match="model.checkpoint=.*neither a checkpoint"):
        locate(validate(ServeConfig, {"model": {"checkpoint": str(tmp_path)}}, "c").model)


def test_app_exits_2_naming_the_missing_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, "apps/serve.py", f"model.checkpoint={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"model.checkpoint='{tmp_path}'" in out.stderr
