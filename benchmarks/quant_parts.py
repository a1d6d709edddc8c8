"""Where a W8A8 linear layer's time goes on a GPU: each piece of ``int8_linear`` alone.

    python benchmarks/quant_parts.py [--shapes 4096x4096 4096x11008] [--tokens 17 256 4096]

For each (tokens M, in x out), microseconds per call, the mean of --iters back-to-back calls
between two CUDA events (launch costs included, as a server sees them): bf16 ``F.linear`` (the
baseline), ``torch._int_mm`` on the row-major (O, I) weight read through its transposed view
(what ``int8_gemm`` does) and on a row-major (I, O) copy, token quantization
(``quantize_tokens``), the whole ``int8_linear`` call, fp8 (e4m3) ``torch._scaled_mm`` with
unit scales, and the whole fp8 layer (troupe.compression.fp8.Fp8Linear: each token quantized
with its scale, one ``_scaled_mm`` with row-wise scales and the bias). CUDA only.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from troupe.compression import QuantizedLinear
from troupe.compression.fp8 import Fp8Linear
from troupe.kernels.quant import int8_linear, quantize_tokens, row_layout
from machine import machine  # benchmarks/machine.py, beside this script


def timed_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / iters * 1000, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x11008"], help="in x out")
    p.add_argument("--tokens", type=int, nargs="+", default=[17, 256, 4096])
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    dev = "cuda"
    for shape in a.shapes:
        I, O = (int(v) for v in shape.split("x"))
        lin = torch.nn.Linear(I, O, bias=False)
        qw = row_layout(QuantizedLinear(lin, "w8a8").to(dev).qw)  # as a served layer holds it
        q_IO = qw.q.t().contiguous()
        wb = lin.weight.detach().to(dev, torch.bfloat16)
        w8 = wb.to(torch.float8_e4m3fn).t()  # column-major (I, O), as _scaled_mm wants
        one = torch.ones((), device=dev)
        fp8 = Fp8Linear(lin).to(dev)
        for M in a.tokens:
            x = torch.randn(M, I, device=dev)
            xb, xq = x.bfloat16(), quantize_tokens(x)[0]
            x8 = xb.to(torch.float8_e4m3fn)
            t = {"bf16_linear": lambda: F.linear(xb, wb),
                 "int_mm_transposed_view": lambda: torch._int_mm(xq, qw.q.t()),
                 "int_mm_row_major_IO": lambda: torch._int_mm(xq, q_IO),
                 "quantize_tokens": lambda: quantize_tokens(x),
                 "int8_linear": lambda: int8_linear(x, qw),
                 "fp8_scaled_mm": lambda: torch._scaled_mm(x8, w8, one, one,
                                                           out_dtype=torch.bfloat16),
                 "fp8_linear": lambda: fp8(xb)}
            print(json.dumps({"bench": "quant_parts", "machine": machine(),
                              "device": torch.cuda.get_device_name(), "tokens": M, "in": I,
                              "out": O, **{f"{k}_us": timed_us(f, a.iters)
                                           for k, f in t.items()}}), flush=True)


if __name__ == "__main__":
    main()
