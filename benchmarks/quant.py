"""INT8 linear layers and INT8 decoding against fp32 on this CPU, with torch's dynamic
quantization beside them; or, with --device cuda, against bf16 on a GPU.

    python benchmarks/quant.py [--sizes 512 1024] [--tokens 64 256 1024] [--threads 1]
    python benchmarks/quant.py --device cuda --sizes 4096 --tokens 16 256 4096 --decode-width 2048

The baseline (--baseline, default fp32 on the CPU and bf16 on CUDA) is what each "speedup" in
the lines divides by; torch.ao's dynamic quantization is CPU-only and left out on CUDA.

"quant_linear" lines, for each (tokens M, width K = N): seconds per call (median) of nn.Linear
in fp32, troupe's W8A8 QuantizedLinear (token-wise INT8 activations, INT8 GEMM, rescale), the
INT8 GEMM alone, and torch.ao's dynamic INT8 Linear; weight bytes of each mode against fp32.

"quant_breakdown" lines: where a W8A8 call spends its time at the decoding shapes of the
--decode-width GPT (8 tokens; attention K = N, MLP up K -> 4K and down 4K -> K): the token
quantization, the INT8 GEMM, the rescale, the whole call, and torch.ao's fused call beside them.

"quant_decode" lines: end-to-end generation with the continuous batcher (troupe.serving) at
batch 8 on a GPT of --decode-width (random weights: speed does not depend on them), in fp32,
W8A8, W4/8A16 and under torch.ao dynamic quantization: generated tokens per second and the
weight bytes of each.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch

from troupe.compression import QuantizedLinear, quantize_model
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.kernels.quant import channel_scales, int8_gemm, quantize_tokens
from troupe.models import GPT, GPTConfig
from troupe.serving.model import weight_bytes

DECODE_MODES = {"fp32": None, "w8a8": {"*": "w8a8"},
                "w4/8a16": {"*.attn.*": "w8a16", "*.ffn.*": "w4a16"}, "torch_dynamic": "ao"}


def timed(fn, repeats: int, cuda: bool = False) -> float:
    """Median seconds per call (GPU work included: synchronized around each call)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    runs = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--decode-width", type=int, default=1024)
    p.add_argument("--decode-layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--skip-linear", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--baseline", default=None, choices=["fp32", "bf16"],
                   help="the unquantized layers' dtype (default: fp32 on cpu, bf16 on cuda)")
    a = p.parse_args()
    a.baseline = a.baseline or ("bf16" if a.device == "cuda" else "fp32")
    a.dtype = torch.bfloat16 if a.baseline == "bf16" else torch.float32
    a.cuda = a.device == "cuda"
    if a.cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if not a.skip_linear:
        linears(a)
        if not a.cuda:
            breakdown(a)
    decode(a)


def breakdown(a) -> None:
    d = a.decode_width
    for K, N in ((d, d), (d, 4 * d), (4 * d, d)):
        lin = torch.nn.Linear(K, N)
        q = QuantizedLinear(lin, "w8a8")
        dyn = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear},
                                                     dtype=torch.qint8)
        x = torch.randn(a.batch, K)
        xq, xs = quantize_tokens(x)
        acc, cs = int8_gemm(xq, q.qw.q), channel_scales(q.qw)
        with torch.inference_mode():
            t = {"fp32": timed(lambda: lin(x), a.repeats),
                 "quantize_tokens": timed(lambda: quantize_tokens(x), a.repeats),
                 "int8_gemm": timed(lambda: int8_gemm(xq, q.qw.q), a.repeats),
                 "rescale": timed(lambda: acc.float() * xs[:, None] * cs[None, :] + lin.bias,
                                  a.repeats),
                 "w8a8": timed(lambda: q(x), a.repeats),
                 "torch_dynamic": timed(lambda: dyn(x), a.repeats)}
        print(json.dumps({
            "bench": "quant_breakdown", "machine": platform.node(), "threads": a.threads,
            "tokens": a.batch, "in": K, "out": N,
            **{f"{k}_us": round(v * 1e6, 1) for k, v in t.items()},
            "gemm_share_of_w8a8": round(t["int8_gemm"] / t["w8a8"], 2),
            "gemm_vs_torch_dynamic": round(t["int8_gemm"] / t["torch_dynamic"], 2)}), flush=True)


