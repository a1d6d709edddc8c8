"""1-bit optimizers against their full-precision baselines: the same model, data and steps on
4 data-parallel ranks, in one run.

    python benchmarks/optimizers.py [--steps 400] [--workers 4]

For each optimizer: the final validation loss, the bytes its gradient/momentum communication
handed to collectives (counted by the optimizer per algorithm) and the bytes the trainer
processes' TCP sockets sent as the kernel counts them (`ss -ti`, so Ray's own traffic is in
it too), and per-trainer optimizer-state memory. Then the ZeRO-1 memory of Adam for 1, 2 and 4
ranks. One JSON line per optimizer; the ratios compare with Adam (1-bit and 0/1 Adam) and
LAMB (1-bit LAMB) from the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from allreduce import tcp_bytes_sent  # benchmarks/ is the script's directory

import troupe
from troupe.pretrain import PretrainRank
from troupe.pretrain.config import PretrainConfig
from troupe.pretrain.driver import build_graph


def config(args, optimizer: dict, workers: int) -> PretrainConfig:
    lr = args.lamb_lr if "lamb" in optimizer["name"] else args.lr
    return PretrainConfig(
        model=dict(seq_len=128, n_layer=4, n_head=4, d_model=128),
        optimizer=dict(lr=lr, min_lr=lr / 10, warmup_steps=args.steps // 10, **optimizer),
        data=dict(seed=1),
        train=dict(steps=args.steps, batch_size=args.batch, num_workers=workers,
                   eval_batches=8, out_dir="runs/bench-optimizers", seed=0))


def train(args, name: str, optimizer: dict) -> dict:
    cfg = config(args, optimizer, args.workers)
    built = build_graph(cfg, name=f"bench-{name}")
    try:
        trainer, pids = built.graph["trainer"], [i.pid for i in built.trainers]
        b0, t0 = tcp_bytes_sent(*pids), time.perf_counter()
        for step in range(1, args.steps + 1):
            metrics = trainer.invoke(PretrainRank.train_step, step)
        seconds, tcp = time.perf_counter() - t0, tcp_bytes_sent(*pids) - b0
        val = sum(trainer.invoke(PretrainRank.evaluate)) / args.workers
        return {"optimizer": name, "val_loss": round(val, 4),
                "train_loss": round(sum(m.loss for m in metrics) / len(metrics), 4),
                "bytes_sent_per_rank": metrics[0].bytes_sent,
                "tcp_bytes_sent_per_rank": tcp // args.workers,
                "optimizer_state_bytes": built.trainers[0].optimizer_bytes,
                "seconds": round(seconds, 1), "lr": cfg.optimizer.lr, **optimizer}
    finally:
        built.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam family")
    p.add_argument("--lamb-lr", type=float, default=3e-2, help="LAMB family (trust ratio scaled)")
    p.add_argument("--only", nargs="*", default=None)
    args = p.parse_args()
    troupe.init(num_cpus=max(args.workers, 4))
    S = args.steps
    runs = {
        "adam": dict(name="adam"),
        "onebit_adam": dict(name="onebit_adam", freeze_step=int(0.15 * S)),
        "zero_one_adam": dict(name="zero_one_adam", var_freeze_step=S // 2, var_update_scaler=4,
                              local_step_scaler=S // 8, local_step_clipper=8),
        "lamb": dict(name="lamb"),
        "onebit_lamb": dict(name="onebit_lamb", freeze_step=int(0.15 * S)),
    }
    baseline_of = {"onebit_adam": "adam", "zero_one_adam": "adam", "onebit_lamb": "lamb"}
    results = {}
    for name, opt in runs.items():
        if args.only and name not in args.only:
            continue
        r = results[name] = train(args, name, opt)
        base = results.get(baseline_of.get(name, ""))
        if base:
            r["baseline"] = base["optimizer"]
            r["val_loss_vs_baseline"] = round(r["val_loss"] / base["val_loss"] - 1, 4)
            r["bytes_reduction"] = round(base["bytes_sent_per_rank"] / r["bytes_sent_per_rank"], 2)
            r["tcp_bytes_reduction"] = round(base["tcp_bytes_sent_per_rank"]
                                             / r["tcp_bytes_sent_per_rank"], 2)
        print(json.dumps({"bench": "optimizers", "machine": platform.node(),
                          "workers": args.workers, "steps": S, **r}), flush=True)
    for workers in (1, 2, 4):  # ZeRO-1: per-trainer optimizer memory
        built = build_graph(config(args, dict(name="adam"), workers), name=f"mem{workers}")
        info = built.trainers
        built.shutdown()
        print(json.dumps({"bench": "optimizer_memory", "optimizer": "adam (ZeRO-1)",
                          "workers": workers, "param_bytes": info[0].param_bytes,
                          "optimizer_bytes_per_rank": [i.optimizer_bytes for i in info]}),
              flush=True)


if __name__ == "__main__":
    main()
