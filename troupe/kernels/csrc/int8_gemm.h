// W8A8 linear layers with AVX-512 VNNI: y = dq(q(x) q(W)^T) + b, where each token (row of x)
// is quantized to INT8 with its own scale (max|x_t| / 127) and each output channel of W has
// its own scale. One call quantizes the rows, multiplies, and rescales; no INT32 matrix is
// ever written to memory.
//
// VNNI's vpdpbusd multiplies unsigned by signed bytes, four pairs summed into each INT32 lane.
// The activations are shifted to unsigned (u = q + 128) and the shift is taken back out with
// the weight's column sums: sum_k u_k w_k = sum_k q_k w_k + 128 sum_k w_k.
//
// The weight is packed as (N/16, K/4, 16, 4): for each block of 16 output channels and each
// group of 4 inputs, one 64-byte vector holds the 16 x 4 weights vpdpbusd wants, and one
// broadcast of a token's 4 input bytes meets it. A tile of up to 6 tokens x 4 blocks (64
// outputs) keeps 24 accumulators in registers over the whole inner dimension; the blocks are
// split over torch's intra-op threads (at::parallel_for).
//
// Outlier channels (LLM.int8()'s decomposition, troupe.compression.quantize): k input channels
// stay fp32. Each token is quantized without them (zeros there, so its scale ignores them),
// and the epilogue adds x[:, channels] @ W[:, channels]^T from an fp32 (k, N) copy of those
// weight columns: one call instead of the clone, zeroing, gather and fp32 GEMM beside it.
//
// The kernel lives in this header so that a whole decode step (decode_layer.cpp) can run it
// without a call through Python; int8_gemm.cpp binds it for torch.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cfloat>
#include <cstring>
#include <vector>

#include "vnni.h"

#if TROUPE_VNNI
namespace troupe_int8 {

constexpr int MR = 6, NR = 4, PF = 48;

// the fp32 side of the outlier channels: this tile's tokens' values there (k a token) and
// the weights' (k, N) rows; k == 0 when there are none
struct Outliers {
  const float *x;
  int64_t k;
  const float *w;
};

// Row m of x (K floats) -> K unsigned bytes round(x / s) + 128 and s = max|x| / 127 (as
// quantize_tokens does: the same division and round-half-to-even, so the same integers).
inline void quantize_row(const float *x, int64_t K, uint8_t *u, float *scale) {
  const __mmask16 tail = tail_mask(K);
  const float s = std::max(row_absmax(x, K) / 127.0f, FLT_MIN);
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127),
                shift = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : tail;
    __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + k), sv));
    q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), shift);
    _mm_mask_storeu_epi8(u + k, m, _mm512_cvtepi32_epi8(q));
  }
}

// The per-column constants of outputs n .. n+15 (those below N): the shift the unsigned
// activations add (128 x the column sums), the weights' scales and the bias (zeros without one)
struct Columns {
  __mmask16 keep;
  __m512i shift;
  __m512 scale, bias;
};

inline Columns columns(int64_t n, int64_t N, const int32_t *colsum, const float *sw,
                       const float *bias) {
  const __mmask16 keep = N - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
  return {keep, _mm512_slli_epi32(_mm512_maskz_loadu_epi32(keep, colsum + n), 7),
          _mm512_maskz_loadu_ps(keep, sw + n),
          bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps()};
}

// One token's outputs n .. n+15 from its exact integer sums: (acc * s_x) * s_w + b, in the
// order int8_linear's torch ops use, bit-identical (explicit rounding: never contracted into an
// FMA), + the fp32 outlier channels (``xo``: the token's k values there)
inline void finish(const Columns &c, __m512i sum, float sx, bool bias, const float *xo,
                   const Outliers &ol, int64_t N, int64_t n, float *out) {
  constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, c.shift));
  v = _mm512_mul_round_ps(_mm512_mul_round_ps(v, _mm512_set1_ps(sx), RN), c.scale, RN);
  if (bias) v = _mm512_add_round_ps(v, c.bias, RN);
  for (int64_t j = 0; j < ol.k; j++)
    v = _mm512_fmadd_ps(_mm512_set1_ps(xo[j]), _mm512_maskz_loadu_ps(c.keep, ol.w + j * N + n), v);
  _mm512_mask_storeu_ps(out, c.keep, v);
}

