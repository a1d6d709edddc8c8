// What the AVX-512 VNNI kernels share (int8_gemm.cpp, wq_gemm.cpp): whether this build has the
// instructions, and the largest magnitude of a token, from which each derives its scale.
#pragma once
#include <immintrin.h>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TROUPE_VNNI 1
#else
#define TROUPE_VNNI 0
#endif

inline bool available() { return TROUPE_VNNI; }

#if TROUPE_VNNI
// The lanes of the last, partial vector of a row of K floats (none when 16 divides K)
inline __mmask16 tail_mask(int64_t K) { return (__mmask16)((1u << (K % 16)) - 1); }

// max |x[k]| over a row of K floats
inline float row_absmax(const float *x, int64_t K) {
  __m512 amax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail_mask(K), x + k)));
  return _mm512_reduce_max_ps(amax);
}
#endif
