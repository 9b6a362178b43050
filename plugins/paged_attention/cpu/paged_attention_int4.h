// int4 KV rows of the native CPU PagedAttention: quantize one (token, KV head) row into the
// pool's bytes and read rows back as float32. The format is kvexport/io.py KV_INT4_FORMAT and
// plugins/paged_attention/spec.py "INT4 KV"; reference.py quantize_int4 / dequantize_int4 are
// the definition this code matches byte for byte (tests/plugins/test_int4_kv.py).
//
//   row = [ codes + 8: head_dim / 2 bytes (channel 2i low nibble, 2i+1 high) | scale float16 LE per
//           group of 32 channels ]
//   x ≈ code * scale, code in -8..7, the group's extreme at -8 (llama.cpp's q4_0): the product has
//   <= 15 significant bits, so it is exact in float32.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvexport_int4 {

constexpr int64_t kGroup = 32;                    // channels per scale: io.KV_INT4_GROUP
constexpr float kMinScale = 6.103515625e-05f;     // 2^-14, the smallest normal float16
constexpr float kF16Max = 65504.f;

// Marks int4 pools in the kernels' templates; one byte, so pointer arithmetic counts bytes.
struct Int4 {
  uint8_t byte;
};

inline int64_t row_bytes(int64_t d) { return d / 2 + 2 * (d / kGroup); }

// IEEE float16 bits -> float32 (exact).
inline float h2f(uint32_t h) {
  const uint32_t e = (h >> 10) & 31, m = h & 1023;
  float v;
  if (e == 0)
    v = std::ldexp(static_cast<float>(m), -24);
  else if (e == 31)
    v = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else
    v = std::ldexp(static_cast<float>(m + 1024), static_cast<int>(e) - 25);
  return (h & 0x8000) ? -v : v;
}

// float32 -> float16 bits, round to nearest even, saturating at ±65504 (as reference._f16).
inline uint16_t f2h(float f) {
  f = std::min(kF16Max, std::max(-kF16Max, f));
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000;
  const float a = std::fabs(f);
  if (a < kMinScale)  // zero or subnormal: whole units of 2^-24 (a * 2^24 is exact); 1024 = the smallest normal
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.f)));
  const uint32_t ax = x & 0x7FFFFFFFu;
  const uint32_t m = ax & 0x7FFFFFu;
  uint32_t h = (((ax >> 23) - 112) << 10) | (m >> 13);  // exponent rebiased 127 -> 15
  const uint32_t rest = m & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | h);
}

// x [d] float32 -> one pool row [row_bytes(d)].
inline void quantize_row(const float* x, int64_t d, uint8_t* row) {
  uint8_t* sm = row + d / 2;
  for (int64_t g = 0; g < d / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    float lo = xg[0], hi = xg[0];
    for (int64_t i = 1; i < kGroup; ++i) {
      lo = std::min(lo, xg[i]);
      hi = std::max(hi, xg[i]);
    }
    const bool pos = hi >= -lo;  // the extreme is the maximum (ties: the maximum); it maps to -8
    const uint16_t mag = f2h(std::max((pos ? hi : -lo) / 8.f, kMinScale));
    const uint16_t sb = pos ? static_cast<uint16_t>(mag | 0x8000) : mag;
    const float scale = h2f(sb);
    uint8_t* codes = row + g * kGroup / 2;
    for (int64_t i = 0; i < kGroup; i += 2) {
      const float c0 = std::min(7.f, std::max(-8.f, std::nearbyint(xg[i] / scale))) + 8.f;
      const float c1 = std::min(7.f, std::max(-8.f, std::nearbyint(xg[i + 1] / scale))) + 8.f;
      codes[i / 2] = static_cast<uint8_t>(static_cast<uint32_t>(c0) | (static_cast<uint32_t>(c1) << 4));
    }
    sm[2 * g] = sb & 0xFF;
    sm[2 * g + 1] = sb >> 8;
  }
}

// n rows (stride `stride` bytes) -> out [n][d] float32.
inline void dequantize_rows(const Int4* rows, int64_t n, int64_t d, int64_t stride, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* row = &rows[j * stride].byte;
    const uint8_t* sm = row + d / 2;
    float* o = out + j * d;
    for (int64_t g = 0; g < d / kGroup; ++g) {
      const float scale = h2f(sm[2 * g] | (sm[2 * g + 1] << 8));
      const uint8_t* codes = row + g * kGroup / 2;
      float* og = o + g * kGroup;
#if defined(__AVX2__)
      // NOTE: the same values as the scalar loop below: (nibble - 8) is an exact integer and its
      // product with the scale is exact in float32 (<= 15 significant bits). 16 code bytes ->
      // channels 0..31 (byte i: channel 2i low nibble, 2i + 1 high).
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
      const __m128i mask = _mm_set1_epi8(15);
      const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
      const __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi);  // channels 0..15, 16..31
      const __m256 s = _mm256_set1_ps(scale);
      const __m256i eight = _mm256_set1_epi32(8);
      const __m128i parts[4] = {c0, _mm_srli_si128(c0, 8), c1, _mm_srli_si128(c1, 8)};
      for (int k = 0; k < 4; ++k) {
        const __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[k]), eight);
        _mm256_storeu_ps(og + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(v), s));
      }
#else
#pragma GCC unroll 16
      for (int64_t i = 0; i < kGroup / 2; ++i) {
        og[2 * i] = static_cast<float>(static_cast<int>(codes[i] & 15) - 8) * scale;
        og[2 * i + 1] = static_cast<float>(static_cast<int>(codes[i] >> 4) - 8) * scale;
      }
#endif
    }
  }
}

}  // namespace kvexport_int4
