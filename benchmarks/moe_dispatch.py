"""MoE dispatch and combine: troupe's sorted permutation against GShard's dense one-hot einsum.

    python benchmarks/moe_dispatch.py [--tokens 8192] [--width 512] [--experts 16 32 64]

Both methods get the same routing (a top-k gate with capacity factor 1.0, computed outside the
timed region) and identity experts, so what is measured is moving tokens to experts and back:
forward + backward time (median of --iters) and peak memory. Peak memory of the first forward + backward is the process's peak resident set (ru_maxrss)
minus its resident set just before, each (method, experts) in a fresh subprocess so that
high-water marks do not mix, with glibc's mmap threshold lowered so that freed tensors leave the
resident set at once (times come from a separate process with the default allocator); on CUDA
it is max_memory_allocated.
One JSON line per (experts, top_k), with the einsum baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from troupe.kernels.moe import permute, unpermute
from troupe.models.moe import MoEConfig, TopKGate


def routing(S: int, M: int, E: int, k: int, device: str):
    torch.manual_seed(0)
    gate = TopKGate(M, E, MoEConfig(top_k=k, capacity_factor=1.0, min_capacity=0)).to(device)
    with torch.no_grad():
        r = gate(torch.randn(S, M, device=device))
    return r


def ours(x_SM, r, E):
    x_AM, plan = permute(x_SM, r.experts_SK, r.weights_SK, r.kept_SK, E)
    return unpermute(x_AM, plan)  # identity experts


def gshard(x_SM, r, E, C):
    """The dense formulation: (S, E, C) dispatch mask and combine weights, two einsums."""
    S, K = r.experts_SK.shape
    slot_SK = torch.zeros_like(r.experts_SK)
    # slot of each kept assignment within its expert, in the same order as ours
    kept_A = r.kept_SK.t().reshape(-1)
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(method: str, S: int, M: int, E: int, k: int, iters: int, device: str) -> dict:
    r = routing(S, M, E, k, device)
    C = r.capacity
    x = torch.randn(S, M, device=device, requires_grad=True)
    target = torch.randn(S, M, device=device)
    fn = (lambda: ours(x, r, E)) if method == "sorted" else (lambda: gshard(x, r, E, C))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rss0 = _rss_bytes()
    out = fn()  # the first run is the one whose peak memory counts
    (out * target).sum().backward()
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    result = out.detach().clone()
    times = []
    for _ in range(iters):
        x.grad = None
        t0 = time.perf_counter()
        (fn() * target).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "peak_bytes": peak, "capacity": C,
            "checksum": float(result.double().sum())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--experts", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--child", nargs=3, metavar=("METHOD", "E", "K"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(a.child[0], a.tokens, a.width, int(a.child[1]), int(a.child[2]),
                                 a.iters, a.device)))
        return
    # Memory runs take big blocks straight from mmap, so that freed tensors leave the resident
    # set at once and its peak follows the peak of live tensors (glibc would otherwise reuse
    # its heap); timing runs use the default allocator, as a real job would.
    mem_env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for k in a.top_k:
        for E in a.experts:
            res = {}
            for method in ("gshard_einsum", "sorted"):
                runs = []
                for env in (dict(os.environ), mem_env):
                    out = subprocess.run(
                        [sys.executable, __file__, "--tokens", str(a.tokens), "--width",
                         str(a.width), "--iters", str(a.iters), "--device", a.device, "--child",
                         method, str(E), str(k)], check=True, capture_output=True, text=True,
                        env=env).stdout
                    runs.append(json.loads(out.strip().splitlines()[-1]))
                res[method] = {**runs[0], "peak_bytes": runs[1]["peak_bytes"]}
            base, mine = res["gshard_einsum"], res["sorted"]
            print(json.dumps({
                "bench": "moe_dispatch", "device": a.device, "machine": platform.node(),
                "tokens": a.tokens, "width": a.width, "experts": E, "top_k": k,
                "capacity": mine["capacity"],
                "einsum_s": round(base["seconds"], 5), "sorted_s": round(mine["seconds"], 5),
                "speedup": round(base["seconds"] / mine["seconds"], 2),
                "einsum_peak_mb": round(base["peak_bytes"] / 2**20, 1),
                "sorted_peak_mb": round(mine["peak_bytes"] / 2**20, 1),
                "memory_ratio": round(base["peak_bytes"] / max(mine["peak_bytes"], 1), 2),
                "same_output": abs(base["checksum"] - mine["checksum"]) <= 1e-3 * (
                    1 + abs(base["checksum"])),
            }), flush=True)


if __name__ == "__main__":
    main()
