// Attention of one new token per sequence over its cached keys and values (a decode step):
// out[b, h] = softmax(scale q[b, h] . K[b, h']^T, masked) V[b, h'] with h' = h / (H / Hkv) (grouped
// queries share a key/value head). The cache is read once, in place (any strides between rows),
// each key row meeting the G query heads that share it, and the values likewise, with
// software prefetch (the cache is cold: the weights streamed through since the last step).
//
// Work is split over (sequence, key/value head) pairs with torch's intra-op threads. GCC's
// vector extensions (64-byte vectors) compile to AVX-512 where the CPU has it and to pairs of
// AVX2 ops where not (vec16.h). exp is a degree-6 polynomial on [-ln2/2, ln2/2] scaled by 2^n (relative
// error below 2e-7, as good as the fp32 division that follows it).
//
// The kernel lives in this header so that a whole decode step (decode_layer.cpp) can run it
// without a call through Python; decode_attention.cpp binds it for torch.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec16.h"

namespace troupe_attention {

constexpr int64_t PF = 8;  // key rows prefetched ahead

using namespace troupe_vec;

inline float hsum(v16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

// lane i = the sum of a[i]'s 16 lanes: four rounds of pairwise shuffles and adds (15 pairs)
// instead of 16 horizontal sums
inline v16 hsum16(const v16 *a) {
  v16 x[8], y[4], z[2];
#define TROUPE_HALVES(A, B, ...) (__builtin_shufflevector(A, B, __VA_ARGS__))
  for (int i = 0; i < 8; i++)  // x[i]: halves of a[2i] in lanes 0-7, of a[2i+1] in 8-15
    x[i] = TROUPE_HALVES(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                         21, 22, 23) +
           TROUPE_HALVES(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                         28, 29, 30, 31);
  for (int i = 0; i < 4; i++)  // y[i]: quarters of a[4i], a[4i+2], a[4i+1], a[4i+3]
    y[i] = TROUPE_HALVES(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24,
                         25, 26, 27) +
           TROUPE_HALVES(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28,
                         29, 30, 31);
  for (int i = 0; i < 2; i++)  // z[i]: pairs of a[8i + 0, 4, 2, 6, 1, 5, 3, 7]
    z[i] = TROUPE_HALVES(y[2 * i], y[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                         13, 28, 29) +
           TROUPE_HALVES(y[2 * i], y[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14,
                         15, 30, 31);
  // lane 2 s + w holds a[8 w + r(s)], r = 0 4 2 6 1 5 3 7 (r is its own inverse)
  const v16 w = TROUPE_HALVES(z[0], z[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14,
                              30) +
                TROUPE_HALVES(z[0], z[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15,
                              31);
#undef TROUPE_HALVES
  // back to lane order: lane t (t = 8 w + r) comes from lane 2 r(t mod 8) + t / 8
  return __builtin_shufflevector(w, w, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// The G query heads of one key/value head of one sequence: the scores of every key (16 at
// a time, reduced together), the softmax, and the weighted sum of the values, with the head's
// DV vectors (D = 16 DV) in registers.
struct Task {
  const float *k, *v;       // row 0 of this head's keys and values
  int64_t k_row, v_row, S;  // strides between rows, number of keys
  const bool *valid;        // (S) or null: every key
  float *scores;            // (S) scratch
};

template <int DV>
void attend_head(const Task &t, const float *q, float scale, bool first, float *out) {
  v16 qv[DV];
#pragma GCC unroll 16
  for (int j = 0; j < DV; j++) qv[j] = ld(q + 16 * j) * scale;
  const int64_t S = t.S;
  float *ph = t.scores;
  // the cache is cold (the weights streamed through since this layer's last step): with key
  // row i, the first head of the group asks for key row i + PF and for value row i, read next
  auto row = [&](int64_t i) {
    const float *ki = t.k + i * t.k_row;
    if (first) {
#pragma GCC unroll 16
      for (int j = 0; j < DV; j++) {
        __builtin_prefetch(ki + PF * t.k_row + 16 * j);
        __builtin_prefetch(t.v + i * t.v_row + 16 * j);
      }
    }
    v16 acc = qv[0] * ld(ki);
#pragma GCC unroll 16
    for (int j = 1; j < DV; j++) acc += qv[j] * ld(ki + 16 * j);
    return acc;
  };
  int64_t i = 0;
  for (; i + 16 <= S; i += 16) {  // 16 keys a round, their sums reduced together
    v16 acc[16];
#pragma GCC unroll 16
    for (int u = 0; u < 16; u++) acc[u] = row(i + u);
    st(ph + i, hsum16(acc));
  }
  for (; i < S; i++) ph[i] = hsum(row(i));
  // masked keys, then the softmax over the row (a masked key's weight is exactly 0)
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  float best = NEG;
  for (i = 0; i < S; i++) {
    if (t.valid && !t.valid[i]) ph[i] = NEG;
    best = std::max(best, ph[i]);
  }
  v16 total = (v16){0};
  for (i = 0; i + 16 <= S; i += 16) {
    const v16 x = ld(ph + i);
    const v16 e = x == NEG ? (v16){0} : exp_nonpositive(x - best);
    st(ph + i, e);
    total += e;
  }
  float sum = hsum(total);
  for (; i < S; i++) {
    ph[i] = ph[i] == NEG ? 0.0f : std::exp(ph[i] - best);
    sum += ph[i];
  }
  v16 acc[DV];
#pragma GCC unroll 16
  for (int j = 0; j < DV; j++) acc[j] = (v16){0};
  for (i = 0; i < S; i++) {
    if (ph[i] == 0.0f) continue;
    const v16 w = splat(ph[i]);
    const float *vi = t.v + i * t.v_row;
#pragma GCC unroll 16
    for (int j = 0; j < DV; j++) acc[j] += w * ld(vi + 16 * j);
  }
  const float inv = 1.0f / sum;
#pragma GCC unroll 16
  for (int j = 0; j < DV; j++) st(out + 16 * j, acc[j] * inv);
}

using HeadFn = void (*)(const Task &, const float *, float, bool, float *);

inline HeadFn head_fn(int64_t DV) {
  switch (DV) {
    case 1: return attend_head<1>;
    case 2: return attend_head<2>;
    case 3: return attend_head<3>;
    case 4: return attend_head<4>;
    case 5: return attend_head<5>;
    case 6: return attend_head<6>;
    case 7: return attend_head<7>;
    case 8: return attend_head<8>;
    case 16: return attend_head<16>;
    default: return nullptr;
  }
}

inline bool supports(int64_t head_dim) { return head_dim % 16 == 0 && head_fn(head_dim / 16); }

// Where one layer's tensors are: q (B, H, D) with strides q_b, q_h; the caches' keys and values
// (B, Hkv, S, D) with strides (k_b, k_h, k_s), likewise v; valid (B, S) or null; out (B, H, D)
// contiguous. ``supports(D)`` is the caller's to check.
struct Layout {
  int64_t B, H, Hkv, S, D;
  const float *q;
  int64_t q_b, q_h;
  const float *k;
  int64_t k_b, k_h, k_s;
  const float *v;
  int64_t v_b, v_h, v_s;
  const bool *valid;
  float *out;
  const int64_t *rows = nullptr;  // the cache row of each query row (null: the same index)
};

inline void decode(const Layout &a, float scale) {
  const int64_t G = a.H / a.Hkv;
  const HeadFn head = head_fn(a.D / 16);
  at::parallel_for(0, a.B * a.Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(a.S);
    for (int64_t task = t0; task < t1; task++) {
      const int64_t b = task / a.Hkv, hk = task % a.Hkv, c = a.rows ? a.rows[b] : b;
      const Task t{a.k + c * a.k_b + hk * a.k_h, a.v + c * a.v_b + hk * a.v_h, a.k_s, a.v_s,
                   a.S, a.valid ? a.valid + b * a.S : nullptr, scores.data()};
      for (int64_t g = 0; g < G; g++) {
        const int64_t h = hk * G + g;
        head(t, a.q + b * a.q_b + h * a.q_h, scale, g == 0, a.out + (b * a.H + h) * a.D);
      }
    }
  });
}

}  // namespace troupe_attention
