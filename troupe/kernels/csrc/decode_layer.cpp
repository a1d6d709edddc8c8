// The small operations between a decoder layer's matrix products in a decode step (a few rows,
// one token per sequence), each one call instead of the five to fifteen torch ops (and their
// dispatch, a few microseconds each) that express it: at batch 1 on SmolLM2 those ops took a
// third of the step (benchmarks/RESULTS.md, "Decoding at batch 1").
//
//   rms_norm(x, w, eps)           x / rms(x) * w, row by row
//   add_rms_norm(x, r, w, eps)    x += r (the residual stream, in place), then rms_norm(x, w)
//   silu_mul(g)                   silu(gate) * up, g = [gate | up] along the last dimension
//   rope_store(qkv, cos, sin, H, Hkv, k, v, col)
//                                 rotary positions on q and k (the half-split layout of Hugging
//                                 Face's Llama), k and v written to column col of the caches;
//                                 returns q rotated, (M, H, 1, D) for decode_attention
//
// The rows are few: every function runs on the calling thread (a fork/join of the intra-op
// pool costs more than the work). fp32 only; the callers check shapes and dtypes.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <cmath>

#include "vec16.h"

namespace {

using namespace troupe_vec;

// silu(g) u = g sigmoid(g) u, with e = exp(-|g|) <= 1: sigmoid is 1 / (1 + e) for g >= 0 and
// e / (1 + e) below (no overflow either way)
inline v16 silu_times(v16 g, v16 u) {
  const v16 e = exp_nonpositive(g < 0 ? g : -g);
  const v16 s = (g < 0 ? e : splat(1.0f)) / (1.0f + e);
  return g * s * u;
}

inline float silu_times(float g, float u) {
  const float e = std::exp(-std::fabs(g));
  return g * (g < 0 ? e : 1.0f) / (1.0f + e) * u;
}

void norm_row(const float *x, const float *w, float eps, int64_t C, float *y) {
  double ss = 0.0;  // in double: the order of the sum then barely matters
  for (int64_t c = 0; c < C; c++) ss += static_cast<double>(x[c]) * x[c];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / C) + eps);
  for (int64_t c = 0; c < C; c++) y[c] = x[c] * inv * w[c];
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  const int64_t M = x.size(0), C = x.size(1);
  auto y = at::empty({M, C}, x.options());
  for (int64_t m = 0; m < M; m++)
    norm_row(x.data_ptr<float>() + m * C, w.data_ptr<float>(), eps, C, y.data_ptr<float>() + m * C);
  return y;
}

at::Tensor add_rms_norm(at::Tensor x, at::Tensor r, at::Tensor w, double eps) {
  const int64_t M = x.size(0), C = x.size(1);
  auto y = at::empty({M, C}, x.options());
  float *xp = x.data_ptr<float>();
  const float *rp = r.data_ptr<float>();
  for (int64_t i = 0; i < M * C; i++) xp[i] += rp[i];
  for (int64_t m = 0; m < M; m++)
    norm_row(xp + m * C, w.data_ptr<float>(), eps, C, y.data_ptr<float>() + m * C);
  return y;
}

at::Tensor silu_mul(at::Tensor g) {
  const int64_t M = g.size(0), F = g.size(1) / 2;
  auto y = at::empty({M, F}, g.options());
  const float *gp = g.data_ptr<float>();
  float *yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; m++) {
    const float *gate = gp + m * 2 * F, *up = gate + F;
    float *out = yp + m * F;
    int64_t f = 0;
    for (; f + 16 <= F; f += 16) st(out + f, silu_times(ld(gate + f), ld(up + f)));
    for (; f < F; f++) out[f] = silu_times(gate[f], up[f]);
  }
  return y;
}

// qkv (M, (H + 2 Hkv) D) contiguous; cos, sin (M, D/2); k, v caches (M, Hkv, S, D) with unit
// stride along D
at::Tensor rope_store(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t H, int64_t Hkv,
                      at::Tensor k, at::Tensor v, int64_t col) {
  const int64_t M = qkv.size(0), D = k.size(3), half = D / 2, width = qkv.size(1);
  auto q = at::empty({M, H, 1, D}, qkv.options());
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  auto rotate = [&](const float *x, const float *c, const float *s, float *out) {
    for (int64_t i = 0; i < half; i++) {
      const float x1 = x[i], x2 = x[half + i];
      out[i] = x1 * c[i] - x2 * s[i];
      out[half + i] = x2 * c[i] + x1 * s[i];
    }
  };
  for (int64_t m = 0; m < M; m++) {
    const float *row = src + m * width, *c = cp + m * half, *s = sp + m * half;
    for (int64_t h = 0; h < H; h++) rotate(row + h * D, c, s, qp + (m * H + h) * D);
    for (int64_t h = 0; h < Hkv; h++) {
      float *kd = kp + m * k.stride(0) + h * k.stride(1) + col * k.stride(2);
      float *vd = vp + m * v.stride(0) + h * v.stride(1) + col * v.stride(2);
      rotate(row + (H + h) * D, c, s, kd);
      const float *vs = row + (H + Hkv + h) * D;
      for (int64_t i = 0; i < D; i++) vd[i] = vs[i];
    }
  }
  return q;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope_store", &rope_store);
}
