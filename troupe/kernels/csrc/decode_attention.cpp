// Binds the decode-step attention of decode_attention.h for torch
// (troupe.kernels.decode_attention).
// A part of native.cpp (included there in a namespace of its own), its bindings in bind().
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include "decode_attention.h"

using troupe_attention::supports;

// q (B, H, 1, D), k and v (B, Hkv, S, D), each with unit stride along D (any other strides);
// valid (B, S) bool or absent (all valid); ``supports(D)``. Returns (B, H, 1, D) float32.
at::Tensor decode(at::Tensor q, at::Tensor k, at::Tensor v,
                  c10::optional<at::Tensor> valid, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1,
              "decode_attention: q must be (B, H, 1, D) and k, v (B, Hkv, S, D)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat, "decode_attention: float32 tensors only");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && H % Hkv == 0,
              "decode_attention: k and v must be (", B, ", Hkv, S, ", D, ") with H = ", H,
              " a multiple of Hkv");
  TORCH_CHECK(supports(D) && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: head size ", D, " unsupported, or not contiguous along it");
  TORCH_CHECK(!valid.has_value() || (valid->scalar_type() == at::kBool &&
                                     valid->is_contiguous() && valid->numel() == B * S),
              "decode_attention: valid must be a contiguous (B, S) bool tensor");
  auto out = at::empty({B, H, 1, D}, q.options());
  const troupe_attention::Layout a{
      B, H, Hkv, S, D,
      q.data_ptr<float>(), q.stride(0), q.stride(1),
      k.data_ptr<float>(), k.stride(0), k.stride(1), k.stride(2),
      v.data_ptr<float>(), v.stride(0), v.stride(1), v.stride(2),
      valid.has_value() ? valid->data_ptr<bool>() : nullptr, out.data_ptr<float>()};
  troupe_attention::decode(a, static_cast<float>(scale));
  return out;
}

void bind(pybind11::module_ m) {
  m.def("decode", &decode);
  m.def("supports", &supports);
}
