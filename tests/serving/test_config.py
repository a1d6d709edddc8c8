"""A serve config names exactly one model source, and a missing one is reported before any
replica starts, naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest

from troupe.config import ConfigError, validate
from troupe.serving.config import ServeConfig
from troupe.serving.model import locate

pytestmark = pytest.mark.waits  # the app's processes starting

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


@pytest.mark.own_cluster
def test_the_key_leaves_the_environment_before_ray_starts(tmp_path):
    """take_key (what `troupe serve` calls before Ray starts) removes the key from the
    driver's environment, so none of the processes of the embedded cluster inherits it."""
    import os
    import subprocess
    import sys

    key = "sk-environ-probe-9c1d7e"
    script = f"""
import os, pathlib
import troupe
from troupe.serving.auth import take_key
key, digest = take_key("TROUPE_TEST_PROBE_KEY")
assert key == {key!r} and digest.matches(key) and "TROUPE_TEST_PROBE_KEY" not in os.environ
troupe.init(num_cpus=1)
hits = []
for proc in pathlib.Path("/proc").iterdir():
    if not proc.name.isdigit() or proc.name == str(os.getpid()):  # the driver's own start-up
        continue                                                     # environment (read-only)
    try:
        if {key!r}.encode() in (proc / "environ").read_bytes():
            hits.append(proc.name)
    except (OSError, ValueError):
        pass
print("processes with the key:", hits)
troupe.shutdown()
assert not hits, hits
"""
    env = {**os.environ, "TROUPE_TEST_PROBE_KEY": key}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "processes with the key: []" in out.stdout
