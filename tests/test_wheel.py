"""troupe installed from its wheel into a fresh virtual environment, used from a directory
outside the checkout: the `troupe` command is there and the bundled recipes come with it."""

import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.waits  # pip building a wheel

ROOT = Path(__file__).resolve().parents[1]


def _run(args, cwd, timeout=1200):
    # a PYTHONPATH naming a checkout (its troupe.egg-info) would make pip take troupe as
    # installed already and skip the wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{args} exited {out.returncode}:\n{out.stdout[-3000:]}" \
                                f"\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.slow
def test_the_wheel_brings_the_command_and_its_recipes(tmp_path):
    """The wheel's contents and metadata: the dependencies themselves are installed into a
    fresh environment by the README's first command (tests/test_readme.py), so the
    environment here sees the suite's and troupe alone comes from the wheel."""
    dist, elsewhere = tmp_path / "dist", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
          str(dist), str(ROOT)], cwd=tmp_path)
    wheel = next(dist.glob("troupe-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    required = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert sorted(map(_canonical, required)) == sorted(map(_canonical, declared))
    assert "troupe = troupe.cli:main" in entry_points
    assert {"troupe/recipes/rlhf-sort.yaml", "troupe/kernels/csrc/small_gemm.cpp"} <= set(names)
    _run([sys.executable, "-m", "venv", str(tmp_path / "venv")], cwd=tmp_path)
    py = str(tmp_path / "venv" / "bin" / "python")
    # the suite's packages after the environment's own (a path file's directory is read for
    # modules only, not for path files: the checkout's editable troupe stays out of sight)
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=tmp_path).strip()
    (Path(site) / "suite.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], cwd=tmp_path)
    troupe = str(tmp_path / "venv" / "bin" / "troupe")
    printed = _run([troupe, "rlhf", "--config", "rlhf-sort", "--print-config"], cwd=elsewhere)
    assert "algorithm: ppo" in printed and "out_dir: runs/rlhf" in printed
    assert "usage: troupe serve" in _run([troupe, "serve", "--help"], cwd=elsewhere)
    listed = _run([py, "-m", "troupe", "recipes"], cwd=elsewhere)
    assert f"{tmp_path}/venv/lib/" in listed and "site-packages/troupe/recipes/rlhf-sort.yaml" \
        in listed, listed
    assert str(ROOT) not in listed  # nothing read from the checkout


def _canonical(requirement: str) -> str:
    """A requirement as written in pyproject and as the metadata writes it, alike."""
    return re.sub(r"\s+", "", requirement).lower()
