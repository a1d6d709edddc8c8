"""The pretraining recipes validate, and a bad recipe or override is refused by name."""

import subprocess
import sys
from pathlib import Path

import pytest

from troupe.config import ConfigError, load_config
from troupe.pretrain.config import PretrainConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "apps" / "configs").glob("*moe*.yaml")) + [
    ROOT / "apps" / "configs" / "dense-tiny.yaml"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_validate(recipe):
    cfg = load_config(PretrainConfig, recipe)
    assert cfg.workers * 2 <= 16 and cfg.train.steps > 0


def test_bad_values_are_named():
    with pytest.raises(ConfigError, match=r"model\.moe\.top_k"):
        load_config(PretrainConfig, RECIPES[0], ["model.moe.top_k=0"])
    with pytest.raises(ConfigError, match="train.offload"):
        load_config(PretrainConfig, RECIPES[0], ["train.offload=true",
                                                 "optimizer.name=onebit_adam"])
    with pytest.raises(ConfigError, match="ep_size=3 must divide"):
        load_config(PretrainConfig, RECIPES[0], ["model.moe.ep_size=3"])


def test_cli_reports_config_errors_without_starting_ray():
    out = subprocess.run([sys.executable, str(ROOT / "apps" / "pretrain.py"), "--config",
                          str(RECIPES[0]), "optimizer.nmae=adam"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert "optimizer.nmae: unknown key" in out.stderr
