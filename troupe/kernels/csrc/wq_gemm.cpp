// Weight-only quantized linear layers (W8A16, W4A16) with AVX-512 VNNI: y = x dq(W)^T + b, W
// held as INT8 or INT4 in groups of `gs` inputs with one fp32 scale per (output, group).
//
// The activations are 16-bit: each token (row of x) becomes INT16 with its own scale
// s_t = max|x_t| / 32767, an error of at most 2^-16 of the row's largest value (fp16 keeps
// 2^-11 of each value; bf16 2^-8). The products are then exact integers: vpdpwssd multiplies
// pairs of INT16 and adds both products into each INT32 lane, 32 multiply-adds an instruction
// against fp32 FMA's 16, with the weight read at 1 or 1/2 byte a value. At the end of each
// group the INT32 sums are converted and scaled into fp32 accumulators (s_w of that group),
// and the output scaled once by s_t:
//     y[t, n] = s_t * sum_g s_w[n, g] * sum_{k in g} a[t, k] q[n, k] + b[n].
// INT32 cannot overflow: a group of gs <= 512 INT8 weights sums to < 512 * 32767 * 127 < 2^31.
//
// Packing, for each block of 16 output channels and each quad of 4 inputs k = 4 kq + 2 h + t
// (h, t in {0, 1}), so that one widened vector holds the 16 x 2 weights a vpdpwssd wants for
// the input pair (4 kq + 2 h, 4 kq + 2 h + 1):
//   INT8: (NB, K/4, 2, 16, 2) bytes [b][kq][h][n][t] = q[16 b + n, k], sign-extended to INT16;
//   INT4: (NB, K/4, 16, 2) bytes [b][kq][n][t] = (q[.., 4 kq + t] + 8) | (q[.., 4 kq + 2 + t]
//         + 8) << 4, zero-extended to INT16 words and split into the two nibbles with an AND
//         and a shift. The +8 (values 1..15) is taken back out per group with the token's
//         sums: sum_k a_k (u_k - 8) = sum_k a_k u_k - 8 sum_k a_k.
// Scales are packed (NB, K/gs, 16): the 16 outputs of a block for one group in one vector.
// A part of native.cpp (included there in a namespace of its own), its bindings in bind().
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cfloat>
#include <cstring>

#include "vnni.h"

#if TROUPE_VNNI
namespace {

constexpr int PF = 64;  // prefetch distance, in quads of inputs

// Row of x (K floats) -> K INT16 round(x / s), s = max|x| / 32767; and, for INT4 weights, the
// zero-point correction 8 * sum_{k in g} a_k of each group g.
void quantize_row(const float *x, int64_t K, int64_t gs, bool nibbles, int16_t *a, float *scale,
                  int32_t *corr) {
  const __mmask16 tail = tail_mask(K);
  const float s = std::max(row_absmax(x, K) / 32767.0f, FLT_MIN);
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i lo = _mm512_set1_epi32(-32767), hi = _mm512_set1_epi32(32767);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : tail;
    __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + k), sv));
    _mm512_mask_cvtepi32_storeu_epi16(a + k, m, _mm512_min_epi32(_mm512_max_epi32(q, lo), hi));
  }
  if (!nibbles) return;
  for (int64_t g = 0; g < K / gs; g++) {
    int32_t sum = 0;
    for (int64_t j = g * gs; j < (g + 1) * gs; j++) sum += a[j];
    corr[g] = 8 * sum;
  }
}

// y[0:R, 16 b0 : 16 (b0 + C)] for R tokens and C blocks of 16 outputs.
template <int R, int C, int BITS>
void tile(const int16_t *a, const float *sx, const int32_t *corr, int64_t K, int64_t gs,
          const uint8_t *wp, const float *ws, const float *bias, int64_t b0, int64_t N, float *y) {
  constexpr int64_t QB = BITS == 8 ? 64 : 32;  // bytes of one block's quad
  const int64_t KQ = K / 4, G = K / gs, QG = gs / 4;
  const uint8_t *w = wp + b0 * KQ * QB;
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  alignas(64) float out[R][C * 16] = {};
  for (int64_t g = 0; g < G; g++) {
    // every loop over i and j is unrolled (the pragmas), or GCC keeps the accumulators on the
    // stack, a load and a store around every vpdpwssd (as in int8_gemm.cpp)
    __m512i acc[R][C];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
      for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t kq = g * QG; kq < (g + 1) * QG; kq++) {
      __m512i w0[C], w1[C];  // the 16 x 2 weights of input pairs 2 kq and 2 kq + 1
#pragma GCC unroll 4
      for (int j = 0; j < C; j++) {
        const uint8_t *p = w + (j * KQ + kq) * QB;
        _mm_prefetch((const char *)(p + PF * QB), _MM_HINT_T0);
        if constexpr (BITS == 8) {
          w0[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
          w1[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32)));
        } else {
          const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
          w0[j] = _mm512_and_si512(u, nibble);
          w1[j] = _mm512_srli_epi16(u, 4);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; i++) {
        int32_t pair0, pair1;
        std::memcpy(&pair0, a + i * K + 4 * kq, 4);
        std::memcpy(&pair1, a + i * K + 4 * kq + 2, 4);
        const __m512i a0 = _mm512_set1_epi32(pair0), a1 = _mm512_set1_epi32(pair1);
#pragma GCC unroll 4
        for (int j = 0; j < C; j++) {
          acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], a0, w0[j]);
          acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], a1, w1[j]);
        }
      }
    }
    // the group's INT32 sums, zero point taken out, into the fp32 sums with the group's scale