// y[m0:m0+R, 16 b0 : 16 (b0+C)] for R tokens and C blocks of 16 outputs.
template <int R, int C>
void tile(const uint8_t *u, const float *sx, int64_t K, const int8_t *wp, const int32_t *colsum,
          const float *sw, const float *bias, int64_t b0, int64_t N, float *y, Outliers ol) {
  const int64_t KQ = K / 4;
  const int8_t *w = wp + b0 * KQ * 64;
  // every loop over i and j is unrolled (the pragmas), or GCC keeps the accumulator array
  // on the stack, a load and a store around every vpdpbusd
  __m512i acc[R][C];
#pragma GCC unroll 8
  for (int i = 0; i < R; i++)
#pragma GCC unroll 4
    for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_si512();
  for (int64_t k = 0; k < KQ; k++) {
    __m512i wv[C];
#pragma GCC unroll 4
    for (int j = 0; j < C; j++) {
      // weights come from memory once per call: ask for them PF steps ahead, or with many
      // tokens per step the hardware prefetcher leaves a decode step waiting on DRAM
      _mm_prefetch((const char *)(w + (j * KQ + k + PF) * 64), _MM_HINT_T0);
      wv[j] = _mm512_loadu_si512(w + (j * KQ + k) * 64);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
      int32_t four;
      std::memcpy(&four, u + i * K + 4 * k, 4);
      const __m512i a = _mm512_set1_epi32(four);
#pragma GCC unroll 4
      for (int j = 0; j < C; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], a, wv[j]);
    }
  }
  // the epilogue reads the sums back from a small buffer: GCC keeps them in registers
  // through the loop above only while nothing but whole-array stores follows it
  alignas(64) int32_t sums[R][C * 16];
#pragma GCC unroll 8
  for (int i = 0; i < R; i++)
#pragma GCC unroll 4
    for (int j = 0; j < C; j++) _mm512_store_si512(sums[i] + j * 16, acc[i][j]);
  for (int j = 0; j < C; j++) {
    const int64_t n = (b0 + j) * 16;
    const Columns c = columns(n, N, colsum, sw, bias);
    for (int i = 0; i < R; i++)
      finish(c, _mm512_load_si512(sums[i] + j * 16), sx[i], bias, ol.x + i * ol.k, ol, N, n,
             y + i * N + n);
  }
}

// One token (a decode step at batch 1): a block of 16 outputs at a time, so each thread streams
// one run of weights (as small_gemm.h's one-row path; the tiles above read four blocks side
// by side and reached half the memory's bandwidth at this shape), four accumulators over
// consecutive groups of 4 inputs. The integer sums are exact and ``finish`` is the tiles' own
// epilogue: the same numbers, bit for bit.
inline void row1(const uint8_t *u, float sx, int64_t K, const int8_t *wp, const int32_t *colsum,
                 const float *sw, const float *bias, int64_t b0, int64_t b1, int64_t N, float *y,
                 Outliers ol) {
  const int64_t KQ = K / 4;
  for (int64_t b = b0; b < b1; b++) {
    const int8_t *w = wp + b * KQ * 64;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    auto four = [&](int64_t k) {
      int32_t v;
      std::memcpy(&v, u + 4 * k, 4);
      return _mm512_set1_epi32(v);
    };
    int64_t k = 0;
    for (; k + 4 <= KQ; k += 4) {
      a0 = _mm512_dpbusd_epi32(a0, four(k), _mm512_loadu_si512(w + k * 64));
      a1 = _mm512_dpbusd_epi32(a1, four(k + 1), _mm512_loadu_si512(w + k * 64 + 64));
      a2 = _mm512_dpbusd_epi32(a2, four(k + 2), _mm512_loadu_si512(w + k * 64 + 128));
      a3 = _mm512_dpbusd_epi32(a3, four(k + 3), _mm512_loadu_si512(w + k * 64 + 192));
    }
    for (; k < KQ; k++) a0 = _mm512_dpbusd_epi32(a0, four(k), _mm512_loadu_si512(w + k * 64));
    const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
    const int64_t n = b * 16;
    finish(columns(n, N, colsum, sw, bias), sum, sx, bias, ol.x, ol, N, n, y + n);
  }
}

