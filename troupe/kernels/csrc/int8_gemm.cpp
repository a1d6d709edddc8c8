// Binds the W8A8 kernel of int8_gemm.h for torch (troupe.kernels.quant.int8_linear), checking
// the shapes it is given.
// A part of native.cpp (included there in a namespace of its own), its bindings in bind().
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "int8_gemm.h"

// x (M, K) fp32, K a multiple of 4; wp (NB, K/4, 16, 4) int8 (output channels past n_out are
// zeros); colsum (n_out) int32, scales and bias (n_out) fp32 (bias may be absent), with
// 16 (NB - 1) < n_out <= 16 NB; outlier channels (k) int64 and their fp32 weight rows
// (k, n_out), both or neither. Returns y (M, n_out) fp32.
at::Tensor linear(at::Tensor x, at::Tensor wp, at::Tensor colsum,
                  at::Tensor scales, c10::optional<at::Tensor> bias, int64_t n_out,
                  c10::optional<at::Tensor> channels,
                  c10::optional<at::Tensor> channel_rows) {
#if TROUPE_VNNI
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_gemm.linear: x must be a contiguous (M, K) float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0);
  TORCH_CHECK(K % 4 == 0 && wp.size(1) * 4 == K, "int8_gemm.linear: x has K = ", K,
              ", the packed weight ", wp.size(1) * 4);
  TORCH_CHECK(n_out <= NB * 16 && n_out > (NB - 1) * 16, "int8_gemm.linear: n_out ", n_out,
              " does not fit ", NB, " blocks of 16");
  TORCH_CHECK(colsum.numel() == n_out && scales.numel() == n_out &&
              (!bias.has_value() || bias->numel() == n_out),
              "int8_gemm.linear: colsum, scales and bias need ", n_out, " values");
  TORCH_CHECK(channels.has_value() == channel_rows.has_value(),
              "int8_gemm.linear: outlier channels and their weight rows go together");
  const int64_t k = channels.has_value() ? channels->numel() : 0;
  const int64_t *ch = k ? channels->data_ptr<int64_t>() : nullptr;
  if (k) {
    TORCH_CHECK(channels->scalar_type() == at::kLong && channels->is_contiguous() &&
                channel_rows->scalar_type() == at::kFloat && channel_rows->is_contiguous() &&
                channel_rows->dim() == 2 && channel_rows->size(0) == k &&
                channel_rows->size(1) == n_out,
                "int8_gemm.linear: outlier channels (k) int64 and rows (k, ", n_out, ") float32");
    for (int64_t c = 0; c < k; c++)
      TORCH_CHECK(ch[c] >= 0 && ch[c] < K, "int8_gemm.linear: outlier channel ", ch[c],
                  " outside 0..", K - 1);
  }
  auto y = at::empty({M, n_out}, x.options());
  troupe_int8::linear(x.data_ptr<float>(), M, K, wp.data_ptr<int8_t>(), NB,
                      colsum.data_ptr<int32_t>(), scales.data_ptr<float>(),
                      bias.has_value() ? bias->data_ptr<float>() : nullptr, n_out, k, ch,
                      k ? channel_rows->data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
#else
  TORCH_CHECK(false, "int8_gemm.linear: this build has no AVX-512 VNNI");
#endif
}

void bind(pybind11::module_ m) {
  m.def("available", &available);
  m.def("linear", &linear);
}
