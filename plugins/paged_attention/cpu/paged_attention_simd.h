// Vector helpers of the native CPU PagedAttention (paged_attention_ort.cc): 16-lane float
// vectors (GCC vector extensions), int8 loads, horizontal sum, exp and tanh polynomials.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <limits>

namespace kvexport_simd {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// NOTE: intrinsics here: GCC turns __builtin_convertvector(int8 x16 -> float x16) into 16
// scalar conversions.
inline v16f load16(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  v16f v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  v16f v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
#else
  v16f v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}
inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(v16f v) {  // log-step horizontal sum
  v16f t = v + __builtin_shuffle(v, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  t += __builtin_shuffle(t, v16i{4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
  t += __builtin_shuffle(t, v16i{2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
  return t[0] + t[1];
}
inline v16f splat(float x) { return v16f{} + x; }
inline v16f vmax(v16f a, v16f b) { return a > b ? a : b; }
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (scores minus their running max); x < -87 (and -inf) gives 0.
// Range reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial (Cephes expf).
inline v16f exp16(v16f x) {
  const v16f lo = splat(-87.0f);
  v16i under = x < lo;
  x = x < lo ? lo : x;
  v16f t = x * 1.44269504088896341f + 12582912.0f;  // round to nearest via 1.5 * 2^23
  v16f n = t - 12582912.0f;
  v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16f p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f two_n;
  std::memcpy(&two_n, &e, sizeof e);
  v16f y = p * two_n;
  return under ? splat(0.f) : y;
}

inline float to_f(float x) { return x; }
inline float to_f(int8_t x) { return static_cast<float>(x); }

// tanh(x) (Cephes tanhf): an odd polynomial for |x| < 0.625, else (1 - e) / (1 + e) with
// e = exp(-2|x|) (no cancellation there); relative error ~2e-7.
inline v16f tanh16(v16f x) {
  const v16f a = x < 0.f ? -x : x;
  const v16f z = x * x;
  v16f p = splat(-5.70498872745e-3f);
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  p = p * z * x + x;
  const v16f e = exp16(-2.f * a);
  v16f r = (1.f - e) / (1.f + e);
  r = x < 0.f ? -r : r;
  return a < 0.625f ? p : r;
}

// Gemma 2's attention-logit soft-capping: cap * tanh(s / cap).
inline v16f softcap16(v16f s, float cap) { return cap * tanh16(s * (1.f / cap)); }

}  // namespace kvexport_simd
