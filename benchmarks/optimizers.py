"""1-bit optimizers against their full-precision baselines: the same model, data and steps on
4 data-parallel ranks, in one run; then optimizer-state memory per rank for 1, 2 and 4 ranks.

    python benchmarks/optimizers.py [--steps 400] [--workers 4] [--seed 0 --data-seed 1]
                                    [--only NAME ...] [--no-memory]

For each optimizer: the final validation loss, the bytes its gradient/momentum/parameter
communication handed to collectives (counted by the optimizer per algorithm), in all and per
step after its freeze, the bytes the trainer processes' TCP sockets sent as the kernel counts
them (`ss -ti`, so Ray's own traffic is in it too), and per-trainer optimizer-state bytes at
the end. The ``*_sharded`` runs keep the 1-bit state sharded (optimizer.shard_state);
``zero_one_adam_unclipped`` is 0/1 Adam without its update clipping (DeepSpeed's). One JSON
line per optimizer; the ratios compare with Adam (1-bit and 0/1 Adam), LAMB (1-bit LAMB) and
the unsharded 1-bit run (sharded ones) from the same run. The memory lines train each
optimizer 4 steps past its freeze (the state's shape changes there) on 1, 2 and 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import time

from allreduce import tcp_bytes_sent  # benchmarks/ is the script's directory

import troupe
from troupe.pretrain import TrainerActor
from troupe.pretrain.config import PretrainConfig
from troupe.pretrain.driver import build_graph
from machine import machine  # benchmarks/machine.py, beside this script


def config(args, optimizer: dict, workers: int) -> PretrainConfig:
    lr = args.lamb_lr if "lamb" in optimizer["name"] else args.lr
    return PretrainConfig(
        model=dict(seq_len=128, n_layer=4, n_head=4, d_model=128),
        optimizer=dict(lr=lr, min_lr=lr / 10, warmup_steps=args.steps // 10, **optimizer),
        data=dict(seed=args.data_seed),
        train=dict(steps=args.steps, batch_size=args.batch, eval_batches=8),
        workers=workers, out_dir="runs/bench-optimizers", seed=args.seed)


def train(args, name: str, optimizer: dict) -> dict:
    cfg = config(args, optimizer, args.workers)
    built = build_graph(cfg, name=f"bench-{name}")
    try:
        trainer, pids = built.graph["trainer"], [i.pid for i in built.trainers]
        b0, t0 = tcp_bytes_sent(*pids), time.perf_counter()
        sent = [0]
        for step in range(1, args.steps + 1):
            metrics = trainer.invoke(TrainerActor.train_step, step)
            sent.append(metrics[0].bytes_sent)
        seconds, tcp = time.perf_counter() - t0, tcp_bytes_sent(*pids) - b0
        val = sum(trainer.invoke(TrainerActor.evaluate)) / args.workers
        frozen = _freeze_step(optimizer)
        return {"optimizer": name, "val_loss": round(val, 4),
                "train_loss": round(sum(m.loss for m in metrics) / len(metrics), 4),
                "bytes_sent_per_rank": sent[-1],
                "bytes_per_step_after_freeze": (sent[-1] - sent[frozen]) // (args.steps - frozen),
                "tcp_bytes_sent_per_rank": tcp // args.workers,
                "optimizer_state_bytes": trainer.invoke(TrainerActor.memory)[0]["optimizer_bytes"],
                "seconds": round(seconds, 1), "lr": cfg.optimizer.lr, **optimizer}
    finally:
        built.shutdown()


def _freeze_step(optimizer: dict) -> int:
    return optimizer.get("freeze_step", optimizer.get("var_freeze_step", 0))


def memory(args, name: str, optimizer: dict, workers: int) -> dict:
    """Per-rank optimizer-state bytes, 4 steps past the freeze."""
    frozen = dict(optimizer, **{k: 2 for k in ("freeze_step", "var_freeze_step") if k in optimizer})
    steps = _freeze_step(frozen) + 4
    cfg = config(argparse.Namespace(**{**vars(args), "steps": steps}), frozen, workers)
    built = build_graph(cfg, name=f"mem-{name}-{workers}")
    try:
        trainer = built.graph["trainer"]
        for step in range(1, steps + 1):
            trainer.invoke(TrainerActor.train_step, step)
        held = trainer.invoke(TrainerActor.memory)
    finally:
        built.shutdown()
    return {"bench": "optimizer_memory", "optimizer": name, "workers": workers,
            "after_step": steps, "param_bytes": held[0]["param_bytes"],
            "optimizer_bytes_per_rank": [h["optimizer_bytes"] for h in held]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam family")
    p.add_argument("--lamb-lr", type=float, default=3e-2, help="LAMB family (trust ratio scaled)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation, dropout")
    p.add_argument("--data-seed", type=int, default=1, help="the documents and their order")
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--no-memory", action="store_true", help="skip the memory lines")
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
    for name in ("onebit_adam", "zero_one_adam", "onebit_lamb"):
        runs[f"{name}_sharded"] = dict(runs[name], shard_state=True)
    runs["zero_one_adam_unclipped"] = dict(runs["zero_one_adam"], update_clip=0.0)  # DeepSpeed's
    baseline_of = {"onebit_adam": "adam", "zero_one_adam": "adam", "onebit_lamb": "lamb",
                   "zero_one_adam_unclipped": "adam"}
    results = {}
    for name, opt in runs.items():
        if args.only and name not in args.only:
            continue
        r = results[name] = train(args, name, opt)
        base = results.get(baseline_of.get(name.removesuffix("_sharded"), ""))
        if base:
            r["baseline"] = base["optimizer"]
            r["val_loss_vs_baseline"] = round(r["val_loss"] / base["val_loss"] - 1, 4)
            r["bytes_reduction"] = round(base["bytes_sent_per_rank"] / r["bytes_sent_per_rank"], 2)
            r["bytes_per_step_after_freeze_vs_baseline"] = round(
                r["bytes_per_step_after_freeze"] / base["bytes_per_step_after_freeze"], 4)
            r["tcp_bytes_reduction"] = round(base["tcp_bytes_sent_per_rank"]
                                             / r["tcp_bytes_sent_per_rank"], 2)
        whole = results.get(name.removesuffix("_sharded")) if name.endswith("_sharded") else None
        if whole:
            r["val_loss_equals_unsharded"] = r["val_loss"] == whole["val_loss"]
            r["state_bytes_vs_unsharded"] = round(
                r["optimizer_state_bytes"] / whole["optimizer_state_bytes"], 4)
            r["bytes_per_step_after_freeze_vs_unsharded"] = round(
                r["bytes_per_step_after_freeze"] / whole["bytes_per_step_after_freeze"], 2)
        print(json.dumps({"bench": "optimizers", "machine": machine(),
                          "workers": args.workers, "steps": S, "seed": args.seed,
                          "data_seed": args.data_seed, **r}), flush=True)
    if args.no_memory:
        return
    for name, opt in runs.items():
        if args.only and name not in args.only:
            continue
        for workers in (1, 2, 4):
            print(json.dumps(memory(args, name, opt, workers)), flush=True)


if __name__ == "__main__":
    main()
