"""Activation checkpointing: peak memory and time of one training step (forward and backward)
with and without it, each in a fresh process, one JSON line per setting.

    python benchmarks/activation_memory.py [--d-model 512] [--layers 8] [--seq-len 512]
        [--batch 8] [--device cpu|cuda]

CPU: the step's peak resident memory above the process's before it (ru_maxrss minus the RSS
after the model and batch exist); CUDA: torch.cuda.max_memory_allocated above the allocated
bytes before the step. The same gradients either way (tests/models/test_activation_checkpointing.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from troupe.models import GPT, GPTConfig  # noqa: E402
from machine import machine  # benchmarks/machine.py, beside this script


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def one(a) -> dict:
    """One step in this process: (peak bytes above the start, seconds)."""
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=a.seq_len, n_layer=a.layers, n_head=a.d_model // 64,
                    d_model=a.d_model, positions="rope", norm="rmsnorm", mlp="swiglu")
    model = GPT(cfg, seed=0).to(a.device).train()
    model.checkpoint_activations = a.checkpointing
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len + 1), device=a.device)
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    else:
        start = rss_bytes()
    t0 = time.perf_counter()
    _, loss, _ = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start
    return {"peak_bytes": peak, "step_s": round(time.perf_counter() - t0, 3),
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--checkpointing", type=int, choices=[0, 1], default=None,
                   help="(internal) run one step in this process")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.checkpointing is not None:
        print(json.dumps(one(a)))
        return
    results = {}
    for on in (0, 1):  # each in a fresh process: ru_maxrss is a high-water mark
        cmd = [sys.executable, __file__, "--checkpointing", str(on)] + sys.argv[1:]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[on] = json.loads(out.strip().splitlines()[-1])
    for on in (0, 1):
        r = results[on]
        print(json.dumps({
            "bench": "activation_memory", "machine": machine(), "device": a.device,
            "threads": a.threads, "d_model": a.d_model, "layers": a.layers,
            "seq_len": a.seq_len, "batch": a.batch, "activation_checkpointing": bool(on),
            "params": r["params"], "peak_step_mb": round(r["peak_bytes"] / 2**20, 1),
            "step_s": r["step_s"],
            "peak_vs_plain": round(r["peak_bytes"] / results[0]["peak_bytes"], 3),
            "time_vs_plain": round(r["step_s"] / results[0]["step_s"], 2)}), flush=True)


if __name__ == "__main__":
    main()
