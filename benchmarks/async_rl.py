"""Synchronous GRPO against one-step-off and max_staleness=2 rollouts on SmolLM2-135M-Instruct,
in one run: the same prompts per iteration, group, new tokens, iterations and seed
(apps/configs/grpo-smollm2.yaml, the sorting task with its gold reward function).

    python benchmarks/async_rl.py [--steps 16] [--prompts 2] [--group 4] [--new-tokens 16]
                                  [--seeds 3] [--cores 2] [--runs NAME ...] [KEY=VALUE ...]

Runs, each `python apps/rlhf.py` in its own process tree, one after the other, for a machine
of C cores (--cores, default 2; names below for C = 2):
- sync-2t (seeds 0..S-1): today's order, the policy's worker generating, C threads;
- sync-1t: the same at C/2 threads (each phase's time when it has half the cores);
- packed: sync-2t with model.packing (the padding share before and after packing);
- one-step-off: a rollout replica of C/2 threads beside the policy of C/2, max_staleness 1;
- staleness-2: the same, max_staleness 2.

Prints one JSON line per run (samples per second over the iterations after the first two,
while the pipeline fills; each phase's median seconds; held-out gold at the end; weight-sync
seconds and bytes per version; padding shares; with zero_stage=3, the MB of weights the
policy held whole at once while syncing and while training, and its plan's bound) and one
summary line: each run's samples per
second against sync-2t's, the bound one-step-off has on this machine (max of the 1-thread
generation, after an overlapped sync's transfer, and the 1-thread score + train, plus what
the driver waits for the sync: the two sides each get half the cores), one-step-off's share
of it, and whether each run's gold lies within the synchronous seeds' spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import machine  # noqa: E402  benchmarks/machine.py, beside this script

def runs(cores: int) -> dict[str, list[str]]:
    """Each run's name and its overrides on a machine of ``cores`` cores."""
    half = max(1, cores // 2)
    off = [f"step3.threads={half}", "step3.rollout.replicas=1", f"step3.rollout.threads={half}"]
    return {f"sync-{cores}t": [f"step3.threads={cores}"],
            f"sync-{half}t": [f"step3.threads={half}"],
            "packed": [f"step3.threads={cores}", "model.packing=true"],
            "one-step-off": [*off, "step3.rollout.max_staleness=1"],
            "staleness-2": [*off, "step3.rollout.max_staleness=2"]}


def run(a, name: str, extra: list[str], seed: int, tmp: Path) -> dict:
    out = tmp / f"{name}-{seed}"
    cmd = [sys.executable, str(ROOT / "apps" / "rlhf.py"), "--config",
           str(ROOT / "apps" / "configs" / "grpo-smollm2.yaml"), f"model.pretrained={a.model}",
           f"step3.iterations={a.steps}", f"step3.prompts_per_iter={a.prompts}",
           f"step3.samples_per_prompt={a.group}", f"step3.max_new_tokens={a.new_tokens}",
           "step3.checkpoint_every=0", f"step3.eval_every={a.steps}",
           f"task.eval_examples={a.eval_examples}", f"seed={seed}", f"out_dir={out}",
           f"device={a.device}", *extra, *a.overrides]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} (seed {seed}) failed:\n{done.stderr[-4000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step3"]
    steady = steps[2:]  # the pipeline fills in the first two
    samples = a.prompts * a.group
    med = lambda k: statistics.median(r[k] for r in steady) if k in steady[0] else None
    syncs = [r for r in steps if "sync_s" in r]
    transfers = [r for r in steps if "sync_transfer_s" in r]  # overlapped syncs (overlap_sync)
    return {"run": name, "seed": seed, "cmd": " ".join(cmd[1:]),
            "samples_per_s": samples * len(steady) / sum(r["iteration_s"] for r in steady),
            "iteration_s": med("iteration_s"), "generate_s": med("generate_s"),
            "score_s": med("score_s"), "train_s": med("train_s"),
            "rollout_s": med("rollout_s"),
            "sync_s": statistics.median(r["sync_s"] for r in syncs) if syncs else None,
            "sync_transfer_s": statistics.median(r["sync_transfer_s"] for r in transfers)
            if transfers else None,
            "sync_mb": syncs[0]["sync_bytes"] / 2**20 if syncs else None,
            "staleness_mean": med("staleness_mean"),
            "padding": med("padding"), "padding_computed": med("padding_computed"),
            "computed_share": med("computed_share"),
            "logprob_mismatch_mean": med("logprob_mismatch_mean"),
            "tis_truncated": med("tis_truncated"),
            "reward": [round(r["reward"], 3) for r in steps],
            **_gathered(syncs),
            "gold": [r for r in recs if r["kind"] == "step3_eval"][-1].get("gold")}


def _gathered(syncs: list[dict]) -> dict:
    """A zero_stage=3 policy's full buffers at their most (MB): while it synced (streamed
    unit by unit), while it trained since the sync before (the first sync's left out: it
    follows the load of the starting weights), and the bound its memory plan allows a
    training step; the whole model, what a sync gathered before streaming, is sync_mb."""
    later = [r for r in syncs[1:] if "sync_gathered_peak_bytes" in r]
    if not later:
        return {}
    most = lambda key: round(max(r[key] for r in later) / 2**20, 1)
    return {"sync_gathered_mb": most("sync_gathered_peak_bytes"),
            "train_gathered_mb": most("train_gathered_peak_bytes"),
            "planned_gathered_mb": most("planned_gathered_bytes")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(Path("~/.cache/troupe/smollm2-135m-instruct")
                                          .expanduser()))
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--eval-examples", type=int, default=32)
    p.add_argument("--seeds", type=int, default=3, help="synchronous runs, for the gold spread")
    p.add_argument("--cores", type=int, default=2, help="threads of the synchronous run")
    p.add_argument("--runs", nargs="+", default=None, help="a subset of the runs (by name)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. num_gpus=0.5")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-async_rl.jsonl"))
    a = p.parse_args()
    head = {"bench": "async_rl", "machine": machine(), "device": a.device, "cores": a.cores,
            "overrides": a.overrides, "steps": a.steps, "prompts": a.prompts, "group": a.group,
            "new_tokens": a.new_tokens}
    plan = runs(a.cores)
    sync, half = list(plan)[:2]
    unknown = set(a.runs or ()) - set(plan)
    if unknown:
        p.error(f"--runs: no run named {sorted(unknown)}; the runs are {list(plan)}")
    plan = {n: o for n, o in plan.items() if a.runs is None or n in a.runs}
    results = {}
    with tempfile.TemporaryDirectory(prefix="async-rl-") as tmp, open(a.out, "a") as f:
        for name, extra in plan.items():
            for seed in range(a.seeds if name == sync else 1):
                r = run(a, name, extra, seed, Path(tmp))
                results.setdefault(name, []).append(r)
                line = json.dumps({**head, **r})
                print(line, flush=True)
                f.write(line + "\n")
                f.flush()  # a run cut short keeps the lines before it
        if sync not in results:
            return  # no synchronous run to compare with
        base = results[sync][0]
        samples = a.prompts * a.group
        golds = [r["gold"] for r in results[sync]]
        lo, hi = min(golds), max(golds)
        summary = {**head, "run": "summary",
                   "speedup_vs_sync": {n: round(rs[0]["samples_per_s"] / base["samples_per_s"], 3)
                                       for n, rs in results.items()},
                   "sync_gold_spread": [lo, hi],
                   "gold_within_spread": {n: lo <= rs[0]["gold"] <= hi
                                          for n, rs in results.items() if n != sync}}
        if half in results and "one-step-off" in results:
            one, off = results[half][0], results["one-step-off"][0]
            # the replica receives (an overlapped transfer) then generates, while the policy
            # scores and trains; the driver waits for the sync's start (or all of an inline one)
            period = max(one["generate_s"] + (off["sync_transfer_s"] or 0),
                         one["score_s"] + one["train_s"]) + (off["sync_s"] or 0)
            summary["one_step_off_bound_samples_per_s"] = round(samples / period, 3)
            summary["one_step_off_share_of_bound"] = round(off["samples_per_s"] * period / samples,
                                                           3)
        if "packed" in results:
            summary["padding_before_after_packing"] = [results["packed"][0]["padding"],
                                                       results["packed"][0]["padding_computed"]]
            summary["computed_share_sync_packed"] = [base["computed_share"],
                                                     results["packed"][0]["computed_share"]]
        print(json.dumps(summary), flush=True)
        f.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
