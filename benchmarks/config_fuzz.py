"""Drawn recipes run to the end: a recipe that validates runs.

    python benchmarks/config_fuzz.py --examples 16 [--seed 0] [--apps rlhf,pretrain] [--share 0.25]

Each example is an app's bundled recipe with overrides drawn from tests/apps/recipe_space.py
(the space the suite's fuzzer checks without Ray), shrunk to tiny sizes (a few steps, one
iteration), and run as a user runs it: ``python apps/APP.py ...`` in a process of its own,
with an embedded Ray. An example is "refused" when the app exits 2 with one line on stderr
before Ray starts, "ran" when it exits 0, and "failed" otherwise (another exit code, or a
refusal after Ray started, or more than one line): failed must be 0. One JSON line per example
and a closing line with the counts and the time.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.apps.recipe_space import RECIPES, draw  # noqa: E402

TINY = {"rlhf": ["sft.steps=2", "reward.steps=2", "step3.iterations=1", "dpo.steps=2",
                 "step3.eval_every=1", "task.sft_examples=200", "task.preference_examples=200",
                 "task.eval_examples=8", "step3.checkpoint_every=0", "threads=1",
                 "step3.threads=1"],
        "pretrain": ["train.steps=2", "train.eval_every=0", "train.eval_batches=1",
                     "data.max_chars=200000"]}


def run_one(app: str, overrides: list[str], out: Path, timeout_s: float) -> dict:
    recipe, _ = RECIPES[app]
    argv = [sys.executable, str(ROOT / "apps" / f"{app}.py"), "--config", recipe,
            *TINY[app], *overrides, f"out_dir={out}"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        code, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired:
        code, err = "timeout", ""
    # what a person reads: not the log lines (dated) nor the progress bars
    lines = [ln for ln in err.splitlines() if ln.strip() and not re.match(r"\d{4}-\d\d-\d\d ", ln)
             and "it/s]" not in ln and "s/it]" not in ln and "\r" not in ln]
    ray_started = "Started a local Ray" in err
    if code == 0:
        outcome = "ran"
    elif code == 2 and not ray_started and len(lines) == 1:
        outcome = "refused"
    elif code == 2 and lines and lines[-1].startswith("error: ") and ray_started:
        outcome = "failed"  # valid by the plan, and still ended by an error at run time
    else:
        outcome = "failed"
    return {"app": app, "overrides": overrides, "outcome": outcome, "exit": code,
            "message": lines[-1] if lines else "", "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--apps", default="rlhf,pretrain")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--share", type=float, default=0.25,
                   help="the chance that each key of the space is overridden")
    args = p.parse_args()
    rng = random.Random(args.seed)
    apps = args.apps.split(",")
    counts = {"refused": 0, "ran": 0, "failed": 0}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.examples):
            app = apps[i % len(apps)]
            rec = run_one(app, draw(RECIPES[app][1], rng, args.share), Path(tmp) / f"run-{i}", args.timeout)
            counts[rec["outcome"]] += 1
            print(json.dumps(rec), flush=True)
    print(json.dumps({"examples": args.examples, "seed": args.seed, "share": args.share, **counts,
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