def decode(a) -> None:
    """Tokens per second of batch-``a.batch`` generation in each mode (the baseline figure is
    measured in the same run)."""
    cfg = GPTConfig(seq_len=256, n_layer=a.decode_layers, n_head=a.decode_width // 64,
                    d_model=a.decode_width)
    base = GPT(cfg, seed=0).eval().requires_grad_(False)
    prompts = [[(7 * i + j) % 256 for j in range(24 + 4 * i)] for i in range(a.batch)]
    modes = {a.baseline: None, **{m: r for m, r in DECODE_MODES.items() if m != "fp32"}}
    if a.cuda:
        modes.pop("torch_dynamic")
    rates = {}
    for mode, rules in modes.items():
        model = copy.deepcopy(base)
        if rules == "ao":
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear},
                                                           dtype=torch.qint8)
        elif rules:
            quantize_model(model, rules, group_size=64)
        elif a.dtype != torch.float32:
            model = model.to(a.dtype)
        model = model.to(a.device)
        best = 0.0
        for _ in range(3):  # best of three: the machine is shared and noisy
            engine = ContinuousBatcher(model, eos_id=None, max_batch=a.batch)
            for i, prompt in enumerate(prompts):
                engine.add(str(i), prompt, SamplingParams(max_tokens=a.new_tokens))
            engine.step()  # the prefill (and first token) of every sequence
            if a.cuda:
                torch.cuda.synchronize()
            t0, n = time.perf_counter(), 0
            while engine.has_work():
                n += len(engine.step())
            if a.cuda:
                torch.cuda.synchronize()
            best = max(best, n / (time.perf_counter() - t0))
        rates[mode] = best
        print(json.dumps({
            "bench": "quant_decode", "machine": platform.node(), "device": _device(a),
            "threads": a.threads, "mode": mode, "batch": a.batch, "d_model": a.decode_width,
            "n_layer": a.decode_layers, "decode_tokens_per_s": round(best, 1),
            "baseline": a.baseline, "speedup_vs_baseline": round(best / rates[a.baseline], 2),
            "weight_bytes": _bytes(model),
            "weight_bytes_vs_fp32": round(_bytes(model) / _bytes(base), 4)}), flush=True)


def _device(a) -> str:
    return torch.cuda.get_device_name() if a.cuda else platform.processor() or "cpu"


def _bytes(model) -> int:
    """Weight bytes as held; torch.ao's packed weights counted at one byte per weight plus a
    scale per output channel."""
    total = weight_bytes(model)
    for m in model.modules():
        if isinstance(m, torch.ao.nn.quantized.dynamic.Linear):
            w = m.weight()
            total += w.numel() + 8 * w.shape[0]
    return total


def linears(a) -> None:
    for K in a.sizes:
        lin = torch.nn.Linear(K, K)
        w8a8 = QuantizedLinear(lin, "w8a8").to(a.device)
        w4 = QuantizedLinear(lin, "w4a16")
        dyn = None if a.cuda else torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
        ref = copy.deepcopy(lin).to(a.device, a.dtype)
        for M in a.tokens:
            x = torch.randn(M, K, device=a.device)
            xb = x.to(a.dtype)
            xq, _ = quantize_tokens(x)
            with torch.inference_mode():
                t = {a.baseline: timed(lambda: ref(xb), a.repeats, a.cuda),
                     "w8a8": timed(lambda: w8a8(x), a.repeats, a.cuda),
                     "int8_gemm": timed(lambda: int8_gemm(xq, w8a8.qw.q), a.repeats, a.cuda)}
                exact = lin.to(a.device)(x)
                rel = ((w8a8(x) - exact).norm() / exact.norm()).item()
                rel_base = ((ref(xb).float() - exact).norm() / exact.norm()).item()
                extra = {}
                if dyn is not None:
                    t["torch_dynamic"] = timed(lambda: dyn(x), a.repeats)
                    extra = {"torch_dynamic_speedup": round(t[a.baseline] / t["torch_dynamic"], 2),
                             "torch_dynamic_rel_error": round(
                                 ((dyn(x) - exact).norm() / exact.norm()).item(), 5)}
            print(json.dumps({
                "bench": "quant_linear", "machine": platform.node(), "device": _device(a),
                "threads": a.threads, "tokens": M, "in": K, "out": K, "baseline": a.baseline,
                **{f"{k}_ms": round(v * 1e3, 4) for k, v in t.items()},
                "w8a8_speedup": round(t[a.baseline] / t["w8a8"], 2),
                "gemm_speedup": round(t[a.baseline] / t["int8_gemm"], 2), **extra,
                "w8a8_rel_error": round(rel, 5), "baseline_rel_error": round(rel_base, 5),
                "int8_weight_bytes_ratio": round(w8a8.weight_nbytes / (K * K * 4), 4),
                "int4_weight_bytes_ratio": round(w4.weight_nbytes / (K * K * 4), 4)}), flush=True)


if __name__ == "__main__":
    main()
