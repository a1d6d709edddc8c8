"""troupe's GRPO against TRL's GRPOTrainer, side by side in one run: the same model
(SmolLM2-135M-Instruct), prompts (the sorting task as a chat turn), reward function (the task's
gold), group size, max new tokens, KL coefficient (k3 in the loss), learning rate, fp32 and
thread count.

    pip install trl==1.16.0      # not a troupe dependency: this benchmark only
    python benchmarks/grpo_vs_trl.py [--steps 8] [--prompts 2] [--group 4] [--new-tokens 16]

Each side runs in its own process tree, one after the other, its memory sampled every 0.5 s
(benchmarks/process_memory.py: the sum of PSS over the driver, Ray's processes and every
worker). Prints one JSON line per side and run, and one with the ratios: median seconds per
iteration (the first one, a warm-up, left out), generated tokens per second of generation, and
the peak memory of the whole process tree. With --repeats N the sides run alternately N times
each and the ratios are of each side's fastest run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from process_memory import measure  # noqa: E402
from machine import machine  # benchmarks/machine.py, beside this script


def troupe_side(a, tmp: Path) -> dict:
    out = tmp / "troupe"
    cmd = [sys.executable, str(ROOT / "apps" / "rlhf.py"), "--config",
           str(ROOT / "apps" / "configs" / "grpo-smollm2.yaml"), f"model.pretrained={a.model}",
           f"step3.iterations={a.steps}", f"step3.prompts_per_iter={a.prompts}",
           f"step3.samples_per_prompt={a.group}", f"step3.max_new_tokens={a.new_tokens}",
           f"step3.kl_coef={a.beta}", f"step3.threads={a.threads}", "step3.checkpoint_every=0",
           f"step3.eval_every={a.steps}", "task.eval_examples=8", f"out_dir={out}"]
    mem = measure(cmd)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step3"][1:]
    tokens = [r["response_length"] * a.prompts * a.group for r in steps]
    return {"side": "troupe", "cmd": " ".join(cmd[1:]), "exit": mem["exit"],
            "s_per_iteration": statistics.median(r["generate_s"] + r["score_s"] + r["train_s"]
                                                 for r in steps),
            "generate_s": statistics.median(r["generate_s"] for r in steps),
            "score_s": statistics.median(r["score_s"] for r in steps),
            "train_s": statistics.median(r["train_s"] for r in steps),
            "generated_tokens_per_s": sum(tokens) / sum(r["generate_s"] for r in steps),
            "mean_reward": [round(r["reward"], 3) for r in steps],
            "peak_pss_gb": mem["peak_pss_gb"], "at_peak_pss_gb": mem["at_peak_pss_gb"]}


def trl_side(a, tmp: Path) -> dict:
    timings = tmp / "trl.jsonl"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trl_grpo.py"), "--model", a.model,
           "--steps", str(a.steps), "--batch", str(a.prompts * a.group),
           "--generations", str(a.group), "--new-tokens", str(a.new_tokens),
           "--beta", str(a.beta), "--threads", str(a.threads), "--timings", str(timings)]
    mem = measure(cmd)
    steps = [json.loads(line) for line in timings.read_text().splitlines()][1:]
    return {"side": "trl", "cmd": " ".join(cmd[1:]), "exit": mem["exit"],
            "s_per_iteration": statistics.median(r["step_s"] for r in steps),
            "generate_s": statistics.median(r["generate_s"] for r in steps),
            "generated_tokens_per_s": sum(r["mean_length"] * r["completions"] for r in steps)
            / sum(r["generate_s"] for r in steps),
            "peak_pss_gb": mem["peak_pss_gb"], "at_peak_pss_gb": mem["at_peak_pss_gb"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(Path("~/.cache/troupe/smollm2-135m-instruct")
                                          .expanduser()))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the two sides alternately this many times each; the ratio line "
                        "compares each side's fastest run (a VM whose speed moves from minute "
                        "to minute otherwise decides the ratio by which side ran when)")
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    base = {"bench": "grpo_vs_trl", "machine": machine(), "prompts": a.prompts,
            "group": a.group, "new_tokens": a.new_tokens, "threads": a.threads,
            "steps": a.steps, "dtype": "float32"}
    runs: dict[str, list[dict]] = {"troupe": [], "trl": []}
    for r in range(a.repeats):
        for side, run in (("troupe", troupe_side), ("trl", trl_side)):
            if side == "trl" and a.skip_trl:
                continue
            with tempfile.TemporaryDirectory(prefix="grpo-vs-trl-") as tmp:
                runs[side].append(run(a, Path(tmp)))
            print(json.dumps({**base, **runs[side][-1], "repeat": r}), flush=True)
    if a.skip_trl:
        return
    ours, theirs = (min(runs[side], key=lambda x: x["s_per_iteration"])
                    for side in ("troupe", "trl"))
    print(json.dumps({**base, "side": "ratio", "repeats": a.repeats,
                      "s_per_iteration_each": {side: [round(x["s_per_iteration"], 2)
                                                      for x in runs[side]] for side in runs},
                      "speedup_per_iteration": round(theirs["s_per_iteration"]
                                                     / ours["s_per_iteration"], 2),
                      "generation_speedup": round(ours["generated_tokens_per_s"]
                                                  / theirs["generated_tokens_per_s"], 2),
                      "memory_ratio": round(ours["peak_pss_gb"] / theirs["peak_pss_gb"], 2)}),
          flush=True)


if __name__ == "__main__":
    main()
