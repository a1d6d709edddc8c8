// 64-byte float vectors (GCC's vector extensions: AVX-512 where the CPU has it, pairs of AVX2
// ops where not) and the exp both decode kernels need (decode_attention.cpp, decode_layer.cpp).
#pragma once
#include <cstdint>
#include <cstring>

namespace troupe_vec {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
inline v16 ld(const float *p) { v16 v; std::memcpy(&v, p, 64); return v; }
inline void st(float *p, v16 v) { std::memcpy(p, &v, 64); }
inline v16 splat(float x) { return (v16){0} + x; }

// e^x for x <= 0 (scores minus their max); below -87 the result is 0
inline v16 exp_nonpositive(v16 x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const v16 n = __builtin_convertvector(
      __builtin_convertvector(x * 1.44269504088896341f + splat(-0.5f), i16v), v16);  // round
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln2, in two parts
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, 64);
  return p * scale;
}

}  // namespace troupe_vec
