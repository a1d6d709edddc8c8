"""Hosts on one machine, end to end: the apps across emulated hosts (troupe.runtime.hosts),
their links shaped with tbf, and what the links cost.

    python benchmarks/hosts.py --what collectives [--rate 1gbit]
    python benchmarks/hosts.py --what optimizers [--rates 1gbit 10gbit] [--seeds 0 1]
    python benchmarks/hosts.py --what moe        [--rate 1gbit] [--seeds 0 1] [--set K=V ...]
    python benchmarks/hosts.py --what sync       [--rate 1gbit]
    python benchmarks/hosts.py --what straggler  [--rate 1gbit]
    python benchmarks/hosts.py --what loss       [--loss 0.01]
    python benchmarks/hosts.py --what head

Needs root and iproute2 (``loss`` also nftables: ``apt-get install nftables``; without it the
line says so). Every run is one of the apps started in host 0 (``troupe hosts exec 0``), its
numbers read back from its metrics.jsonl; the hosts are removed at the end, whatever happened.
Run it alone: the hosts share this machine's cores, and their links are the kernel's work.

collectives: one gloo process a host (no Ray), a 51 MB buffer (WIDE's gradient): the
  operations ZeRO-1 could be made of (gloo's alltoall, the same exchange in W-1 rounds of
  shifted pairs, gloo's reduce_scatter, troupe's reduce_scatter, a ring, gloo's allgather
  and allreduce), seconds (slowest rank, best of 3) and the share of the link's rate.
optimizers: pretraining on ``WIDE`` (below: 512 wide, 4 blocks, 64-token windows, one
  window a rank a step: a gradient of 51 MB against 4.9 GFLOP of compute per rank, the regime
  where the link decides) on 4 hosts, one rank each, with Adam, 1-bit Adam, 0/1 Adam and
  1-bit LAMB, and Adam over zero_stage 2 (the reduce-scatter beside the backward); each
  line: samples/s over the steps after the optimizer's warm-up and over the run, the
  validation loss at the last step, and the bound the same run implies: batch / (the
  slowest rank's seconds outside collectives, its compute alone: forward, backward and the
  optimizer's own arithmetic, + the step's bytes per rank over the link's rate), and the
  share of it reached (how close the collectives come to the link's rate). 1-bit Adam's and
  0/1 Adam's lines carry their speed-up over Adam's and the difference in validation loss,
  seed by seed.
moe: moe-tiny with its 8 experts over 4 hosts (ep_size 4), the token exchange in fp32, int8
  and int9 (model.moe.dispatch): all-to-all bytes and rows per step (the rows follow the gate,
  which each run trains its own way) and validation loss. A control beside them: fp32 with
  the experts over 2 ranks (ep_size 2: the same model and data, the gradients summed in
  another order), how far rounding alone moves a run's loss once its gate routes its way.
  Then a line per run over the seeds: the mean and spread of its loss against fp32's.
  ``--set`` changes moe-tiny in every run (``--set model.moe.top_k=2 model.moe.dropless=true``:
  its gate as top-2 without capacity).
sync: GRPO (the sorting task's model widened to 7.2M parameters) with one rollout replica on
  a host of its own; each weight sync's seconds and bytes (fp32, and bf16 replicas), against
  bytes over the link's rate.
straggler: pretraining with one host's link at a tenth of the others': the run's own
  ``links`` record (troupe.collectives.straggler.probe_links) names it.
loss: pretraining and GRPO with every link dropping ``--loss`` of its packets: both complete,
  and what it cost against the same runs without loss.
head: host 0 (the head: GCS, and here the driver's node) killed mid-pretraining while the
  driver runs in host 1: the driver's last line, and the run resumed from its last checkpoint
  on a new cluster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine  # benchmarks/machine.py, beside this script

from troupe.collectives.autograd import row_bytes
from troupe.runtime.hosts import Hosts, HostsError, check_tools

ROOT = Path(__file__).resolve().parent.parent
NAME = "trb"
# A recipe whose gradient is large next to its compute: dense-tiny made wide and fed one
# 64-token window a rank a step (no curriculum or random-LTD: every step the same work)
WIDE = ["--config", "dense-tiny", "model.d_model=512", "model.n_layer=4", "model.n_head=8",
        "model.seq_len=64", "curriculum.enabled=false", "random_ltd.enabled=false",
        "train.batch_size=4", "train.eval_every=0", "train.checkpoint_every=0",
        "train.eval_batches=16", "optimizer.warmup_steps=10"]
WARMUP = 10  # the 1-bit optimizers' full-precision steps (freeze_step, var_freeze_step), and
# the learning rate's warmup: the variance freezes once the rate is up, as DeepSpeed advises
OPTIMIZERS = {
    "adam": ["optimizer.name=adam"],
    # Adam over zero_stage 2: ZeRO-1's bytes, the reduce-scatter beside the backward
    "adam_zero2": ["optimizer.name=adam", "zero_stage=2"],
    "onebit_adam": ["optimizer.name=onebit_adam", f"optimizer.freeze_step={WARMUP}"],
    "zero_one_adam": ["optimizer.name=zero_one_adam", f"optimizer.var_freeze_step={WARMUP}",
                      "optimizer.var_update_scaler=4", "optimizer.local_step_scaler=8",
                      "optimizer.local_step_clipper=4"],
    "onebit_lamb": ["optimizer.name=onebit_lamb", f"optimizer.freeze_step={WARMUP}",
                    "optimizer.lr=2e-2", "optimizer.min_lr=2e-3"],
}


def rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale / 8
    raise ValueError(f"rate {rate!r}")


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_app(hosts: Hosts, argv: list[str], host: int = 0, timeout_s: float = 900
            ) -> subprocess.CompletedProcess:
    p = hosts.run(host, [sys.executable, *argv], timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)[:120]} failed: {p.stderr[-1500:]}")
    return p


def emit(line: dict) -> None:
    print(json.dumps({"bench": "hosts", "machine": machine(), **line}), flush=True)


# ---- collectives ------------------------------------------------------------------------------
COLLECTIVE_NUMEL = 12_800_000  # WIDE's parameters: a 51 MB fp32 gradient


def collective_rank(rank: int, world: int, host: str, port: int) -> None:
    """One rank of ``collectives`` (run in its host): a line per operation."""
    import torch
    import torch.distributed as dist

    from troupe import collectives
    from troupe.collectives.rendezvous import StoreAddress

    torch.set_num_threads(1)
    if rank == 0:
        collectives.create_store(host, port=port)
    g = collectives.init_group("bench", "gloo", rank, world, StoreAddress(host, port),
                               timeout_s=300)
    x, part = torch.randn(COLLECTIVE_NUMEL), torch.randn(COLLECTIVE_NUMEL // world)
    gathered, exchanged = torch.empty(world, part.numel()), torch.empty_like(x)
    reduce_sum = dist.ReduceScatterOptions()
    reduce_sum.reduceOp = dist.ReduceOp.SUM
    ops = {  # name: (the operation, its bytes over what each rank sends in the others)
        "gloo alltoall": (lambda: g.pg.alltoall_base(exchanged, x, [], [],
                                                     dist.AllToAllOptions()).wait(), 1),
        "gloo reduce_scatter": (lambda: g.pg.reduce_scatter(
            [part], [list(x.tensor_split(world))], reduce_sum).wait(), 1),
        "troupe reduce_scatter": (lambda: g.reduce_scatter(x), 1),  # a ring
        "alltoall in shifted pairs": (lambda: _shifted(g.pg, exchanged, x, rank, world), 1),
        "gloo allgather": (lambda: g.pg.allgather([list(gathered.unbind(0))], [part]).wait(), 1),
        "gloo allreduce": (lambda: g.pg.allreduce([x]).wait(), 2),
    }
    for name, (op, times) in ops.items():
        best = float("inf")
        for _ in range(3):
            g.barrier()
            t0 = time.perf_counter()
            op()
            best = min(best, time.perf_counter() - t0)
        print(json.dumps({"op": name, "seconds": best, "times": times}), flush=True)
    collectives.destroy_group("bench")


def _shifted(pg, out, x, rank: int, world: int) -> None:
    """An alltoall in W-1 rounds: in round s rank r sends to r+s and receives from r-s."""
    src_parts, dst_parts = x.view(world, -1), out.view(world, -1)
    dst_parts[rank].copy_(src_parts[rank])
    for s in range(1, world):
        to, frm = (rank + s) % world, (rank - s) % world
        sent = pg.send([src_parts[to]], to, s)
        pg.recv([dst_parts[frm]], frm, s).wait()
        sent.wait()


def collectives_(args) -> None:
    world = 4
    hosts = Hosts.up(world, NAME, rate=args.rate, cpus=1, object_store_mb=128)
    try:
        head, port = hosts.hosts[0].address, 29611
        code = ("import sys; sys.path.insert(0, 'benchmarks'); import hosts; "
                "hosts.collective_rank({rank}, {world}, {head!r}, {port})")
        procs = []
        for rank in range(world):
            procs.append(hosts.exec(rank, [sys.executable, "-c", code.format(
                rank=rank, world=world, head=head, port=port)], stdout=subprocess.PIPE,
                text=True))
            if rank == 0:
                time.sleep(1.0)  # rank 0 serves the store
        lines = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            lines += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        hosts.down()
    for op in dict.fromkeys(line["op"] for line in lines):
        mine = [line for line in lines if line["op"] == op]
        seconds = max(line["seconds"] for line in mine)
        # what each rank sends: (W-1)/W of the buffer, twice for an allreduce
        nbytes = mine[0]["times"] * (world - 1) * COLLECTIVE_NUMEL * 4 // world
        emit({"what": "collectives", "rate": args.rate, "hosts": world, "op": op,
              "bytes_per_rank": nbytes, "seconds": round(seconds, 4),
              "of_rate": round(nbytes / rate_bytes(args.rate) / seconds, 3)})


# ---- optimizers -------------------------------------------------------------------------------
def pretrain_figures(out: Path, rate: str, warmup: int) -> dict:
    """A pretraining run's throughput and its bound, from its metrics.jsonl."""
    recs = records(out)
    steps = [r for r in recs if r["kind"] == "train"]
    batch = 4 * 1  # train.batch_size: samples a step over all ranks
    steady = steps[warmup:]
    sent = [b["bytes_sent"] - a["bytes_sent"] for a, b in zip(steady, steady[1:])]
    # means: a throughput over the steps (0/1 Adam's steps differ: most skip the transfer)
    step_s = statistics.mean(r["seconds"] for r in steady)
    compute_s = statistics.mean(r["compute_s"] for r in steady)
    alone_s = statistics.mean(r["busy_s"] for r in steady)  # the slowest rank, links aside
    per_step = sum(sent) / len(sent) if sent else 0  # 0/1 Adam skips most steps' transfers
    bound = batch / (alone_s + per_step / rate_bytes(rate))
    val = [r["val_loss"] for r in recs if r["kind"] == "eval"][-1]
    return {"samples_per_s": round(batch / step_s, 3),
            "samples_per_s_run": round(batch * len(steps) / sum(r["seconds"] for r in steps), 3),
            "bound_samples_per_s": round(bound, 3), "of_bound": round(batch / step_s / bound, 3),
            "compute_s": round(compute_s, 4), "optimizer_s": round(alone_s - compute_s, 4),
            "comm_s": round(step_s - alone_s, 4), "link_s": round(per_step / rate_bytes(rate), 4),
            "step_s": round(step_s, 4),
            "bytes_per_step_per_rank": round(per_step), "val_loss": round(val, 4),
            "steps": len(steps)}


