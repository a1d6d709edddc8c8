"""troupe installed from its wheel into a fresh virtual environment, used from a directory
outside the checkout: the `troupe` command is there and the bundled recipes come with it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, cwd, timeout=1200):
    out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args} exited {out.returncode}:\n{out.stdout[-3000:]}" \
                                f"\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.slow
def test_the_wheel_brings_the_command_and_its_recipes(tmp_path):
    dist, elsewhere = tmp_path / "dist", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
          str(dist), str(ROOT)], cwd=tmp_path)
    wheel = next(dist.glob("troupe-*.whl"))
    _run([sys.executable, "-m", "venv", str(tmp_path / "venv")], cwd=tmp_path)
    py = str(tmp_path / "venv" / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", "torch==2.13.0"], cwd=tmp_path)
    _run([py, "-m", "pip", "install", "-q", str(wheel)], cwd=tmp_path)
    troupe = str(tmp_path / "venv" / "bin" / "troupe")
    printed = _run([troupe, "rlhf", "--config", "rlhf-sort", "--print-config"], cwd=elsewhere)
    assert "algorithm: ppo" in printed and "out_dir: runs/rlhf" in printed
    assert "usage: troupe serve" in _run([troupe, "serve", "--help"], cwd=elsewhere)
    listed = _run([py, "-m", "troupe", "recipes"], cwd=elsewhere)
    assert "site-packages/troupe/recipes/rlhf-sort.yaml" in listed, listed
    assert str(ROOT) not in listed  # nothing read from the checkout
