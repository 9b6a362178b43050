// int4 KV rows of the native CPU PagedAttention: quantize one (token, KV head) row into the
// pool's bytes, read rows back as float32 (prompt tiles), and attend straight from the codes
// (decode). The format is kvexport/io.py KV_INT4_FORMAT and plugins/paged_attention/spec.py
// "INT4 KV"; reference.py quantize_int4 / dequantize_int4 are the definition this code matches
// byte for byte (tests/plugins/test_int4_kv.py, test_int4_kernels.py).
//
//   row = [ codes + 8: head_dim / 2 bytes (channel 2i low nibble, 2i+1 high) | scale float16 LE per
//           group of 32 channels ]
//   x ≈ code * scale, code in -8..7, the group's extreme at -8 (llama.cpp's q4_0): the product has
//   <= 15 significant bits, so it is exact in float32.
//
// Decode (attend_chunk): a group's 16 code bytes unpack in registers into the low nibbles (even
// channels) and the high ones (odd channels), already times the scale (AVX-512: two 16-lane
// table lookups; AVX2: four 8-lane conversions; otherwise plain C++); the query and the value
// accumulator are kept in that "group order" (to_group_order), so no dequantized row is ever
// written, and each key and value row is read once from the pool for all the task's query rows.
//
//   group order of one 32-channel group:  [ x0 x2 x4 .. x30 | x1 x3 .. x31 ]
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "paged_attention_simd.h"

namespace kvexport_int4 {

constexpr int64_t kGroup = 32;                    // channels per scale: io.KV_INT4_GROUP
constexpr float kMinScale = 6.103515625e-05f;     // 2^-14, the smallest normal float16
constexpr float kF16Max = 65504.f;
constexpr int kChunk = 16;    // keys per attend_chunk call (the kernels' W: one vector of scores)
constexpr int kMaxRows = 7;   // query rows of a decode task (paged_attention_ort.cc kRowsMin - 1)

// Marks int4 pools in the kernels' templates; one byte, so pointer arithmetic counts bytes.
struct Int4 {
  uint8_t byte;
};

inline int64_t row_bytes(int64_t d) { return d / 2 + 2 * (d / kGroup); }

// IEEE float16 bits -> float32 (exact): the fields moved into float32's, subnormals scaled.
inline float h2f(uint32_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(static_cast<unsigned short>(h));  // vcvtph2ps: exact too
#else
  const uint32_t e = (h >> 10) & 31, m = h & 1023, sign = (h & 0x8000u) << 16;
  uint32_t x;
  if (e == 0) {  // zero or subnormal: m * 2^-24 (exact)
    const float v = static_cast<float>(m) * 5.9604644775390625e-08f;
    std::memcpy(&x, &v, sizeof x);
  } else if (e == 31) {
    x = 0x7F800000u | (m << 13);  // infinity, or a NaN (the payload kept)
  } else {
    x = ((e + 112) << 23) | (m << 13);  // exponent rebiased 15 -> 127
  }
  x |= sign;
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
#endif
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

// x [d] (d a multiple of 32) from channel order to group order, in place; from_group_order undoes it.
inline void to_group_order(float* x, int64_t d) {
  float t[kGroup];
  for (int64_t g = 0; g < d; g += kGroup) {
    for (int64_t i = 0; i < kGroup / 2; ++i) {
      t[i] = x[g + 2 * i];
      t[kGroup / 2 + i] = x[g + 2 * i + 1];
    }
    std::memcpy(x + g, t, sizeof t);
  }
}
inline void from_group_order(float* x, int64_t d) {
  float t[kGroup];
  for (int64_t g = 0; g < d; g += kGroup) {
    for (int64_t i = 0; i < kGroup / 2; ++i) {
      t[2 * i] = x[g + i];
      t[2 * i + 1] = x[g + kGroup / 2 + i];
    }
    std::memcpy(x + g, t, sizeof t);
  }
}

using kvexport_simd::v16f;
using kvexport_simd::v16i;
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

// The decode kernel's vector: one register, 16 lanes with AVX-512, else 8 (kvexport_simd::vreg's
// NOTE).
using vec = kvexport_simd::vreg;
constexpr int kLanes = kvexport_simd::kReg;
constexpr int kPerGroup = kGroup / kLanes;  // vectors per group

using kvexport_simd::load_reg;
using kvexport_simd::store_reg;

// Group g of one row -> out[kPerGroup]: its 32 values in group order (even channels 0, 2, .., 30,
// then odd ones 1, 3, .., 31), each (code - 8) * scale: the same float32 values as dequantize_rows
// (exact products).
inline void decode_group(const uint8_t* row, int64_t d, int64_t g, vec* out) {
  const uint8_t* codes = row + g * kGroup / 2;
  const float scale = h2f(row[d / 2 + 2 * g] | (row[d / 2 + 2 * g + 1] << 8));
#if defined(__AVX512F__)
  // NOTE: vpermps reads the low 4 bits of each index lane, so a zero-extended byte indexes the
  // table of (c - 8) * scale, c = 0..15, by its low nibble; shifted right by 4, by its high one.
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512 table = _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7),
                                     _mm512_set1_ps(scale));
  out[0] = static_cast<vec>(_mm512_permutexvar_ps(b, table));
  out[1] = static_cast<vec>(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));  // bytes 0..7, 8..15
  const __m256i m15 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  const __m256 s = _mm256_set1_ps(scale);
  out[0] = static_cast<vec>(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(lo, m15), eight)), s));
  out[1] = static_cast<vec>(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(hi, m15), eight)), s));
  out[2] = static_cast<vec>(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(lo, 4), eight)), s));
  out[3] = static_cast<vec>(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(hi, 4), eight)), s));
