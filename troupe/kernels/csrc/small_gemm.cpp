// Binds the packed few-row fp32 product of small_gemm.h for torch (troupe.kernels.small_gemm).
// A part of native.cpp (included there in a namespace of its own), its bindings in bind().
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "small_gemm.h"

// x (M, K) contiguous fp32, wp (NB, K, 16), bias (16 NB) or absent: y (M, 16 NB)
at::Tensor linear(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> bias) {
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0);
  auto y = at::empty({M, NB * 16}, x.options());
  troupe_small_gemm::linear(x.data_ptr<float>(), M, K, wp.data_ptr<float>(), NB,
                            bias.has_value() ? bias->data_ptr<float>() : nullptr,
                            y.data_ptr<float>());
  return y;
}

void bind(pybind11::module_ m) { m.def("linear", &linear); }
