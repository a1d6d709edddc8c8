import re
from typing import Literal

import pytest

from troupe.config import Config, ConfigError, load_config


class Optim(Config):
    name: Literal["adam", "onebit_adam"] = "adam"
    lr: float = 1e-3


class Train(Config):
    steps: int = 10
    optim: Optim = Optim()


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 5\noptim:\n  lr: 0.01\n")
    cfg = load_config(Train, path, ["optim.name=onebit_adam", "steps=7"])
    assert cfg.steps == 7 and cfg.optim.lr == 0.01 and cfg.optim.name == "onebit_adam"


def test_unknown_key_names_key_and_allowed_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lrr: 0.01\n")
    with pytest.raises(ConfigError) as e:
        load_config(Train, path)
    assert "optim.lrr" in str(e.value) and "lr, name" in str(e.value) and str(path) in str(e.value)


def test_bad_value_names_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(Train, None, ["optim.name=sgd"])
    assert "optim.name" in str(e.value) and "'adam'" in str(e.value) and "onebit_adam" in str(e.value)
    with pytest.raises(ConfigError, match="steps"):
        load_config(Train, None, ["steps=many"])


def test_override_syntax_and_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(Train, None, ["steps"])
    with pytest.raises(ConfigError, match="steps is a value"):
        load_config(Train, None, ["steps=3", "steps.x=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 5\noptim: [1,\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+"):
        load_config(Train, bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(Train, tmp_path / "missing.yaml")


@pytest.mark.parametrize("cls, override, words", [
    ("troupe.pretrain.config.PretrainConfig", "model.vocab_size=10", "model.vocab_size=10"),
    ("troupe.rlhf.config.RLHFConfig", "model.gpt.vocab_size=10", "model.gpt.vocab_size=10"),
    ("troupe.pretrain.config.PretrainConfig", "optimizer.betas=[1.5,0.9]", "optimizer.betas.0"),
    ("troupe.rlhf.config.RLHFConfig", "step3.actor.betas=[0.9,1.0]", "step3.actor.betas.1"),
])
def test_values_that_would_fail_later_are_refused_by_name(cls, override, words):
    """A byte-level model whose vocabulary cannot hold the byte ids (an IndexError at the
    first batch, before), Adam betas outside [0, 1) (accepted before)."""
    import importlib

    from troupe.config import ConfigError, load_config

    module, _, name = cls.rpartition(".")
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(getattr(importlib.import_module(module), name), None, [override])
