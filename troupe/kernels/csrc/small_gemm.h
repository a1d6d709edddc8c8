// fp32 y = x W^T + b for a few rows of x (decoding: one token per sequence), with W packed as
// (N/16, K, 16): for each k, one 16-wide vector of weights meets every row's broadcast input,
// so the weight is streamed once at full vector width and no horizontal sums are needed.
// Two blocks of 16 outputs and up to 8 rows per pass keep 16 accumulators in registers; the
// blocks are split over torch's intra-op threads (at::parallel_for). GCC's vector extensions
// (64-byte vectors) compile to AVX-512 where the CPU has it and to pairs of AVX2 ops where not.
//
// The kernel lives in this header so that a whole decode step (decode_layer.cpp) can run it
// without a call through Python; small_gemm.cpp binds it for torch.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>

#include "vec16.h"

namespace troupe_small_gemm {

using troupe_vec::v16;
using troupe_vec::ld;
using troupe_vec::st;

// y[:, 16b:16b+16] for two blocks b, b+1 at a time; x (M, K) with M <= 8
template <int M>
void blocks(const float *x, int64_t K, const float *wp, int64_t N, float *y,
            const float *bias, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two = b + 1 < b1;
    const float *w0 = wp + b * K * 16, *w1 = two ? w0 + K * 16 : w0;
    v16 a0[M], a1[M];
    for (int m = 0; m < M; m++) { a0[m] = (v16){0}; a1[m] = (v16){0}; }
    for (int64_t k = 0; k < K; k++) {
      const v16 W0 = ld(w0 + k * 16), W1 = ld(w1 + k * 16);
      for (int m = 0; m < M; m++) {
        const v16 xb = (v16){0} + x[m * K + k];
        a0[m] += W0 * xb;
        a1[m] += W1 * xb;
      }
    }
    v16 c0 = (v16){0}, c1 = (v16){0};
    if (bias) { c0 = ld(bias + b * 16); if (two) c1 = ld(bias + b * 16 + 16); }
    for (int m = 0; m < M; m++) {
      st(y + m * N + b * 16, a0[m] + c0);
      if (two) st(y + m * N + b * 16 + 16, a1[m] + c1);
    }
  }
}

// one row (batch 1): a block at a time, so each thread streams one run of weights (the
// hardware prefetcher follows one stream better than two: 86% of a sum's read bandwidth on
// the 2-core EPYC against 82%), four accumulators over consecutive k hiding the FMA latency
inline void blocks1(const float *x, int64_t K, const float *wp, float *y, const float *bias,
                    int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; b++) {
    const float *w = wp + b * K * 16;
    v16 a0 = (v16){0}, a1 = (v16){0}, a2 = (v16){0}, a3 = (v16){0};
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
      a0 += ld(w + k * 16) * x[k];
      a1 += ld(w + k * 16 + 16) * x[k + 1];
      a2 += ld(w + k * 16 + 32) * x[k + 2];
      a3 += ld(w + k * 16 + 48) * x[k + 3];
    }
    for (; k < K; k++) a0 += ld(w + k * 16) * x[k];
    v16 c = (a0 + a1) + (a2 + a3);
    if (bias) c += ld(bias + b * 16);
    st(y + b * 16, c);
  }
}

// y (M, 16 NB) = x (M, K) W^T (+ bias, 16 NB values, or null), W packed (NB, K, 16); M any
// (passes of 8 rows), the blocks split over torch's intra-op threads
inline void linear(const float *x, int64_t M, int64_t K, const float *w, int64_t NB,
                   const float *bias, float *y) {
  const int64_t N = NB * 16;
  at::parallel_for(0, (NB + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t rows = std::min<int64_t>(8, M - m0);
      const float *xm = x + m0 * K;
      float *ym = y + m0 * N;
      const int64_t b0 = 2 * p0, b1 = std::min(2 * p1, NB);
      switch (rows) {
        case 1: blocks1(xm, K, w, ym, bias, b0, b1); break;
        case 2: blocks<2>(xm, K, w, N, ym, bias, b0, b1); break;
        case 3: blocks<3>(xm, K, w, N, ym, bias, b0, b1); break;
        case 4: blocks<4>(xm, K, w, N, ym, bias, b0, b1); break;
        case 5: blocks<5>(xm, K, w, N, ym, bias, b0, b1); break;
        case 6: blocks<6>(xm, K, w, N, ym, bias, b0, b1); break;
        case 7: blocks<7>(xm, K, w, N, ym, bias, b0, b1); break;
        default: blocks<8>(xm, K, w, N, ym, bias, b0, b1); break;
      }
    }
  });
}

}  // namespace troupe_small_gemm