#pragma GCC unroll 4
    for (int j = 0; j < C; j++) {
      const __m512 s = _mm512_loadu_ps(ws + ((b0 + j) * G + g) * 16);
#pragma GCC unroll 8
      for (int i = 0; i < R; i++) {
        __m512i v = acc[i][j];
        if constexpr (BITS == 4) v = _mm512_sub_epi32(v, _mm512_set1_epi32(corr[i * G + g]));
        float *o = out[i] + j * 16;
        _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, _mm512_load_ps(o)));
      }
    }
  }
  for (int j = 0; j < C; j++) {
    const int64_t n = (b0 + j) * 16;
    const __mmask16 keep = N - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
    for (int i = 0; i < R; i++) {
      const __m512 v = _mm512_fmadd_ps(_mm512_load_ps(out[i] + j * 16), _mm512_set1_ps(sx[i]), b);
      _mm512_mask_storeu_ps(y + i * N + n, keep, v);
    }
  }
}

struct Args {
  const int16_t *a;
  const float *sx;
  const int32_t *corr;
  int64_t K, gs;
  const uint8_t *w;
  const float *ws, *bias;
  int64_t N;
  float *y;
};

// r (<= 8) rows from row m, C blocks from block b0
template <int C, int BITS>
void rows(const Args &p, int64_t m, int64_t r, int64_t b0) {
  const int64_t G = p.K / p.gs;
  const int16_t *a = p.a + m * p.K;
  const float *sx = p.sx + m;
  const int32_t *corr = p.corr + m * G;
  float *y = p.y + m * p.N;
#define TROUPE_TILE(R) tile<R, C, BITS>(a, sx, corr, p.K, p.gs, p.w, p.ws, p.bias, b0, p.N, y)
  switch (r) {
    case 1: TROUPE_TILE(1); break;
    case 2: TROUPE_TILE(2); break;
    case 3: TROUPE_TILE(3); break;
    case 4: TROUPE_TILE(4); break;
    case 5: TROUPE_TILE(5); break;
    case 6: TROUPE_TILE(6); break;
    case 7: TROUPE_TILE(7); break;
    default: TROUPE_TILE(8); break;
  }
#undef TROUPE_TILE
}

template <int BITS>
void gemm(const Args &p, int64_t M, int64_t NB) {
  constexpr int NR = 2;  // blocks of 16 outputs a tile: 8 x 2 keeps 16 accumulators
  const int64_t panels = (NB + NR - 1) / NR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t q = p0; q < p1; q++) {
      const int64_t b0 = q * NR, c = std::min<int64_t>(NR, NB - b0);
      for (int64_t m = 0; m < M; m += 8) {
        const int64_t r = std::min<int64_t>(8, M - m);
        if (c == 2) rows<2, BITS>(p, m, r, b0);
        else rows<1, BITS>(p, m, r, b0);
      }
    }
  });
}

}  // namespace
#endif

// x (M, K) fp32; wp the packed weight (INT8: (NB, K/4, 2, 16, 2) int8; INT4: (NB, K/4, 16, 2)
// uint8), output channels past n_out zero; ws (NB, K/gs, 16) fp32 scales; bias (n_out) or
// none; gs a multiple of 4 dividing K, at most 512. Returns y (M, n_out) fp32.
at::Tensor linear(at::Tensor x, at::Tensor wp, int64_t bits, at::Tensor ws,
                  int64_t gs, c10::optional<at::Tensor> bias, int64_t n_out) {
#if TROUPE_VNNI
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "wq_gemm.linear: x must be a contiguous (M, K) float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0);
  TORCH_CHECK(bits == 8 || bits == 4, "wq_gemm.linear: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(wp.is_contiguous() && wp.size(1) * 4 == K, "wq_gemm.linear: x has K = ", K,
              ", the packed weight ", wp.size(1) * 4);
  TORCH_CHECK(gs > 0 && gs % 4 == 0 && gs <= 512 && K % gs == 0, "wq_gemm.linear: group size ",
              gs, " must be a multiple of 4 up to 512 dividing K = ", K);
  TORCH_CHECK(ws.is_contiguous() && ws.scalar_type() == at::kFloat &&
              ws.numel() == NB * (K / gs) * 16, "wq_gemm.linear: scales must be (", NB, ", ",
              K / gs, ", 16) float32");
  TORCH_CHECK(n_out <= NB * 16 && n_out > (NB - 1) * 16, "wq_gemm.linear: n_out ", n_out,
              " does not fit ", NB, " blocks of 16");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == n_out && bias->is_contiguous() &&
                                    bias->scalar_type() == at::kFloat),
              "wq_gemm.linear: bias needs ", n_out, " float32 values");
  auto a = at::empty({M, K}, x.options().dtype(at::kShort));
  auto sx = at::empty({M}, x.options());
  auto corr = at::empty({M, K / gs}, x.options().dtype(at::kInt));
  auto y = at::empty({M, n_out}, x.options());
  Args p{a.data_ptr<int16_t>(), sx.data_ptr<float>(), corr.data_ptr<int32_t>(), K, gs,
         static_cast<const uint8_t *>(wp.data_ptr()), ws.data_ptr<float>(),
         bias.has_value() ? bias->data_ptr<float>() : nullptr, n_out, y.data_ptr<float>()};
  const float *xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      quantize_row(xp + m * K, K, gs, bits == 4, a.data_ptr<int16_t>() + m * K,
                   sx.data_ptr<float>() + m, corr.data_ptr<int32_t>() + m * (K / gs));
  });
  if (bits == 8) gemm<8>(p, M, NB);
  else gemm<4>(p, M, NB);
  return y;
#else
  TORCH_CHECK(false, "wq_gemm.linear: this build has no AVX-512 VNNI");
#endif
}

void bind(pybind11::module_ m) {
  m.def("available", &available);
  m.def("linear", &linear);
}
