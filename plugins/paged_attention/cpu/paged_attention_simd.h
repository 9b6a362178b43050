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

// The vector the CPU holds in one register: 16 floats with AVX-512, else 8 (AVX2's ymm).
// NOTE: the attention loops (paged_attention_ort.cc, the int4 kernel's softmax) use these, not
// v16f: without AVX-512, GCC splits 16-lane vectors into two registers for plain arithmetic but
// moves them through memory once they spill or meet a broadcast scalar (the attention loops are
// full of both), and an AVX2 build spent its time storing and reloading them (a decode step 2x, a prompt chunk ~5x
// the AVX-512 build's time). Lane j of a 16-lane chunk is lane j % kReg of its register j / kReg,
// so a loop over registers does lane by lane what the 16-lane code did; the AVX-512 build's
// floats are unchanged by this, and the AVX2 build's differ from them by rounding (up to ~1e-6: the
// compiler fuses multiply-adds per target), as they did before.
#if defined(__AVX512F__)
typedef v16f vreg;
constexpr int kReg = 16;
#else
typedef float vreg __attribute__((vector_size(32)));
constexpr int kReg = 8;
#endif
typedef decltype(vreg{} < vreg{}) vregi;  // its lanes' int32 vector (comparison masks)
inline vreg load_reg(const float* p) {
  vreg v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// NOTE: intrinsics here: GCC turns __builtin_convertvector(int8 x16 -> float x16) into 16
// scalar conversions.
inline vreg load_reg(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  vreg v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  vreg v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else
  vreg v;
  for (int i = 0; i < kReg; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}
inline void store_reg(float* p, vreg v) { std::memcpy(p, &v, sizeof v); }
// hsum of the 16 lanes held as registers r[0] (and r[1] when kReg is 8): the additions of
// hsum(v16f), in its order
inline float hsum_regs(const vreg* r) {
#if defined(__AVX512F__)
  return hsum(r[0]);
#else
  vreg t = r[0] + r[1];  // lane i + lane i + 8
  t += __builtin_shuffle(t, vregi{4, 5, 6, 7, 0, 1, 2, 3});
  t += __builtin_shuffle(t, vregi{2, 3, 0, 1, 2, 3, 0, 1});
  return t[0] + t[1];
#endif
}
// the largest of the 16 lanes held as registers r[0] (and r[1])
inline float hmax_regs(const vreg* r) {
#if defined(__AVX512F__)
  v16f t = vmax(r[0], __builtin_shuffle(r[0], v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  t = vmax(t, __builtin_shuffle(t, v16i{4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
  t = vmax(t, __builtin_shuffle(t, v16i{2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
#else
  vreg t = r[0] > r[1] ? r[0] : r[1];
  vreg u = __builtin_shuffle(t, vregi{4, 5, 6, 7, 0, 1, 2, 3});
  t = t > u ? t : u;
  u = __builtin_shuffle(t, vregi{2, 3, 0, 1, 2, 3, 0, 1});
  t = t > u ? t : u;
#endif
  return std::max(t[0], t[1]);
}

// exp(x) for x <= 0 (scores minus their running max); x < -87 (and -inf) gives 0.
// Range reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial (Cephes expf).
// V: v16f or vreg (lane by lane the same floats).
template <typename V>
inline V vexp(V x) {
  using I = decltype(x < x);  // the lanes' int32 vector
  const V lo = V{} - 87.0f;
  I under = x < lo;
  x = x < lo ? lo : x;
  V t = x * 1.44269504088896341f + 12582912.0f;  // round to nearest via 1.5 * 2^23
  V n = t - 12582912.0f;
  V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  I e = (__builtin_convertvector(n, I) + 127) << 23;
  V two_n;
  std::memcpy(&two_n, &e, sizeof e);
  V y = p * two_n;
  return under ? V{} : y;
}
inline v16f exp16(v16f x) { return vexp(x); }

inline float to_f(float x) { return x; }
inline float to_f(int8_t x) { return static_cast<float>(x); }

// tanh(x) (Cephes tanhf): an odd polynomial for |x| < 0.625, else (1 - e) / (1 + e) with
// e = exp(-2|x|) (no cancellation there); relative error ~2e-7.
template <typename V>
inline V vtanh(V x) {
  const V a = x < 0.f ? -x : x;
  const V z = x * x;
  V p = V{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  p = p * z * x + x;
  const V e = vexp(-2.f * a);
  V r = (1.f - e) / (1.f + e);
  r = x < 0.f ? -r : r;
  return a < 0.625f ? p : r;
}

// Gemma 2's attention-logit soft-capping: cap * tanh(s / cap).
template <typename V>
inline V vsoftcap(V s, float cap) { return cap * vtanh(s * (1.f / cap)); }
inline v16f softcap16(v16f s, float cap) { return vsoftcap(s, cap); }

}  // namespace kvexport_simd
