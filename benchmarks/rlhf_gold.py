"""The RLHF claim: on the bundled task, step 3 (PPO, GRPO, RLOO, REINFORCE++, DAPO, GSPO against
the learned reward model; DPO on the preference pairs) raises the gold reward (a program the reward model
never sees) above the SFT policy's, with the KL to the reference bounded; over several seeds.

    python benchmarks/rlhf_gold.py [--seeds 0 1 2] [--algorithms ppo grpo rloo reinforce_pp dpo]

Runs `python apps/rlhf.py` (all three steps, the embedded local Ray) once per algorithm and
seed and prints one JSON line each, then one per algorithm with the mean margin: held-out
reward-model accuracy, gold reward and exact-answer rate of the SFT policy and of the step-3
policy on held-out prompts (sampling at the recipe's temperature), the final KL (per sequence;
for GRPO the loss term's per-token estimate), the mean seconds of an iteration's generation, scoring (reference, reward, critic) and
training, and the wall time of the whole run. GRPO and
RLOO sample 4 responses for each of 8 prompts per iteration (PPO: 1 for each of 32). dpo is the
recipe's (RPO: DPO plus the chosen responses' NLL); dpo_plain is DPO alone at a lower rate.
DAPO and GSPO sample as GRPO, without a KL term; dapo_binary is DAPO with the 0/1 reward
function apps.rewards:sorted_exactly instead of the reward model (a reward whose groups are
often all equal, which DAPO's dynamic sampling drops: its records add the groups kept and the
sampling rounds per iteration).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from machine import machine  # benchmarks/machine.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ["step3.prompts_per_iter=8"]  # 4 samples of 8 prompts: PPO's 32 sequences
EXTRA = {"ppo": [], "grpo": GROUPS, "rloo": GROUPS, "reinforce_pp": [], "dpo": [],
         "dpo_plain": ["dpo.sft_coef=0", "dpo.optimizer.lr=2e-5", "dpo.optimizer.min_lr=2e-6"],
         "dapo": GROUPS, "gspo": GROUPS,
         "dapo_binary": [*GROUPS, "reward.function=apps.rewards:sorted_exactly"]}
ALGORITHM = {"dpo_plain": "dpo", "dapo_binary": "dapo"}  # the variants' algorithm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--algorithms", nargs="+", default=["ppo"], choices=list(EXTRA))
    p.add_argument("--config", default=str(ROOT / "apps" / "configs" / "rlhf-sort.yaml"))
    p.add_argument("--tag", default="", help="appended to the run directories' names")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    for alg in a.algorithms:
        margins = []
        for seed in a.seeds:
            out = ROOT / "runs" / f"rlhf-{alg}-seed{seed}{a.tag}"
            t0 = time.perf_counter()
            subprocess.run([sys.executable, str(ROOT / "apps" / "rlhf.py"), "--config", a.config,
                            f"algorithm={ALGORITHM.get(alg, alg)}", f"seed={seed}",
                            f"out_dir={out}", *EXTRA[alg],
                            *a.overrides], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            s = json.loads((out / "summary.json").read_text())
            recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            kl = [r.get("kl", r.get("kl_loss")) for r in recs if r["kind"] == "step3"]
            kl = [k for k in kl if k is not None] or [float("nan")]
            steps = [r for r in recs if r["kind"] == "step3" and "score_s" in r]
            timing = {f"{k}_mean": round(sum(r[k] for r in steps) / max(len(steps), 1), 4)
                      for k in ("generate_s", "score_s", "train_s", "groups_kept",
                                "sample_rounds") if all(k in r for r in steps)}
            before, after = s["step3"]["before"], s["step3"]["after"]
            margins.append(after["gold"] - before["gold"])
            print(json.dumps({"bench": "rlhf_gold", "machine": machine(), "algorithm": alg,
                              "seed": seed,
                              "reward_model_accuracy": round(s.get("reward_accuracy", -1), 4),
                              "sft_gold": round(before["gold"], 4),
                              "final_gold": round(after["gold"], 4),
                              "sft_exact": round(before["exact"], 4),
                              "final_exact": round(after["exact"], 4),
                              "gold_margin": round(margins[-1], 4),
                              "kl_last10_mean": round(sum(kl[-10:]) / len(kl[-10:]), 4),
                              "kl_max": round(max(kl), 4), **timing,
                              "overrides": a.overrides, "wall_s": round(wall, 1)}), flush=True)
        print(json.dumps({"bench": "rlhf_gold", "algorithm": alg, "seeds": a.seeds,
                          "mean_gold_margin": round(sum(margins) / len(margins), 4),
                          "min_gold_margin": round(min(margins), 4)}), flush=True)


if __name__ == "__main__":
    main()
