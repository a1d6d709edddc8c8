"""MoE: troupe's dispatch and whole layer against GShard's dense einsum and DeepSpeed's MoE layer.

    python benchmarks/moe_dispatch.py --what dispatch [--experts 16 32 64] [--top-k 1 2]
    python benchmarks/moe_dispatch.py --what layer [--experts 16 64] [--threads 1 2]
    python benchmarks/moe_dispatch.py --what scaling [--threads 1 2]

dispatch: moving tokens to experts and back with identity experts, troupe's sorted permutation
  against the dense (S, E, C) one-hot einsum; both get the same routing, computed untimed.
layer: the whole MoE layer (fp32 gate, top-k with capacity factor 1.0, experts M -> H -> M with
  GELU, combine, aux loss), troupe's `MoE` against DeepSpeed's `deepspeed.moe.layer.MoE`
  (`pip install --no-build-isolation deepspeed==0.19.8`; DS_ACCELERATOR=cpu, a single-process
  gloo group, random token selection and second-expert sampling off). Both load the same gate
  and expert weights. A check in one process compares outputs and gradients: with no capacity
  limit they must agree (1e-5), and with capacity 1.0 on the tokens both keep (DeepSpeed picks
  which tokens to keep through torch.topk over a 0/1 mask, so ties fall where topk puts them;
  the numbers kept per expert are the same).
scaling: troupe's layer at 8 and 64 experts with equal work: the same tokens, top-1, dropless,
  so the experts do the same FLOPs between them.

Times: forward + backward of (y * target).sum() + aux, median of --iters after one untimed
run, torch.set_num_threads(threads); for layer and scaling the two sides are timed alternately
in --repeats fresh processes each and the best median counts (a shared machine's bursts of load
otherwise decide ratios near 1). Peak memory: the rise of the process's peak resident set
over the first forward + backward, in a fresh process with glibc's mmap threshold lowered so
that freed tensors leave the resident set at once (times come from another fresh process with
the default allocator); on CUDA, max_memory_allocated. One JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from troupe.kernels.moe import permute, unpermute
from troupe.models.moe import MoE, MoEConfig, TopKGate
from machine import machine  # benchmarks/machine.py, beside this script

# --- what is measured ------------------------------------------------------------------------

def routing(S: int, M: int, E: int, k: int, device: str):
    torch.manual_seed(0)
    gate = TopKGate(M, E, MoEConfig(top_k=k, capacity_factor=1.0, min_capacity=0)).to(device)
    with torch.no_grad():
        return gate(torch.randn(S, M, device=device))


def gshard(x_SM, r, E, C):
    """The dense formulation: (S, E, C) dispatch mask and combine weights, two einsums."""
    S, K = r.experts_SK.shape
    kept_A = r.kept_SK.t().reshape(-1)  # slot of each kept assignment, in the same order as ours
    e_A = r.experts_SK.t().reshape(-1)
    order = torch.argsort(torch.where(kept_A, e_A, E), stable=True)
    counts = torch.bincount(e_A[kept_A], minlength=E)
    starts = torch.cumsum(counts, 0) - counts
    slots = torch.zeros_like(e_A)
    n_kept = int(kept_A.sum())
    slots[order[:n_kept]] = torch.arange(n_kept, device=x_SM.device) - starts[e_A[order[:n_kept]]]
    slot_SK = slots.view(K, S).t()
    onehot_e = F.one_hot(r.experts_SK, E).to(x_SM.dtype)  # (S, K, E)
    onehot_c = F.one_hot(slot_SK.clamp(max=C - 1), C).to(x_SM.dtype)  # (S, K, C)
    w = (r.weights_SK * r.kept_SK)[..., None, None]
    combine_SEC = (w * onehot_e[..., :, None] * onehot_c[..., None, :]).sum(1)  # (S, E, C)
    dispatch_SEC = (combine_SEC > 0).to(x_SM.dtype)
    x_ECM = torch.einsum("sec,sm->ecm", dispatch_SEC, x_SM)
    return torch.einsum("sec,ecm->sm", combine_SEC, x_ECM)  # identity experts


def layer_weights(M: int, H: int, E: int) -> dict[str, torch.Tensor]:
    """Gate and expert weights in nn.Linear's layout, distinct per expert, from one seed."""
    g = torch.Generator().manual_seed(1234)
    return {"wg": torch.randn(E, M, generator=g) * M ** -0.5,
            "w1": torch.randn(E, H, M, generator=g) * M ** -0.5,
            "b1": torch.randn(E, H, generator=g) * 0.02,
            "w2": torch.randn(E, M, H, generator=g) * H ** -0.5,
            "b2": torch.randn(E, M, generator=g) * 0.02}


