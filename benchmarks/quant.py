"""INT8 linear layers against fp32 on this CPU, with torch's dynamic quantization beside them.

    python benchmarks/quant.py [--sizes 512 1024] [--tokens 64 256 1024] [--threads 1]

For each (tokens M, width K = N): seconds per call (median) of nn.Linear in fp32, troupe's
W8A8 QuantizedLinear (token-wise INT8 activations, INT8 GEMM, rescale), the INT8 GEMM alone,
and torch.ao's dynamic INT8 Linear; weight bytes of each mode against fp32. One JSON line per
shape; the end-to-end decode and perplexity figures of issue 6 are still to come.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from troupe.compression import QuantizedLinear
from troupe.kernels.quant import int8_gemm, quantize_tokens


def timed(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    for K in a.sizes:
        lin = torch.nn.Linear(K, K)
        w8a8, w4 = QuantizedLinear(lin, "w8a8"), QuantizedLinear(lin, "w4a16")
        dyn = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear},
                                                     dtype=torch.qint8)
        for M in a.tokens:
            x = torch.randn(M, K)
            xq, _ = quantize_tokens(x)
            with torch.inference_mode():
                t = {"fp32": timed(lambda: lin(x), a.repeats),
                     "w8a8": timed(lambda: w8a8(x), a.repeats),
                     "int8_gemm": timed(lambda: int8_gemm(xq, w8a8.qw.q), a.repeats),
                     "torch_dynamic": timed(lambda: dyn(x), a.repeats)}
                rel = ((w8a8(x) - lin(x)).norm() / lin(x).norm()).item()
                rel_dyn = ((dyn(x) - lin(x)).norm() / lin(x).norm()).item()
            print(json.dumps({
                "bench": "quant_linear", "machine": platform.node(), "threads": a.threads,
                "tokens": M, "in": K, "out": K,
                **{f"{k}_ms": round(v * 1e3, 4) for k, v in t.items()},
                "w8a8_speedup": round(t["fp32"] / t["w8a8"], 2),
                "gemm_speedup": round(t["fp32"] / t["int8_gemm"], 2),
                "torch_dynamic_speedup": round(t["fp32"] / t["torch_dynamic"], 2),
                "w8a8_rel_error": round(rel, 5), "torch_dynamic_rel_error": round(rel_dyn, 5),
                "int8_weight_bytes_ratio": round(w8a8.weight_nbytes / (K * K * 4), 4),
                "int4_weight_bytes_ratio": round(w4.weight_nbytes / (K * K * 4), 4)}), flush=True)


if __name__ == "__main__":
    main()
