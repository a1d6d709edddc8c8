"""FP8 (e4m3) linear layers with row-wise scales, the mode Hopper-class GPUs run natively.

A weight is held as float8_e4m3fn with one scale per output row (its absmax over 448, e4m3's
largest finite value), an activation quantized the same way per token at each call, and the
product is one ``torch._scaled_mm`` with both scale vectors and the bias applied in its
epilogue: on an H100 a cuBLASLt FP8 GEMM, on the CPU torch's own kernel (the same numbers, as
the tests check against a dequantized reference). e4m3 keeps 3 mantissa bits over a wide
exponent range, so unlike INT8 it needs no outlier channels: a token's largest value sets its
scale, and the small values keep their relative precision.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as e4m3, (rows, 1) fp32 scales): each row scaled so that its absmax is E4M3_MAX."""
    scale = x.detach().abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


class Fp8Linear(nn.Module):
    """An nn.Linear held as an e4m3 weight (O, I) with row-wise scales; activations quantized
    per token at each call. The output is in the input's dtype (fp32 or bf16)."""

    mode = "fp8"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        w, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_fp8", w)
        self.register_buffer("weight_scale", scale.t().contiguous())  # (1, O), as _scaled_mm
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight_nbytes(self) -> int:
        return self.weight_fp8.numel() + 4 * self.weight_scale.numel()

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_fp8.float() * self.weight_scale.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, x_scale = quantize_rows(x2)
        out_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        bias = None if self.bias is None else self.bias.to(out_dtype)
        y = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=x_scale,
                             scale_b=self.weight_scale, bias=bias, out_dtype=out_dtype)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)