def troupe_layer(M: int, H: int, E: int, k: int, cf: float, dropless: bool = False):
    w = layer_weights(M, H, E)
    moe = MoE(M, H, E, MoEConfig(top_k=k, capacity_factor=cf, eval_capacity_factor=cf,
                                 min_capacity=0, dropless=dropless))
    with torch.no_grad():
        moe.gate.wg.weight.copy_(w["wg"])
        moe.experts.w1.copy_(w["w1"].transpose(1, 2))
        moe.experts.w2.copy_(w["w2"].transpose(1, 2))
        moe.experts.b1.copy_(w["b1"])
        moe.experts.b2.copy_(w["b2"])
    return moe


def deepspeed_layer(M: int, H: int, E: int, k: int, cf: float):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from deepspeed.utils import groups

    if not torch.distributed.is_initialized():  # one-process gloo group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="gloo")
    groups._get_expert_parallel_group_dict().clear()
    expert = torch.nn.Sequential(torch.nn.Linear(M, H), torch.nn.GELU(), torch.nn.Linear(H, M))
    moe = DeepSpeedMoE(M, expert, num_experts=E, ep_size=1, k=k, capacity_factor=cf,
                       eval_capacity_factor=cf, min_capacity=0, use_rts=False,
                       top2_2nd_expert_sampling=False)
    moe.set_deepspeed_parallelism()
    w = layer_weights(M, H, E)
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(w["wg"])
        for e, ex in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            ex[0].weight.copy_(w["w1"][e]), ex[0].bias.copy_(w["b1"][e])
            ex[2].weight.copy_(w["w2"][e]), ex[2].bias.copy_(w["b2"][e])
    return lambda x: moe(x)[:2]


def make_step(spec: dict, device: str):
    """(fn, x): fn() runs the forward pass and returns (y, aux)."""
    S, M, E, k = spec["tokens"], spec["width"], spec["experts"], spec["top_k"]
    x = torch.randn(S, M, generator=torch.Generator().manual_seed(5)).to(device)
    if spec["method"] == "sorted":
        r = routing(S, M, E, k, device)
        return (lambda: (unpermute(*permute(x, r.experts_SK, r.weights_SK, r.kept_SK, E)), 0)), x
    if spec["method"] == "gshard_einsum":
        r = routing(S, M, E, k, device)
        return (lambda: (gshard(x, r, E, r.capacity), 0)), x
    if spec["method"] == "troupe":
        layer = troupe_layer(M, spec["hidden"], E, k, 1.0, spec.get("dropless", False)).to(device)
    else:
        layer = deepspeed_layer(M, spec["hidden"], E, k, 1.0)
    return (lambda: layer(x)), x


def measure(spec: dict, iters: int, device: str) -> dict:
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    fn, x = make_step(spec, device)
    x.requires_grad_(True)
    target = torch.randn_like(x)

    def step():
        y, aux = fn()
        ((y * target).sum() + aux).backward()
        return y

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rss0 = _rss_bytes()
    out = step()  # the first run is the one whose peak memory counts
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    checksum = float(out.detach().double().sum())
    del out
    times = []
    for _ in range(iters):
        x.grad = None
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "peak_bytes": peak, "checksum": checksum}


def check_layers(M: int, H: int, E: int, k: int) -> dict:
    """Largest differences between DeepSpeed's and troupe's outputs and input gradients."""
    x = torch.randn(512, M, generator=torch.Generator().manual_seed(9))
    out = {}
    for name, cf in (("no_limit", float(E)), ("capacity_1", 1.0)):
        ys, gs = [], []
        for layer in (deepspeed_layer(M, H, E, k, cf), troupe_layer(M, H, E, k, cf)):
            xi = x.clone().requires_grad_(True)
            y, aux = layer(xi)
            (y.square().sum() + aux).backward()
            ys.append(y.detach()), gs.append(xi.grad)
        rows = (ys[0] != 0).any(1) & (ys[1] != 0).any(1)  # tokens both layers kept
        out[name] = {"max_abs_diff_y": float((ys[0] - ys[1])[rows].abs().max()),
                     "max_abs_diff_dx": float((gs[0] - gs[1])[rows].abs().max()),
                     "rows_compared": int(rows.sum()), "kept_ds": int((ys[0] != 0).any(1).sum()),
                     "kept_troupe": int((ys[1] != 0).any(1).sum())}
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


# --- fresh processes --------------------------------------------------------------------------

