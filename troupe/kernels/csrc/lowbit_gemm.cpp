// Ternary and binary linear layers with AVX-512 VNNI: y = dq(q(x) W^T) + b, where each token
// (row of x) is quantized to INT8 with its own scale (max|x_t| / 127, as quantize_tokens does)
// and W = unpack(packed) * scales[:, None] is held at 1.6 bits a weight (ternary: five trits a
// byte, troupe/kernels/lowbit.py) or 1 bit (binary: eight signs a byte). The integer sums are
// exact, and the rescale runs in the order of lowbit_linear_reference's torch ops: the result
// equals it bit for bit.
//
// No weight is ever unpacked to memory. Byte j of a ternary row holds weights 5j .. 5j+4, trit
// i of it being d_i = ((byte * 3^i) mod 256) * 3 >> 8 in {0, 1, 2} (weight d_i - 1). Decoding
// plane i of 64 bytes at once is two byte additions (times 3, wrapping) and two unsigned
// compares: d = [v >= 86] + [v >= 171] for v = byte * 3^i mod 256. The token is laid out in the
// same planes once per call (plane i, position j holds x[5j + i]), so byte j's trit i meets
// the token's value at plane i, position j, and vpdpbusd (unsigned bytes times signed bytes,
// four pairs into each INT32 lane) sums d_i x; the -1 comes back out once per token:
// sum_k (d_k - 1) x_k = sum_k d_k x_k - sum_k x_k. Binary rows likewise with eight planes of
// bits (set: +1): sum_k (2 b_k - 1) x_k = 2 sum_k b_k x_k - sum_k x_k.
//
// The weights are held in blocks of 16 rows, four bytes of each row side by side in a 64-byte
// vector (block_layout in troupe/kernels/lowbit.py, as int8_gemm.cpp's packing): one vpdpbusd
// of a decoded plane against a token's four values (a 32-bit broadcast) adds into the 16 rows'
// sums at once, with no horizontal reduction. Blocks are split over torch's intra-op threads
// (at::parallel_for); each load of weights serves up to 8 tokens.
// A part of native.cpp (included there in a namespace of its own), its bindings in bind().
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cfloat>
#include <cstring>

#include "vnni.h"

#if TROUPE_VNNI
namespace {

constexpr int TERNARY = 0, BINARY = 1, MAX_TOKENS = 8, ROWS = 16;

// Row m of x (K floats) -> the planes of its INT8 values (plane p, position j: q[P j + p]; zeros
// past K), its scale and the sum of its values.
void quantize_planes(const float *x, int64_t K, int P, int64_t stride, int8_t *planes,
                     float *scale, int32_t *sum) {
  const float s = std::max(row_absmax(x, K) / 127.0f, FLT_MIN);
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  alignas(64) int32_t q[16];  // (planes: the caller's zeros past K)
  int32_t total = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : tail_mask(K);
    __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + k), sv));
    v = _mm512_maskz_mov_epi32(m, _mm512_min_epi32(_mm512_max_epi32(v, lo), hi));
    total += _mm512_reduce_add_epi32(v);
    _mm512_store_si512(q, v);
    for (int64_t c = k; c < std::min<int64_t>(k + 16, K); c++)
      planes[(c % P) * stride + c / P] = (int8_t)q[c - k];
  }
  *sum = total;
}

// plane p of 64 packed bytes, each weight as an unsigned byte: ternary d in {0, 1, 2} (``v``
// is byte * 3^p mod 256, advanced by the caller); binary bit p (most significant first)
inline __m512i ternary_plane(__m512i v) {
  const __m512i one = _mm512_set1_epi8(1);
  const __m512i d = _mm512_maskz_mov_epi8(_mm512_cmpge_epu8_mask(v, _mm512_set1_epi8((char)86)),
                                          one);
  return _mm512_mask_add_epi8(d, _mm512_cmpge_epu8_mask(v, _mm512_set1_epi8((char)171)), d, one);
}

inline __m512i binary_plane(__m512i bytes, int p) {
  return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(bytes, _mm512_set1_epi8((char)(0x80 >> p))),
                               _mm512_set1_epi8(1));
}

// acc[r] (16 INT32 lanes: the block's 16 rows) += the block's decoded weights times R tokens'
// values. The block is (Q, 16, 4) bytes: quad q of each row's packed bytes, rows side by side,
// so one 64-byte load holds four bytes of each of 16 rows; token r's plane p holds its values
// at xp + r * tok_stride + p * stride, and the four it meets there are one 32-bit broadcast.
template <int KIND, int R>
void block_sums(const uint8_t *w, int64_t Q, const int8_t *xp, int64_t stride,
                int64_t tok_stride, __m512i *out) {
  constexpr int P = KIND == TERNARY ? 5 : 8;
  __m512i acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
  for (int64_t q = 0; q < Q; q++) {
    __m512i v = _mm512_loadu_si512(w + q * 64);
#pragma GCC unroll 8
    for (int p = 0; p < P; p++) {
      __m512i d;
      if constexpr (KIND == TERNARY) {
        d = ternary_plane(v);
        v = _mm512_add_epi8(v, _mm512_add_epi8(v, v));  // * 3, mod 256
      } else {
        d = binary_plane(v, p);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; r++) {
        int32_t four;
        std::memcpy(&four, xp + r * tok_stride + p * stride + 4 * q, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], d, _mm512_set1_epi32(four));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) out[r] = acc[r];
}

template <int KIND>
void block_for(int r, const uint8_t *w, int64_t Q, const int8_t *xp, int64_t stride,
               int64_t tok_stride, __m512i *out) {
  switch (r) {
    case 1: block_sums<KIND, 1>(w, Q, xp, stride, tok_stride, out); break;
    case 2: block_sums<KIND, 2>(w, Q, xp, stride, tok_stride, out); break;
    case 3: block_sums<KIND, 3>(w, Q, xp, stride, tok_stride, out); break;
    case 4: block_sums<KIND, 4>(w, Q, xp, stride, tok_stride, out); break;
    case 5: block_sums<KIND, 5>(w, Q, xp, stride, tok_stride, out); break;
    case 6: block_sums<KIND, 6>(w, Q, xp, stride, tok_stride, out); break;
    case 7: block_sums<KIND, 7>(w, Q, xp, stride, tok_stride, out); break;
    default: block_sums<KIND, 8>(w, Q, xp, stride, tok_stride, out); break;
  }
}

}  // namespace
#endif