template <int C>
void rows(int64_t r, const uint8_t *u, const float *sx, int64_t K, const int8_t *wp,
          const int32_t *cs, const float *sw, const float *b, int64_t b0, int64_t N, float *y,
          Outliers ol) {
  switch (r) {
    case 1: tile<1, C>(u, sx, K, wp, cs, sw, b, b0, N, y, ol); break;
    case 2: tile<2, C>(u, sx, K, wp, cs, sw, b, b0, N, y, ol); break;
    case 3: tile<3, C>(u, sx, K, wp, cs, sw, b, b0, N, y, ol); break;
    case 4: tile<4, C>(u, sx, K, wp, cs, sw, b, b0, N, y, ol); break;
    case 5: tile<5, C>(u, sx, K, wp, cs, sw, b, b0, N, y, ol); break;
    default: tile<6, C>(u, sx, K, wp, cs, sw, b, b0, N, y, ol); break;
  }
}


// y (M, n_out) = x (M, K) W^T, see int8_gemm.cpp's ``linear`` for the shapes; the outlier
// channels ``ch`` (k of them, k may be 0) with their fp32 weight rows ``rows_w`` (k, n_out)
inline void linear(const float *xp, int64_t M, int64_t K, const int8_t *w, int64_t NB,
                   const int32_t *cs, const float *sw, const float *b, int64_t n_out,
                   int64_t k, const int64_t *ch, const float *rows_w, float *yp) {
  std::vector<uint8_t> u(M * K);
  std::vector<float> sx(M), xo(M * k);
  uint8_t *up = u.data();
  float *sp = sx.data(), *xop = xo.data();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(k ? K : 0);
    for (int64_t m = m0; m < m1; m++) {
      const float *xm = xp + m * K;
      if (k) {  // the outlier channels set aside, zeros in their place
        std::memcpy(row.data(), xm, K * sizeof(float));
        for (int64_t c = 0; c < k; c++) {
          xop[m * k + c] = row[ch[c]];
          row[ch[c]] = 0.0f;
        }
        xm = row.data();
      }
      quantize_row(xm, K, up + m * K, sp + m);
    }
  });
  if (M == 1) {
    at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
      row1(up, sp[0], K, w, cs, sw, b, b0, b1, n_out, yp, Outliers{xop, k, rows_w});
    });
    return;
  }
  const int64_t panels = (NB + NR - 1) / NR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
      const int64_t b0 = p * NR, c = std::min<int64_t>(NR, NB - b0);
      for (int64_t m = 0; m < M;) {
        // 7 or 8 rows left: one pass of 8 x 2-block tiles when the panel is too large to be
        // read twice from L2 (K > 2048), else 4 + 4 rows (or 4 + 3) over the whole panel
        const int64_t left = M - m;
        const int64_t r = left <= MR ? left : left > 8 ? MR : K > 2048 ? left : 4;
        const uint8_t *um = up + m * K;
        const float *sm = sp + m;
        float *ym = yp + m * n_out;
        const Outliers ol{xop + m * k, k, rows_w};
        m += r;
        if (r > MR) {  // the last 7 or 8 rows: tiles of 2 blocks, the weight still read once
          for (int64_t j = b0; j < b0 + c; j += 2) {
            const bool two = j + 1 < b0 + c;
            if (r == 7) two ? tile<7, 2>(um, sm, K, w, cs, sw, b, j, n_out, ym, ol)
                            : tile<7, 1>(um, sm, K, w, cs, sw, b, j, n_out, ym, ol);
            else two ? tile<8, 2>(um, sm, K, w, cs, sw, b, j, n_out, ym, ol)
                     : tile<8, 1>(um, sm, K, w, cs, sw, b, j, n_out, ym, ol);
          }
          continue;
        }
        switch (c) {
          case 1: rows<1>(r, um, sm, K, w, cs, sw, b, b0, n_out, ym, ol); break;
          case 2: rows<2>(r, um, sm, K, w, cs, sw, b, b0, n_out, ym, ol); break;
          case 3: rows<3>(r, um, sm, K, w, cs, sw, b, b0, n_out, ym, ol); break;
          default: rows<4>(r, um, sm, K, w, cs, sw, b, b0, n_out, ym, ol); break;
        }
      }
    }
  });
}

}  // namespace troupe_int8
#endif