#else
  alignas(32) float t[kGroup];
  for (int i = 0; i < kGroup / 2; ++i) {
    t[i] = static_cast<float>(static_cast<int>(codes[i] & 15) - 8) * scale;
    t[kGroup / 2 + i] = static_cast<float>(static_cast<int>(codes[i] >> 4) - 8) * scale;
  }
  for (int i = 0; i < kPerGroup; ++i) out[i] = load_reg(t + i * kLanes);
#endif
}

// sums[j] = the sum of a[j]'s lanes, for kChunk vectors at once: halving steps, each adding the
// two halves of a pair of vectors side by side (~3 shuffles and adds a key, not a log-step sum
// each). NOTE: the steps leave key j in lane bitreverse(j); the last shuffle puts it back.
inline void sum_each(const v16f* a, float* sums) {
  v16f b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], v16i{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], v16i{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], v16i{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
           __builtin_shuffle(b[2 * i], b[2 * i + 1], v16i{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], v16i{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
           __builtin_shuffle(c[2 * i], c[2 * i + 1], v16i{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  const v16f f = __builtin_shuffle(e[0], e[1], v16i{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
                 __builtin_shuffle(e[0], e[1], v16i{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
  kvexport_simd::store16(sums, __builtin_shuffle(f, v16i{0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15}));
}
inline void sum_each(const v8f* a, float* sums) {
  for (int h = 0; h < 2; ++h, a += 8) {  // keys 0..7, 8..15
    v8f b[4], c[2];
    for (int i = 0; i < 4; ++i)
      b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], v8i{0, 1, 2, 3, 8, 9, 10, 11}) +
             __builtin_shuffle(a[2 * i], a[2 * i + 1], v8i{4, 5, 6, 7, 12, 13, 14, 15});
    for (int i = 0; i < 2; ++i)
      c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], v8i{0, 1, 8, 9, 4, 5, 12, 13}) +
             __builtin_shuffle(b[2 * i], b[2 * i + 1], v8i{2, 3, 10, 11, 6, 7, 14, 15});
    const v8f f = __builtin_shuffle(c[0], c[1], v8i{0, 8, 2, 10, 4, 12, 6, 14}) +
                  __builtin_shuffle(c[0], c[1], v8i{1, 9, 3, 11, 5, 13, 7, 15});
    const v8f t = __builtin_shuffle(f, v8i{0, 4, 2, 6, 1, 5, 3, 7});
    std::memcpy(sums + 8 * h, &t, sizeof t);
  }
}

// One chunk of a decode task, straight from the pool: up to kChunk consecutive int4 rows (key and
// value row j at k / v + j * stride bytes) for R <= kMaxRows query rows, online softmax in float32
// as the float kernels do it. Row r sees the chunk's keys [lo[r], hi[r]] (lo > hi: none; only keys
// some row sees are read). q [R][d]: scaled queries, acc [R][d]: unnormalised outputs, both in
// group order; m, l [R]: running max and denominator.
//
//   per key j (read once):  k_j -> kPerGroup vectors a group -> FMAs into every row's partial sums
//   per row:                16 partial sums -> 16 scores (sum_each) -> softcap, mask, exp
//   per group, per key j:   v_j's group -> FMAs into every row's accumulator (registers)
//
// NOTE: R (the row count) is a template argument so that the rows' partial sums and accumulators
// are exactly R (x kPerGroup) registers.
template <int R>
void attend_chunk_rows(const float* q, int64_t d, const uint8_t* k, const uint8_t* v, int64_t stride, const int* lo,
                       const int* hi, float softcap, float* m, float* l, float* acc) {
  using namespace kvexport_simd;
  int j0 = kChunk, j1 = -1;  // the keys any row sees
  for (int r = 0; r < R; ++r)
    if (lo[r] <= hi[r]) {
      j0 = std::min(j0, lo[r]);
      j1 = std::max(j1, hi[r]);
    }
  if (j0 > j1) return;
  const int64_t groups = d / kGroup;
  vec part[R][kChunk];  // [row][key] per-lane partial sums of q . k
  for (int j = 0; j < kChunk; ++j) {
    if (j < j0 || j > j1) {
      for (int r = 0; r < R; ++r) part[r][j] = vec{};
      continue;
    }
    const uint8_t* row = k + j * stride;
    vec s[R];
#pragma GCC unroll 7
    for (int r = 0; r < R; ++r) s[r] = vec{};
    for (int64_t g = 0; g < groups; ++g) {
      vec x[kPerGroup];
      decode_group(row, d, g, x);
#pragma GCC unroll 7
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int i = 0; i < kPerGroup; ++i) s[r] += load_reg(q + r * d + g * kGroup + i * kLanes) * x[i];
    }
    for (int r = 0; r < R; ++r) part[r][j] = s[r];
  }
  alignas(64) float p[R][kChunk];  // probabilities (0 where a row does not see the key)
  float alpha[R];
  // the scores' softmax in registers (vreg: NOTE in paged_attention_simd.h), kChunk / kReg of them
  constexpr int C = kChunk / kReg;
  vregi lane[C];
  for (int i = 0; i < kChunk; ++i) lane[i / kReg][i % kReg] = i;
  for (int r = 0; r < R; ++r) {
    if (lo[r] > hi[r]) {  // nothing of this chunk: the row's state stays as it is
      alpha[r] = 1.f;
      for (int c = 0; c < C; ++c) store_reg(p[r] + c * kReg, vreg{});
      continue;
    }
    sum_each(part[r], p[r]);
    vreg s[C];
    for (int c = 0; c < C; ++c) {
      s[c] = load_reg(p[r] + c * kReg);
      if (softcap > 0.f) s[c] = vsoftcap(s[c], softcap);
      s[c] = (lane[c] >= lo[r]) & (lane[c] <= hi[r]) ? s[c] : vreg{} + kNegInf;
    }
    const float m_new = std::max(m[r], hmax_regs(s));
    alpha[r] = std::exp(m[r] - m_new);  // 0 on the first visible chunk
    vreg e[C];
    for (int c = 0; c < C; ++c) {
      e[c] = vexp(s[c] - m_new);
      store_reg(p[r] + c * kReg, e[c]);
    }
    l[r] = l[r] * alpha[r] + hsum_regs(e);
    m[r] = m_new;
  }
  for (int64_t g = 0; g < groups; ++g) {
    vec a[R][kPerGroup];
#pragma GCC unroll 7
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int i = 0; i < kPerGroup; ++i) a[r][i] = load_reg(acc + r * d + g * kGroup + i * kLanes) * alpha[r];
    for (int j = j0; j <= j1; ++j) {
      vec x[kPerGroup];
      decode_group(v + j * stride, d, g, x);
#pragma GCC unroll 7
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int i = 0; i < kPerGroup; ++i) a[r][i] += p[r][j] * x[i];
    }
#pragma GCC unroll 7
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int i = 0; i < kPerGroup; ++i) store_reg(acc + r * d + g * kGroup + i * kLanes, a[r][i]);
  }
}

inline void attend_chunk(const float* q, int rows, int64_t d, const uint8_t* k, const uint8_t* v, int64_t stride,
                         const int* lo, const int* hi, float softcap, float* m, float* l, float* acc) {
  static_assert(kMaxRows == 7, "one case per row count below");
  switch (rows) {
    case 1: return attend_chunk_rows<1>(q, d, k, v, stride, lo, hi, softcap, m, l, acc);
    case 2: return attend_chunk_rows<2>(q, d, k, v, stride, lo, hi, softcap, m, l, acc);
    case 3: return attend_chunk_rows<3>(q, d, k, v, stride, lo, hi, softcap, m, l, acc);
    case 4: return attend_chunk_rows<4>(q, d, k, v, stride, lo, hi, softcap, m, l, acc);
    case 5: return attend_chunk_rows<5>(q, d, k, v, stride, lo, hi, softcap, m, l, acc);
    case 6: return attend_chunk_rows<6>(q, d, k, v, stride, lo, hi, softcap, m, l, acc);
    case 7: return attend_chunk_rows<7>(q, d, k, v, stride, lo, hi, softcap, m, l, acc);
    default: return;  // attend_dots never has more (static_assert in paged_attention_ort.cc)
  }
}

}  // namespace kvexport_int4
