"""The linear layers of one fp32 decode step of SmolLM2-135M (30 blocks of q/k/v/o and the
SwiGLU projections, then the 49152 x 576 output embedding), M rows each: MKL's sgemm through
F.linear against troupe's packed product (troupe.kernels.small_gemm), in one run.

    python benchmarks/decode_gemm.py [--rows 1 8 16] [--threads 1 2]

Random weights of the model's shapes (the speed does not depend on their values). One JSON
line per (threads, rows): milliseconds for the whole step's layers and the weight bytes read
per second, and the speedup.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from troupe.kernels import small_gemm
from machine import machine  # benchmarks/machine.py, beside this script

BLOCK = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = BLOCK * 30 + [(49152, 576)]


def timed(fn, layers, inputs, repeats: int) -> float:
    for _ in range(2):
        for layer in layers:
            fn(inputs[layer[-1]], *layer)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for layer in layers:
            fn(inputs[layer[-1]], *layer)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    if not small_gemm.available():
        raise SystemExit("the packed kernel cannot be built here (no C++ compiler?)")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for n, k in SHAPES]
    layers = [(w, small_gemm.pack(w), w.shape[0], w.shape[1]) for w in weights]
    nbytes = sum(w.numel() * 4 for w in weights)
    for threads in a.threads:
        torch.set_num_threads(threads)
        for rows in a.rows:
            inputs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}
            mkl = timed(lambda x, w, pw, n, k: F.linear(x, w), layers, inputs, a.repeats)
            ours = timed(lambda x, w, pw, n, k: small_gemm.linear(x, pw, n), layers, inputs,
                         a.repeats)
            print(json.dumps({"bench": "decode_gemm", "machine": machine(),
                              "threads": threads, "rows": rows, "layers": len(layers),
                              "weight_gb": round(nbytes / 1e9, 3),
                              "mkl_ms": round(mkl * 1e3, 2), "packed_ms": round(ours * 1e3, 2),
                              "mkl_gb_per_s": round(nbytes / mkl / 1e9, 1),
                              "packed_gb_per_s": round(nbytes / ours / 1e9, 1),
                              "speedup": round(mkl / ours, 2)}), flush=True)


if __name__ == "__main__":
    main()
