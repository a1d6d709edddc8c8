"""INT8 linear layers and INT8 decoding against fp32 on this CPU, with torch's dynamic
quantization beside them; or, with --device cuda, against bf16 on a GPU (with fp8, e4m3 with
row-wise scales through torch._scaled_mm, beside W8A8).

    python benchmarks/quant.py [--shapes 1024x1024 576x1536] [--tokens 1 8 64 256] [--threads 1]
    python benchmarks/quant.py --device cuda --shapes 4096x4096 --tokens 16 256 4096 \
        --decode-width 2048

The baseline (--baseline, default fp32 on the CPU and bf16 on CUDA) is what each "speedup" in
the lines divides by; torch.ao's dynamic quantization is CPU-only and left out on CUDA.

"quant_linear" lines, for each (tokens M, in x out): microseconds per call (median) of
nn.Linear in fp32, troupe's W8A8 QuantizedLinear (token-wise INT8 activations, INT8 GEMM,
rescale; the native VNNI kernel where it runs: ``w8a8_layout`` "vnni"), the same numbers
through torch ops (``torch._int_mm`` on the (O, I) rows), and torch.ao's dynamic INT8 Linear
(fbgemm, one scale per tensor); relative errors against the fp32 product, and weight bytes
against fp32.

"quant_weight_only" lines (CPU, M <= 16): troupe's W8A16 / W4A16 layers (16-bit tokens against
INT8 / INT4 weights in groups of 64; the native VNNI kernel where it runs) against fp32 and
PyTorch's packed weight-only kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``).

"quant_decode" lines: end-to-end generation with the continuous batcher (troupe.serving) at
batch 8 on a GPT of --decode-width (random weights: speed does not depend on them), in fp32,
W8A8, W4/8A16 and under torch.ao dynamic quantization: generated tokens per second and the
weight bytes of each; with --pretrained DIR, on that model (e.g. SmolLM2-135M) instead.
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
from troupe.compression.fp8 import Fp8Linear
from troupe.compression.quantize import outlier_channels
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.kernels import small_gemm
from troupe.kernels.quant import int8_linear, quantize_weight, row_layout
from troupe.models import GPT, GPTConfig, from_pretrained
from troupe.serving.model import weight_bytes
from machine import machine  # benchmarks/machine.py, beside this script

# W4/8A16: ZeroQuant's INT4 MLP and INT8 attention weights, and the output projection in INT8
# (a tied one too: SmolLM2's is a fifth of its weights); W8A8 and torch.ao leave a tied output
# projection in fp32 (torch.ao cannot reach it: it is no Linear), so the two compare like for like
DECODE_MODES = {"fp32": None, "w8a8": {"*": "w8a8"},
                "w4/8a16": {"*.attn.*": "w8a16", "*.ffn.*": "w4a16", "lm_head": "w8a16"},
                "fp8": {"*": "fp8"},  # e4m3 through torch._scaled_mm: timed on cuda only
                "torch_dynamic": "ao"}


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
    p.add_argument("--shapes", nargs="+", default=["1024x1024", "4096x4096", "576x1536",
                                                   "1536x576"],
                   help="in x out of the linear layers timed (SmolLM2's MLP: 576x1536, 1536x576)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--decode-width", type=int, default=1024)
    p.add_argument("--decode-layers", type=int, default=4)
    p.add_argument("--pretrained", default=None,
                   help="decode this Hugging Face directory instead of the random GPT")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--skip-linear", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--scoring", action="store_true",
                   help="also time a scoring forward (what RLHF's frozen roles run)")
    p.add_argument("--score-batch", type=int, default=16)
    p.add_argument("--score-len", type=int, default=128)
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
            weight_only(a)
    if not a.skip_decode:
        decode(a)
    if a.scoring and not a.cuda:
        scoring(a)


def decode(a) -> None:
    """Tokens per second of batch-``a.batch`` generation in each mode (the baseline figure is
    measured in the same run)."""
    if a.pretrained:
        base = from_pretrained(a.pretrained).eval().requires_grad_(False)
    else:
        base = GPT(GPTConfig(seq_len=256, n_layer=a.decode_layers, n_head=a.decode_width // 64,
                             d_model=a.decode_width), seed=0).eval().requires_grad_(False)
    prompts = [[(7 * i + j) % 256 for j in range(24 + 4 * i)] for i in range(a.batch)]
    modes = {a.baseline: None, **{m: r for m, r in DECODE_MODES.items() if m != "fp32"}}
    modes.pop("torch_dynamic" if a.cuda else "fp8")
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
            "bench": "quant_decode", "machine": machine(), "device": _device(a),
            "threads": a.threads, "mode": mode, "batch": a.batch,
            "model": a.pretrained or "random GPT", "d_model": base.cfg.d_model,
            "n_layer": base.cfg.n_layer, "decode_tokens_per_s": round(best, 1),
            "baseline": a.baseline, "speedup_vs_baseline": round(best / rates[a.baseline], 2),
            "weight_bytes": _bytes(model),
            "weight_bytes_vs_fp32": round(_bytes(model) / _bytes(base), 4)}), flush=True)


def scoring(a) -> None:
    """Seconds of one no-grad forward over --score-batch sequences of --score-len tokens (the
    pass RLHF's reference and reward roles run on each batch of rollouts) in fp32, W8A8 (as
    ppo.quantize_frozen=w8a8 holds them: 1 in 36 input channels kept fp32, calibrated on the
    batch) and under torch.ao, with the log-probabilities' mean absolute error against fp32
    (the ids are random tokens: a harder input than text)."""
    if a.pretrained:
        base = from_pretrained(a.pretrained).eval().requires_grad_(False)
    else:
        base = GPT(GPTConfig(seq_len=256, n_layer=a.decode_layers, n_head=a.decode_width // 64,
                             d_model=a.decode_width), seed=0).eval().requires_grad_(False)
    S = min(a.score_len, base.cfg.seq_len)
    ids = torch.randint(0, base.cfg.vocab_size, (a.score_batch, S),
                        generator=torch.Generator().manual_seed(0))
    w8a8 = copy.deepcopy(base)  # as troupe.rlhf.roles.reference.quantize_frozen does it
    quantize_model(w8a8, {"*": "w8a8"}, outliers=outlier_channels(
        base, [ids], max(1, base.cfg.d_model // 36)))
    ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(base), {torch.nn.Linear},
                                                dtype=torch.qint8)
    with torch.inference_mode():
        ref = torch.log_softmax(base(ids)[0].float(), -1)
        t, err = {}, {}
        for mode, model in (("fp32", base), ("w8a8", w8a8), ("torch_dynamic", ao)):
            t[mode] = timed(lambda: model(ids), 3)
            lp = torch.log_softmax(model(ids)[0].float(), -1)
            err[mode] = (lp - ref).abs().mean().item()
    print(json.dumps({
        "bench": "quant_scoring", "machine": machine(), "threads": a.threads,
        "model": a.pretrained or "random GPT", "batch": a.score_batch, "seq_len": S,
        **{f"{k}_s": round(v, 4) for k, v in t.items()},
        "w8a8_speedup": round(t["fp32"] / t["w8a8"], 2),
        "torch_dynamic_speedup": round(t["fp32"] / t["torch_dynamic"], 2),
        **{f"{k}_mean_abs_logprob_error": round(v, 5) for k, v in err.items() if k != "fp32"}}),
        flush=True)


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
    for shape in a.shapes:
        K, N = (int(v) for v in shape.split("x"))
        lin = torch.nn.Linear(K, N)
        w8a8 = QuantizedLinear(lin, "w8a8").to(a.device)
        fp8 = Fp8Linear(lin).to(a.device) if a.cuda else None
        rows = row_layout(w8a8.qw)  # the torch path: torch._int_mm on the (O, I) rows
        w4 = QuantizedLinear(lin, "w4a16")
        dyn = None if a.cuda else torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
        ref = copy.deepcopy(lin).to(a.device, a.dtype)
        for M in a.tokens:
            x = torch.randn(M, K, device=a.device)
            xb = x.to(a.dtype)
            with torch.inference_mode():
                t = {a.baseline: timed(lambda: ref(xb), a.repeats, a.cuda),
                     "w8a8": timed(lambda: w8a8(x), a.repeats, a.cuda),
                     "w8a8_torch_ops": timed(lambda: int8_linear(x, rows, w8a8.bias), a.repeats,
                                             a.cuda)}
                exact = lin.to(a.device)(x)
                rel = ((w8a8(x) - exact).norm() / exact.norm()).item()
                rel_base = ((ref(xb).float() - exact).norm() / exact.norm()).item()
                extra = {}
                if fp8 is not None:  # e4m3 with row-wise scales, for Hopper-class GPUs
                    t["fp8"] = timed(lambda: fp8(xb), a.repeats, a.cuda)
                    extra = {"fp8_speedup": round(t[a.baseline] / t["fp8"], 2),
                             "fp8_rel_error": round(
                                 ((fp8(xb).float() - exact).norm() / exact.norm()).item(), 5)}
                if dyn is not None:
                    t["torch_dynamic"] = timed(lambda: dyn(x), a.repeats)
                    extra = {"w8a8_vs_torch_dynamic": round(t["torch_dynamic"] / t["w8a8"], 2),
                             "torch_dynamic_speedup": round(t[a.baseline] / t["torch_dynamic"], 2),
                             "torch_dynamic_rel_error": round(
                                 ((dyn(x) - exact).norm() / exact.norm()).item(), 5)}
            print(json.dumps({
                "bench": "quant_linear", "machine": machine(), "device": _device(a),
                "threads": a.threads, "tokens": M, "in": K, "out": N, "baseline": a.baseline,
                "w8a8_layout": w8a8.qw.layout,
                **{f"{k}_us": round(v * 1e6, 1) for k, v in t.items()},
                "w8a8_speedup": round(t[a.baseline] / t["w8a8"], 2), **extra,
                "w8a8_rel_error": round(rel, 5), "baseline_rel_error": round(rel_base, 5),
                "int8_weight_bytes_ratio": round(w8a8.weight_nbytes / (K * N * 4), 4),
                "int4_weight_bytes_ratio": round(w4.weight_nbytes / (K * N * 4), 4)}), flush=True)


def weight_only(a) -> None:
    """troupe's weight-only layers against PyTorch's packed weight-only CPU kernels
    (``_weight_int8pack_mm``: per-channel INT8; ``_weight_int4pack_mm_for_cpu``: INT4 in
    groups of 64) and fp32, at decoding shapes."""
    for shape in a.shapes:
        K, N = (int(v) for v in shape.split("x"))
        lin = torch.nn.Linear(K, N, bias=False)
        w = lin.weight.detach()
        w8, w4 = QuantizedLinear(lin, "w8a16"), QuantizedLinear(lin, "w4a16")
        per_channel = quantize_weight(w, 8, 1, axis=0)
        nibbles = torch.randint(0, 16, (N, K), dtype=torch.int32)  # speed does not need real ones
        int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
        scales_zeros = torch.randn(K // 64, N, 2)
        packed = small_gemm.pack(w) if small_gemm.available() else None
        for M in a.tokens:
            x = torch.randn(M, K)
            with torch.inference_mode():
                t = {"fp32": timed(lambda: lin(x), a.repeats),
                     "w8a16": timed(lambda: w8(x), a.repeats),
                     "w4a16": timed(lambda: w4(x), a.repeats)}
                if packed is not None and M <= small_gemm.MAX_ROWS:  # what fp32 decoding uses
                    t["fp32_packed"] = timed(lambda: small_gemm.linear(x, packed, N), a.repeats)
                if M <= 16:  # (10-200 ms a call above that)
                    t["aten_int8pack"] = timed(lambda: torch.ops.aten._weight_int8pack_mm(
                        x, per_channel.q, per_channel.scales), a.repeats)
                    t["aten_int4pack"] = timed(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                        x, int4pack, 64, scales_zeros), a.repeats)
                exact = lin(x)
                err = {m: round(((q(x) - exact).norm() / exact.norm()).item(), 5)
                       for m, q in (("w8a16", w8), ("w4a16", w4))}
            fp32 = min(t["fp32"], t.get("fp32_packed", float("inf")))  # the faster fp32 path
            extra = {} if M > 16 else {
                "w8a16_vs_aten_int8pack": round(t["aten_int8pack"] / t["w8a16"], 2),
                "w4a16_vs_aten_int4pack": round(t["aten_int4pack"] / t["w4a16"], 2)}
            print(json.dumps({
                "bench": "quant_weight_only", "machine": machine(), "device": _device(a),
                "threads": a.threads, "tokens": M, "in": K, "out": N,
                "w8a16_layout": w8.qw.layout,
                **{f"{k}_us": round(v * 1e6, 1) for k, v in t.items()},
                "w8a16_vs_fp32": round(fp32 / t["w8a16"], 2),
                "w4a16_vs_fp32": round(fp32 / t["w4a16"], 2), **extra,
                **{f"{k}_rel_error": v for k, v in err.items()}}), flush=True)

if __name__ == "__main__":
    main()