def run_pair(base: dict, mine: dict, a) -> tuple[dict, dict]:
    """Both methods, timed alternately --repeats times (the best median of each counts, so a
    burst of load on a shared machine does not decide the ratio), and their peak memory."""
    runs = {0: [], 1: []}
    for _ in range(a.repeats):
        for i, spec in enumerate((base, mine)):
            runs[i].append(_child(spec, a, dict(os.environ)))
    mem_env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    return tuple({**min(runs[i], key=lambda r: r["seconds"]),
                  "peak_bytes": _child(spec, a, mem_env)["peak_bytes"]}
                 for i, spec in enumerate((base, mine)))


def _child(spec: dict, a, env: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--iters", str(a.iters), "--device",
                          a.device, "--child", json.dumps(spec)], check=True,
                         capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_dispatch(a, common: dict) -> None:
    for k in a.top_k:
        for E in a.experts:
            spec = {**common, "experts": E, "top_k": k}
            base, mine = run_pair({**spec, "method": "gshard_einsum"},
                                  {**spec, "method": "sorted"}, a)
            print(json.dumps({
                "bench": "moe_dispatch", **common, "experts": E, "top_k": k,
                "capacity": routing(a.tokens, a.width, E, k, "cpu").capacity,
                "einsum_s": round(base["seconds"], 5), "sorted_s": round(mine["seconds"], 5),
                "speedup": round(base["seconds"] / mine["seconds"], 2),
                "einsum_peak_mb": _mb(base), "sorted_peak_mb": _mb(mine),
                "memory_ratio": round(base["peak_bytes"] / max(mine["peak_bytes"], 1), 2),
                "same_output": _close(base, mine)}), flush=True)


def bench_layer(a, common: dict) -> None:
    import deepspeed
    for threads in a.threads:
        for k in a.top_k:
            for E in a.experts:
                spec = {**common, "hidden": a.hidden, "experts": E, "top_k": k,
                        "threads": threads}
                ds, mine = run_pair({**spec, "method": "deepspeed"},
                                    {**spec, "method": "troupe"}, a)
                print(json.dumps({
                    "bench": "moe_layer", **common, "hidden": a.hidden, "experts": E,
                    "top_k": k, "threads": threads, "deepspeed_version": deepspeed.__version__,
                    "deepspeed_s": round(ds["seconds"], 4), "troupe_s": round(mine["seconds"], 4),
                    "speedup": round(ds["seconds"] / mine["seconds"], 2),
                    "deepspeed_peak_mb": _mb(ds), "troupe_peak_mb": _mb(mine),
                    "memory_ratio": round(ds["peak_bytes"] / max(mine["peak_bytes"], 1), 2)}),
                      flush=True)
    for k in a.top_k:
        for E in a.experts:
            print(json.dumps({"bench": "moe_layer_check", "width": 64, "hidden": 128,
                              "experts": E, "top_k": k, **check_layers(64, 128, E, k)}), flush=True)


def bench_scaling(a, common: dict) -> None:
    for threads in a.threads:
        t = dict(zip((8, 64), run_pair(*({**common, "hidden": a.hidden, "experts": E,
                                           "top_k": 1, "threads": threads, "dropless": True,
                                           "method": "troupe"} for E in (8, 64)), a)))
        print(json.dumps({"bench": "moe_layer_scaling", **common, "hidden": a.hidden,
                          "top_k": 1, "dropless": True, "threads": threads,
                          "experts_8_s": round(t[8]["seconds"], 4),
                          "experts_64_s": round(t[64]["seconds"], 4),
                          "ratio_64_over_8": round(t[64]["seconds"] / t[8]["seconds"], 2)}),
              flush=True)


def _mb(run: dict) -> float:
    return round(run["peak_bytes"] / 2**20, 1)


def _close(a: dict, b: dict) -> bool:
    return abs(a["checksum"] - b["checksum"]) <= 1e-3 * (1 + abs(a["checksum"]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--what", nargs="+", choices=["dispatch", "layer", "scaling"],
                   default=["dispatch"])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048, help="expert hidden size (layer, scaling)")
    p.add_argument("--experts", type=int, nargs="+")
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="timed processes per method, alternated; the best median counts")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(json.loads(a.child), a.iters, a.device)))
        return
    common = {"device": a.device, "machine": machine(), "tokens": a.tokens,
              "width": a.width}
    if "dispatch" in a.what:
        bench_dispatch(argparse.Namespace(**{**vars(a), "experts": a.experts or [16, 32, 64]}),
                       common)
    if "layer" in a.what:
        bench_layer(argparse.Namespace(**{**vars(a), "experts": a.experts or [16, 64]}), common)
    if "scaling" in a.what:
        bench_scaling(a, common)


if __name__ == "__main__":
    main()
