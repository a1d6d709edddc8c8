"""apps/rlhf.py refuses a bad override or a misused --resume by name, before Ray starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from troupe.config import ConfigError, load_config, recipe_path
from troupe.rlhf import driver as rlhf
from troupe.rlhf.config import RLHFConfig

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "apps" / "rlhf.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_bad_override_is_named():
    out = _cli("step3.iteratoins=3")
    assert out.returncode == 2 and "step3.iteratoins: unknown key" in out.stderr


def test_resume_is_for_step3_alone():
    out = _cli("--resume")
    assert out.returncode == 2 and "--step step3 alone" in out.stderr
    with pytest.raises(ValueError, match="steps 1 and 2 would change"):
        rlhf.run(RLHFConfig(), ("sft", "step3"), resume=True)


def test_step3_still_answers_to_its_older_name_ppo():
    """A ``ppo:`` section or ``ppo.KEY`` override (beside a recipe's ``step3:``) and
    ``steps: [ppo]`` are read as step3; the same key under both names is refused."""
    cfg = load_config(RLHFConfig, recipe_path("rlhf-sort"),
                      ["ppo.kl_coef=0.1", "ppo.lora.rank=4", "steps=[ppo]"])
    assert (cfg.step3.kl_coef, cfg.step3.lora.rank, cfg.step3.iterations) == (0.1, 4, 200)
    assert cfg.steps == ["step3"]
    with pytest.raises(ConfigError, match="ppo.kl_coef and step3.kl_coef both given"):
        load_config(RLHFConfig, recipe_path("rlhf-sort"), ["ppo.kl_coef=0.1",
                                                                   "step3.kl_coef=0.2"])
    out = _cli("--step", "ppo", "--resume", "step3.iterationz=1")  # --step ppo is accepted
    assert out.returncode == 2 and "step3.iterationz: unknown key" in out.stderr


def test_overrides_may_come_before_and_after_options():
    out = _cli("algorithm=dpo", "--step", "step3", "dpo.stepz=3")
    assert out.returncode == 2 and "dpo.stepz: unknown key" in out.stderr


def test_data_too_small_for_a_batch_is_one_line_before_ray_starts(tmp_path):
    """A file with fewer training rows than sft.batch_size (batches are drawn without
    repeats) is refused naming the setting and the file, exit 2, before Ray starts; a bad row
    likewise names its line."""
    import json

    rows = "".join(json.dumps({"prompt": "sort 21:", "chosen": " 12", "rejected": " 21"}) + "\n"
                   for _ in range(10))
    (tmp_path / "small.jsonl").write_text(rows)
    out = _cli(f"data.path={tmp_path / 'small.jsonl'}")
    assert out.returncode == 2 and "sft.batch_size=32" in out.stderr and "small.jsonl" in out.stderr
    assert "Started a local Ray" not in out.stderr
    (tmp_path / "bad.jsonl").write_text(rows + '{"prompt": 3}\n')
    out = _cli(f"data.path={tmp_path / 'bad.jsonl'}")
    assert out.returncode == 2 and "bad.jsonl:11: field prompt" in out.stderr
