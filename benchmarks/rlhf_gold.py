"""The RLHF claim: on the bundled task, PPO raises the gold reward (a program the reward model
never sees) above the SFT policy's, with the KL to the reference bounded; over several seeds.

    python benchmarks/rlhf_gold.py [--seeds 0 1 2] [--config apps/configs/rlhf-sort.yaml]

Runs `python apps/rlhf.py` (all three steps, the embedded local Ray) once per seed and prints
one JSON line per seed, then one with the mean margin: held-out reward-model accuracy, gold
reward and exact-answer rate of the SFT policy and of the PPO policy on held-out prompts
(sampling at the recipe's temperature), the final KL, and the wall time of the whole run.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--config", default=str(ROOT / "apps" / "configs" / "rlhf-sort.yaml"))
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    margins = []
    for seed in a.seeds:
        out = ROOT / "runs" / f"rlhf-seed{seed}"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "apps" / "rlhf.py"), "--config", a.config,
                        f"seed={seed}", f"out_dir={out}", *a.overrides], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        s = json.loads((out / "summary.json").read_text())
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        kl = [r["kl"] for r in recs if r["kind"] == "ppo"]
        before, after = s["ppo"]["before"], s["ppo"]["after"]
        margins.append(after["gold"] - before["gold"])
        print(json.dumps({"bench": "rlhf_gold", "machine": platform.node(), "seed": seed,
                          "reward_model_accuracy": round(s["reward_accuracy"], 4),
                          "sft_gold": round(before["gold"], 4), "ppo_gold": round(after["gold"], 4),
                          "sft_exact": round(before["exact"], 4),
                          "ppo_exact": round(after["exact"], 4),
                          "gold_margin": round(margins[-1], 4),
                          "kl_last10_mean": round(sum(kl[-10:]) / len(kl[-10:]), 4),
                          "kl_max": round(max(kl), 4), "wall_s": round(wall, 1)}), flush=True)
    print(json.dumps({"bench": "rlhf_gold", "seeds": a.seeds,
                      "mean_gold_margin": round(sum(margins) / len(margins), 4),
                      "min_gold_margin": round(min(margins), 4)}), flush=True)


if __name__ == "__main__":
    main()