// x (M, K) fp32; packed (NB, Q, 16, 4) uint8: rows of Mb = ceil(K / 5) (kind 0, ternary) or
// ceil(K / 8) (kind 1, binary) bytes padded to Q = ceil(Mb / 4) quads, blocks of 16 rows
// (troupe/kernels/lowbit.py: block_layout; rows past n_out zero); scales and bias (n_out) fp32
// (bias may be absent), 16 (NB - 1) < n_out <= 16 NB. Returns y (M, n_out) fp32.
at::Tensor linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                  c10::optional<at::Tensor> bias, int64_t kind, int64_t n_out) {
#if TROUPE_VNNI
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "lowbit_gemm.linear: x must be a contiguous (M, K) float32 tensor");
  TORCH_CHECK(kind == TERNARY || kind == BINARY, "lowbit_gemm.linear: kind 0 or 1, got ", kind);
  const int64_t M = x.size(0), K = x.size(1);
  const int P = kind == TERNARY ? 5 : 8;
  const int64_t Mb = (K + P - 1) / P, Q = (Mb + 3) / 4;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(1) == Q && packed.size(2) == ROWS && packed.size(3) == 4,
              "lowbit_gemm.linear: packed must be contiguous uint8 (NB, ", Q, ", 16, 4) for K = ",
              K);
  const int64_t NB = packed.size(0), N = n_out;
  TORCH_CHECK(N <= NB * ROWS && N > (NB - 1) * ROWS, "lowbit_gemm.linear: n_out ", N,
              " does not fit ", NB, " blocks of 16");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.numel() == N && (!bias.has_value() || (bias->numel() == N &&
              bias->scalar_type() == at::kFloat && bias->is_contiguous())),
              "lowbit_gemm.linear: scales and bias need ", N, " float32 values");
  const int64_t stride = Q * 4;  // a plane: whole quads, zeros past K
  auto planes = at::zeros({M, P * stride}, x.options().dtype(at::kChar));
  auto sx = at::empty({M}, x.options());
  auto sq = at::empty({M}, x.options().dtype(at::kInt));
  auto y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>();
  int8_t *pp = planes.data_ptr<int8_t>();
  float *sxp = sx.data_ptr<float>();
  int32_t *sqp = sq.data_ptr<int32_t>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      quantize_planes(xp + m * K, K, P, stride, pp + m * P * stride, sxp + m, sqp + m);
  });
  const uint8_t *w = packed.data_ptr<uint8_t>();
  const float *sw = scales.data_ptr<float>();
  const float *b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float *yp = y.data_ptr<float>();
  constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    __m512i sums[MAX_TOKENS];
    for (int64_t blk = b0; blk < b1; blk++) {
      const int64_t n0 = blk * ROWS, rows = std::min<int64_t>(ROWS, N - n0);
      const __mmask16 keep = (__mmask16)((1u << rows) - 1);
      const __m512 s = _mm512_maskz_loadu_ps(keep, sw + n0);
      const __m512 bv = b ? _mm512_maskz_loadu_ps(keep, b + n0) : _mm512_setzero_ps();
      const uint8_t *wb = w + blk * Q * 64;
      for (int64_t m = 0; m < M; m += MAX_TOKENS) {
        const int r = (int)std::min<int64_t>(MAX_TOKENS, M - m);
        const int8_t *xm = pp + m * P * stride;
        if (kind == TERNARY) block_for<TERNARY>(r, wb, Q, xm, stride, P * stride, sums);
        else block_for<BINARY>(r, wb, Q, xm, stride, P * stride, sums);
        for (int t = 0; t < r; t++) {
          // the weights' -1 taken back out, then (sum * s_x) * s_w + b, in the order of the
          // torch reference (explicit rounding: never contracted into an FMA)
          __m512i acc = sums[t];
          if (kind == BINARY) acc = _mm512_add_epi32(acc, acc);
          acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(sqp[m + t]));
          __m512 v = _mm512_mul_round_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(sxp[m + t]), RN);
          v = _mm512_mul_round_ps(v, s, RN);
          if (b) v = _mm512_add_round_ps(v, bv, RN);
          _mm512_mask_storeu_ps(yp + (m + t) * N + n0, keep, v);
        }
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "lowbit_gemm.linear: this build has no AVX-512 VNNI");
#endif
}

void bind(pybind11::module_ m) {
  m.def("available", &available);
  m.def("linear", &linear);
}