def optimizers(args) -> None:
    for rate in args.rates:
        hosts = Hosts.up(4, NAME, rate=rate, cpus=1, object_store_mb=128)
        try:
            for seed in args.seeds:
                base = None
                for name, over in OPTIMIZERS.items():
                    if args.only and name not in args.only and name != "adam":
                        continue
                    with tempfile.TemporaryDirectory() as tmp:
                        out = Path(tmp) / name
                        run_app(hosts, ["apps/pretrain.py", *WIDE, *over, "workers=4",
                                        "train.strategy=STRICT_SPREAD",
                                        f"train.steps={args.steps or 100}", f"seed={seed}",
                                        f"out_dir={out}"])
                        fig = pretrain_figures(out, rate, 0 if name == "adam" else WARMUP)
                    line = {"what": "optimizers", "rate": rate, "hosts": 4, "seed": seed,
                            "optimizer": name, **fig}
                    if name == "adam":
                        base = fig
                    elif name in ("onebit_adam", "zero_one_adam"):
                        line["speedup_vs_adam"] = round(fig["samples_per_s"]
                                                        / base["samples_per_s"], 2)
                        line["val_loss_vs_adam"] = round(fig["val_loss"] / base["val_loss"] - 1,
                                                         4)
                    emit(line)
        finally:
            hosts.down()


# ---- MoE ---------------------------------------------------------------------------------------
def moe(args) -> None:
    hosts = Hosts.up(4, NAME, rate=args.rate, cpus=1, object_store_mb=128)
    runs = {"fp32": ("model", 4), "int8": ("int8", 4), "int9": ("int9", 4),
            "control": ("model", 2)}
    against: dict[str, list[dict]] = {}  # the lines set against fp32, by run
    try:
        for seed in args.seeds:
            fp32 = None
            for name, (dispatch, ep) in runs.items():
                if args.only and name != "fp32" and name not in args.only:
                    continue  # fp32 is the reference of the others
                line = _moe_run(hosts, args, seed, dispatch, ep)
                if fp32 is None:
                    fp32 = line
                else:
                    line["a2a_bytes_vs_fp32"] = round(line["a2a_bytes_per_step"]
                                                      / fp32["a2a_bytes_per_step"], 4)
                    line["val_loss_vs_fp32"] = round(line["val_loss"] / fp32["val_loss"] - 1, 4)
                    against.setdefault(name, []).append(line)
                emit(line)
    finally:
        hosts.down()
    for name, lines in against.items():
        emit(_moe_summary(name, lines))


def _moe_run(hosts: Hosts, args, seed: int, dispatch: str, ep: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / dispatch
        run_app(hosts, ["apps/pretrain.py", "--config", "moe-tiny", "workers=4",
                        f"model.moe.ep_size={ep}", f"model.moe.dispatch={dispatch}",
                        "train.strategy=STRICT_SPREAD", f"train.steps={args.steps or 200}",
                        "train.eval_every=0", "train.checkpoint_every=0",
                        "train.eval_batches=16", f"seed={seed}", f"out_dir={out}",
                        *args.set])
        recs = records(out)
    steps = [r for r in recs if r["kind"] == "train"]
    val = [r["val_loss"] for r in recs if r["kind"] == "eval"][-1]
    row = 128 * 4 if dispatch == "model" else row_bytes(128, int(dispatch[3:]))  # d_model 128
    return {"what": "moe", "rate": args.rate, "hosts": 4, "seed": seed, "dispatch": dispatch,
            "ep_size": ep, "set": args.set, "steps": len(steps), "bytes_per_row": row,
            "a2a_bytes_per_step": steps[-1]["a2a_bytes"] // len(steps),
            "a2a_rows_per_step": steps[-1]["a2a_bytes"] // len(steps) // row,
            "samples_per_s": round(16 * len(steps) / sum(r["seconds"] for r in steps), 3),
            "val_loss": round(val, 4)}


def _moe_summary(name: str, lines: list[dict]) -> dict:
    """A run's validation loss against fp32's over the seeds: each seed's difference is one
    draw of how far the run's gate wandered from fp32's, so the mean and its spread say what
    one seed's figure cannot."""
    diffs = [line["val_loss_vs_fp32"] for line in lines]
    return {"what": "moe-seeds", "run": name, "dispatch": lines[0]["dispatch"],
            "ep_size": lines[0]["ep_size"], "set": lines[0]["set"], "steps": lines[0]["steps"],
            "seeds": [line["seed"] for line in lines],
            "val_loss_vs_fp32_mean": round(statistics.mean(diffs), 4),
            "val_loss_vs_fp32_sd": round(statistics.stdev(diffs), 4) if len(diffs) > 1 else None,
            "seeds_within_1pct": sum(abs(d) <= 0.01 for d in diffs),
            "a2a_bytes_vs_fp32_mean": round(statistics.mean(line["a2a_bytes_vs_fp32"]
                                                            for line in lines), 4)}


# ---- weight sync -----------------------------------------------------------------------------
def sync(args) -> None:
    hosts = Hosts.up(3, NAME, rate=args.rate, cpus=1, head_cpus=0, object_store_mb=128)
    try:
        for precision in ("fp32", "bf16"):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / precision
                run_app(hosts, ["apps/rlhf.py", "algorithm=grpo",
                                "reward.function=apps.rewards:sort_digits", "sft.steps=20",
                                "model.gpt.d_model=384", "model.gpt.n_layer=4",
                                "model.gpt.n_head=6",  # 7.2M parameters: 29 MB in fp32
                                f"step3.iterations={args.iterations}",
                                "step3.prompts_per_iter=8", "step3.eval_every=1000",
                                "step3.checkpoint_every=0", "task.eval_examples=8", "workers=1",
                                "step3.rollout.replicas=1", "step3.rollout.num_cpus=1",
                                "step3.rollout.overlap_sync=false",
                                f"step3.rollout.precision={precision}", f"out_dir={out}"])
                recs = records(out)
            placement = [r for r in recs if r["kind"] == "placement"][-1]["nodes"]
            steps = [r for r in recs if r["kind"] == "step3" and "sync_s" in r]
            nbytes = steps[0]["sync_bytes"]
            emit({"what": "sync", "rate": args.rate, "precision": precision,
                  "policy_host": placement["policy"][0], "replica_host": placement["rollout"][0],
                  "versions": len(steps), "bytes_per_version": nbytes,
                  "seconds_per_version": round(statistics.median(r["sync_s"] for r in steps), 4),
                  "bound_seconds": round(nbytes / rate_bytes(args.rate), 4)})
    finally:
        hosts.down()


# ---- faults ------------------------------------------------------------------------------------
def straggler(args) -> None:
    hosts = Hosts.up(4, NAME, rate=args.rate, cpus=1, object_store_mb=128)
    try:
        slow = 2
        hosts.shape(slow, rate=f"{rate_bytes(args.rate) * 8 / 10 / 1e6:g}mbit")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "straggler"
            run_app(hosts, ["apps/pretrain.py", *WIDE, "optimizer.name=adam", "workers=4",
                            "train.strategy=STRICT_SPREAD", "train.steps=10", f"out_dir={out}"])
            recs = records(out)
        links = [r for r in recs if r["kind"] == "links"]
        emit({"what": "straggler", "rate": args.rate, "slow_host": hosts.hosts[slow].address,
              "links": links[0] if links else None,
              "named": bool(links) and hosts.hosts[slow].address in links[0]["slowest"]})
    finally:
        hosts.down()


def loss(args) -> None:
    try:
        check_tools(loss=True)
    except HostsError as e:
        emit({"what": "loss", "loss": args.loss, "skipped": str(e)})
        return
    hosts = Hosts.up(4, NAME, rate=args.rate, cpus=1, object_store_mb=128)
    try:
        for lost in (0.0, args.loss):
            for i in range(4):
                hosts.shape(i, loss=lost)
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                run_app(hosts, ["apps/pretrain.py", *WIDE, "optimizer.name=adam", "workers=4",
                                "train.strategy=STRICT_SPREAD", "train.steps=20",
                                f"out_dir={Path(tmp) / 'pretrain'}"])
                pre = time.perf_counter() - t0
                t0 = time.perf_counter()
                run_app(hosts, ["apps/rlhf.py", "algorithm=grpo",
                                "reward.function=apps.rewards:sort_digits", "sft.steps=20",
                                "step3.iterations=10", "step3.prompts_per_iter=8",
                                "step3.eval_every=1000", "task.eval_examples=8", "workers=2",
                                f"out_dir={Path(tmp) / 'grpo'}"])
                grpo = time.perf_counter() - t0
            emit({"what": "loss", "loss": lost, "rate": args.rate,
                  "pretrain_s": round(pre, 1), "grpo_s": round(grpo, 1)})
    finally:
        hosts.down()


def head(args) -> None:
    """The driver in host 1, the head in host 0 killed mid-run; then a new cluster resumes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        argv = [sys.executable, "apps/pretrain.py", "--config", "dense-tiny", "workers=2",
                "train.steps=600", "train.eval_every=0", "train.checkpoint_every=50",
                "collective_timeout_s=10", f"out_dir={out}"]
        hosts = Hosts.up(3, NAME, rate=args.rate, cpus=1, head_cpus=0, object_store_mb=128)
        try:
            proc = hosts.exec(1, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            while not any(r["kind"] == "train" and r["step"] >= 30 for r in records(out)):
                if proc.poll() is not None:
                    raise RuntimeError(proc.communicate()[1][-2000:])
                time.sleep(0.1)
            hosts.kill(0)
            t0 = time.perf_counter()
            try:
                _, err = proc.communicate(timeout=300)
                exited = time.perf_counter() - t0
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                exited = None
        finally:
            hosts.down()
        last = [line for line in err.strip().splitlines() if line.strip()][-1:]
        done = max(r["step"] for r in records(out) if r["kind"] == "train")
        hosts = Hosts.up(3, NAME, rate=args.rate, cpus=1, head_cpus=0, object_store_mb=128)
        try:
            t0 = time.perf_counter()
            run_app(hosts, argv[1:])  # pretraining resumes from the newest checkpoint
            resumed = time.perf_counter() - t0
        finally:
            hosts.down()
        recs = records(out)
        emit({"what": "head", "driver_exit_s": exited and round(exited, 1),
              "driver_returncode": proc.returncode, "driver_last_line": last[0] if last else "",
              "stderr_before_it": [line[:160] for line in err.strip().splitlines()[-4:-1]],
              "steps_before": done, "resumed_s": round(resumed, 1),
              "resumed_from": [r for r in recs if r["kind"] == "placement"][-1]["step"],
              "final_step": max(r["step"] for r in recs if r["kind"] == "train")})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", required=True,
                   choices=["collectives", "optimizers", "moe", "sync", "straggler", "loss", "head"])
    p.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (optimizers: 100, moe: 200)")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--only", nargs="*", default=None,
                   help="optimizers: these alone; moe: fp32 and these of int8, int9, control")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="moe: recipe overrides on top of moe-tiny's, in every run")
    args = p.parse_args()
    try:
        check_tools()
    except HostsError as e:
        emit({"what": args.what, "skipped": str(e)})
        return
    {"collectives": collectives_, "optimizers": optimizers, "moe": moe, "sync": sync,
     "straggler": straggler, "loss": loss, "head": head}[args.what](args)


if __name__ == "__main__":
    import os
    os.chdir(ROOT)  # the apps are run from the checkout
    main()
