// kvexport::PagedMLA as a native onnxruntime custom op for the CPU execution provider:
// absorbed multi-head latent attention (DeepSeek-V2/V3) over a paged pool of latent rows.
//
// The contract is plugins/paged_mla/spec.py; reference.py is the executable definition this
// file is tested against (tests/plugins/test_mla_cpu_op.py). Compiled into the same library as
// PagedAttention (plugins/paged_attention/native.py) and registered in the same domain.
//
//   1. store: token t's row (latent [L] | k_rope [R], W = L + R) goes to slot_mapping[t] of the
//      pool [1, num_blocks, block_size, W] (int8: QuantizeLinear rounding with the per-channel
//      kv_scale; float16 / bfloat16: round to nearest even);
//   2. attend: every new token's H query heads attend causally to the sequence's rows, read
//      through the block table straight from the pool: s = scale * q_h · row (W channels),
//      out_h = softmax(s) · row[:L]. Every head reads the same rows (one "KV head"), so a task's
//      rows (tokens x heads) share each converted chunk of keys.
//
// Per chunk of 16 keys: the rows are converted to float32 once (int8 codes, half floats), the
// keys transposed to [W][16] so scores are 16-lane vectors over keys (broadcast query element,
// fused multiply-add; no horizontal sums), 4 query rows at a time; online softmax in float32
// (exp by paged_attention_simd.h's polynomial); the values [16][L] accumulated 4 rows x 16
// channels at a time. int8: the scales fold into the query (scores) and the output (values).
//
// Work: tasks of (sequence, tile of tokens, chunk of heads) — at most kRows rows — on
// onnxruntime's intra-op thread pool; decode tokens over long contexts are also split along the
// context (flash-decoding) and merged, so one long sequence still spreads over the threads.
// Outputs 1 is the updated pool: in place when the caller binds it to the input buffer
// (IOBinding, as the runtime does), else the input pool is copied first.
// Optional input 8 / output 2 (spec.py "Attention scores"): observation_lens -> attention_scores
// [S, 1, max_blocks * block_size], a second pass over the observed rows after the attention.

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../../common/cpu/paged_op.h"  // errors, metadata checks, shape inference (shared with PagedAttention)
#include "../../paged_attention/cpu/paged_attention_simd.h"
#include "paged_mla_ort.h"

namespace {

using namespace kvexport_simd;

constexpr int kInputs = 8;  // + observation_lens (optional input 8: scoring builds, spec.py)
constexpr int KC = 16;            // keys per chunk (one vector of scores)
constexpr int RB = 4;             // query rows per register block (scores4 / accumulate4)
static_assert(KC == 16 && RB == 4, "the micro-kernels hold 4 rows x 16 keys / channels");
constexpr int64_t kRows = 32;     // rows (tokens x heads) per task at most
constexpr int64_t kSplitMin = 256;  // keys per context split at least
constexpr int64_t kTasksWanted = 32;  // split decode contexts until about this many tasks

struct Half { uint16_t bits; };   // IEEE float16 pool element
struct BHalf { uint16_t bits; };  // bfloat16 pool element

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
  if (e == 0) {  // zero / subnormal: m * 2^-24, exact
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float32 -> float16, round to nearest even; overflow gives inf (as torch's .to(float16)).
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return sign | 0x7C00 | (ax > 0x7F800000u ? 0x200 : 0);  // inf, nan
  if (ax >= 0x477FF000u) return sign | 0x7C00;  // >= 65520: rounds to inf
  if (ax < 0x38800000u) {  // below 2^-14: a float16 subnormal, round(|f| * 2^24) (exact product)
    float a;
    std::memcpy(&a, &ax, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f));
  }
  uint32_t r = ax - 0x38000000u;  // exponent bias 127 -> 15
  r += 0xFFFu + ((r >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return sign | static_cast<uint16_t>(r >> 13);
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even (torch's rule; nan stays nan)
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40);
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline int8_t quantize(float x, float scale) {  // ONNX QuantizeLinear, zero point 0
  const float q = std::nearbyint(x / scale);  // IEEE float32 division, round half to even
  return static_cast<int8_t>(std::min(127.f, std::max(-128.f, q)));
}

// n pool elements -> float32 (exact for every pool type)
inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void to_float(const int8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kReg <= n; i += kReg) store_reg(dst + i, load_reg(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void to_float(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i].bits);
}
inline void to_float(const BHalf* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i].bits) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

inline float hmax(v16f v) {
  v16f t = vmax(v, __builtin_shuffle(v, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  t = vmax(t, __builtin_shuffle(t, v16i{4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
  t = vmax(t, __builtin_shuffle(t, v16i{2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
  return std::max(t[0], t[1]);
}

// NOTE: the two inner loops are written with 8-lane vectors held in named variables (one ymm
// register each on AVX2): GCC keeps arrays of 16-lane generic vectors on the stack there, and
// the op ran ~3x slower (perf on the 2-core EPYC: the loops spilled to the stack).
typedef float v8f __attribute__((vector_size(32)));
inline v8f ld8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void st8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

// s[b][0:16] = sum_i q[b * w + i] * kt[i][0:16] for the 4 rows b of a register block.
inline void scores4(const float* q, const float* kt, int64_t w, float* s) {
  v8f a0{}, a1{}, b0{}, b1{}, c0{}, c1{}, d0{}, d1{};
  const float *q0 = q, *q1 = q + w, *q2 = q + 2 * w, *q3 = q + 3 * w;
  for (int64_t i = 0; i < w; ++i) {
    const v8f k0 = ld8(kt + i * 16), k1 = ld8(kt + i * 16 + 8);
    const float x0 = q0[i], x1 = q1[i], x2 = q2[i], x3 = q3[i];
    a0 += x0 * k0;
    a1 += x0 * k1;
    b0 += x1 * k0;
    b1 += x1 * k1;
    c0 += x2 * k0;
    c1 += x2 * k1;
    d0 += x3 * k0;
    d1 += x3 * k1;
  }
  st8(s, a0), st8(s + 8, a1), st8(s + 16, b0), st8(s + 24, b1);
  st8(s + 32, c0), st8(s + 40, c1), st8(s + 48, d0), st8(s + 56, d1);
}

// acc[b][c:c+16] = acc[b][c:c+16] * alpha[b] + sum_{j < n} p[b][j] * v[j][c:c+16], 4 rows b;
// acc rows `ld` apart, p rows 16 apart, v rows `ld` apart.
inline void accumulate4(float* acc, const float* alpha, const float* p, const float* v, int64_t n, int64_t ld,
                        int64_t c) {
  float *o0 = acc + c, *o1 = acc + ld + c, *o2 = acc + 2 * ld + c, *o3 = acc + 3 * ld + c;
  v8f a0 = ld8(o0) * alpha[0], a1 = ld8(o0 + 8) * alpha[0], b0 = ld8(o1) * alpha[1], b1 = ld8(o1 + 8) * alpha[1];
  v8f c0 = ld8(o2) * alpha[2], c1 = ld8(o2 + 8) * alpha[2], d0 = ld8(o3) * alpha[3], d1 = ld8(o3 + 8) * alpha[3];
  for (int64_t j = 0; j < n; ++j) {
    const v8f v0 = ld8(v + j * ld + c), v1 = ld8(v + j * ld + c + 8);
    const float p0 = p[j], p1 = p[16 + j], p2 = p[32 + j], p3 = p[48 + j];
    a0 += p0 * v0;
    a1 += p0 * v1;
    b0 += p1 * v0;
    b1 += p1 * v1;
    c0 += p2 * v0;
    c1 += p2 * v1;
    d0 += p3 * v0;
    d1 += p3 * v1;
  }
  st8(o0, a0), st8(o0 + 8, a1), st8(o1, b0), st8(o1 + 8, b1);
  st8(o2, c0), st8(o2 + 8, c1), st8(o3, d0), st8(o3 + 8, d1);
}

enum class Pool { F32, F16, BF16, I8 };

struct Attrs {
  int64_t num_heads, lora, rope, width, block_size;
  float scale;
  Pool pool;
};

struct Task {
  int64_t seq, i0, i1, h0, h1;  // tokens [i0, i1) of the sequence, heads [h0, h1)
  int64_t k0, k1;               // key positions [k0, k1) (the whole causal range unless split)
  int64_t part;                 // >= 0: a context split, partial results at partials[part]
};

struct Step {
  Attrs a;
  const float* query;
  float* out;
  const void* pool;  // the output pool, already holding this step's rows
  const int64_t *tables, *seq_lens, *qsl;
  const float* kv_scale;  // [W]: int8 scales, else nullptr
  int64_t max_blocks, lora_pad;
  std::vector<Task> tasks;
  std::vector<size_t> order;    // the thread pool's i-th job is tasks[order[i]]
  std::vector<float> partials;  // per split task: rows x (m, l, acc[lora_pad])
};

// One task: rows r = (token i0 + r / nh, head h0 + r % nh).
template <typename KV>
void attend(const Step& st, const Task& t) {
  const Attrs& a = st.a;
  const int64_t W = a.width, L = a.lora, Lp = st.lora_pad, nh = t.h1 - t.h0;
  const int64_t rows = (t.i1 - t.i0) * nh, rows_pad = (rows + RB - 1) / RB * RB;
  const int64_t q_start = st.qsl[t.seq], ctx = st.seq_lens[t.seq] - (st.qsl[t.seq + 1] - q_start);
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(rows_pad * (W + Lp + 2 + KC) + W * KC + KC * Lp + (KC + 1) * W + 64));
  float* q = scratch.data();        // [rows_pad][W] scaled queries (pad rows 0)
  float* acc = q + rows_pad * W;    // [rows_pad][Lp]
  float* m = acc + rows_pad * Lp;   // [rows_pad]
  float* l = m + rows_pad;          // [rows_pad]
  float* p = l + rows_pad;          // [rows_pad][KC] probabilities of the chunk
  float* kt = p + rows_pad * KC;    // [W][KC] the chunk's keys, transposed
  float* vb = kt + W * KC;          // [KC][Lp] the chunk's values (row[:L], zero padded)
  float* rowbuf = vb + KC * Lp;     // [KC][W] the chunk's rows as float32 (non-float32 pools)
  float* zeros = rowbuf + KC * W;   // [W] the rows past the chunk's end
  float alpha[kRows + RB];
  int64_t posr[kRows + RB];
  std::fill(q, q + rows_pad * W, 0.f);
  std::fill(acc, acc + rows_pad * Lp, 0.f);
  std::fill(m, m + rows_pad, kNegInf);
  std::fill(l, l + rows_pad, 0.f);
  for (int64_t r = 0; r < rows_pad; ++r) posr[r] = -1;  // pad rows see nothing
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + t.i0 + r / nh, h = t.h0 + r % nh;
    const float* src = st.query + (tok * a.num_heads + h) * W;
    for (int64_t i = 0; i < W; ++i) q[r * W + i] = src[i] * a.scale * (st.kv_scale ? st.kv_scale[i] : 1.f);
    posr[r] = ctx + t.i0 + r / nh;
  }
  std::fill(vb, vb + KC * Lp, 0.f);
  std::fill(zeros, zeros + W, 0.f);
  const KV* pool = static_cast<const KV*>(st.pool);
  const int64_t* table = st.tables + t.seq * st.max_blocks;
  const int64_t bs = a.block_size;
  const int64_t k_end = std::min(t.k1, ctx + t.i1);  // keys past the last row's position: invisible
  for (int64_t c0 = t.k0; c0 < k_end; c0 += KC) {
    const int64_t n = std::min<int64_t>(KC, k_end - c0);
    const float* src[KC];  // the chunk's rows as float32 (float32 pools: read in place)
    for (int64_t j = 0; j < KC; ++j) {
      if (j < n) {
        const int64_t pos = c0 + j;
        const KV* at = pool + (table[pos / bs] * bs + pos % bs) * W;
        if constexpr (std::is_same_v<KV, float>) {
          src[j] = at;
        } else {
          to_float(at, rowbuf + j * W, W);
          src[j] = rowbuf + j * W;
        }
      } else {
        src[j] = zeros;
      }
      std::memcpy(vb + j * Lp, src[j], L * sizeof(float));
    }
    for (int64_t i = 0; i < W; ++i) {  // transpose: 16 sequential reads, one contiguous 16-float write
#pragma GCC unroll 16
      for (int j = 0; j < KC; ++j) kt[i * KC + j] = src[j][i];
    }
    for (int64_t r0 = 0; r0 < rows_pad; r0 += RB) {
      alignas(64) float s[RB * KC];
      scores4(q + r0 * W, kt, W, s);
      for (int b = 0; b < RB; ++b) {
        const int64_t r = r0 + b;
        const int64_t vis = std::min<int64_t>(n, posr[r] - c0 + 1);  // keys c0 .. c0 + vis - 1
        if (vis <= 0) {
          alpha[r] = 1.f;
          store16(p + r * KC, v16f{});
          continue;
        }
        v16f sc = load16(s + b * KC);
        for (int64_t j = vis; j < KC; ++j) sc[j] = kNegInf;
        const float m_new = std::max(m[r], hmax(sc));
        alpha[r] = std::exp(m[r] - m_new);  // 0 on the first visible chunk
        const v16f pr = exp16(sc - m_new);
        l[r] = l[r] * alpha[r] + hsum(pr);
        m[r] = m_new;
        store16(p + r * KC, pr);
      }
    }
    for (int64_t r0 = 0; r0 < rows_pad; r0 += RB)
      for (int64_t c = 0; c < Lp; c += 16) accumulate4(acc + r0 * Lp, alpha + r0, p + r0 * KC, vb, n, Lp, c);
  }
  if (t.part >= 0) {  // a context split: (m, l, acc) for the merge
    float* dst = const_cast<float*>(st.partials.data()) + t.part * kRows * (Lp + 2);
    for (int64_t r = 0; r < rows; ++r) {
      dst[r * (Lp + 2)] = m[r];
      dst[r * (Lp + 2) + 1] = l[r];
      std::memcpy(dst + r * (Lp + 2) + 2, acc + r * Lp, Lp * sizeof(float));
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_start + t.i0 + r / nh, h = t.h0 + r % nh;
    float* dst = st.out + (tok * a.num_heads + h) * L;
    const float f = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t i = 0; i < L; ++i) dst[i] = acc[r * Lp + i] * f * (st.kv_scale ? st.kv_scale[i] : 1.f);
  }
}

template <typename KV>
void run_task(void* user, size_t i) {
  const Step& st = *static_cast<const Step*>(user);
  attend<KV>(st, st.tasks[st.order[i]]);
}

// The splits of one decode row group (tasks [first, first + n)) -> the output rows.
void merge(Step& st, size_t first, size_t n) {
  const Task& t0 = st.tasks[first];
  const int64_t Lp = st.lora_pad, L = st.a.lora, nh = t0.h1 - t0.h0;
  const int64_t tok = st.qsl[t0.seq] + t0.i0;
  for (int64_t r = 0; r < nh; ++r) {
    float mx = kNegInf;
    for (size_t k = 0; k < n; ++k) mx = std::max(mx, st.partials[(st.tasks[first + k].part * kRows + r) * (Lp + 2)]);
    float* dst = st.out + (tok * st.a.num_heads + t0.h0 + r) * L;
    std::fill(dst, dst + L, 0.f);
    float total = 0.f;
    for (size_t k = 0; k < n; ++k) {
      const float* part = st.partials.data() + (st.tasks[first + k].part * kRows + r) * (Lp + 2);
      if (part[1] <= 0.f) continue;
      const float w = std::exp(part[0] - mx);
      total += part[1] * w;
      for (int64_t i = 0; i < L; ++i) dst[i] += part[2 + i] * w;
    }
    const float f = total > 0.f ? 1.f / total : 0.f;
    for (int64_t i = 0; i < L; ++i) dst[i] *= f * (st.kv_scale ? st.kv_scale[i] : 1.f);
  }
}

// Importance scores (optional input 8 / output 2, spec.py "Attention scores"): the last obs tokens of
// sequence s are observation queries; scores[s, 0, j] = sum over them and over all H heads (the one
// latent "KV head"'s group) of softmax(scale * q · row)_j. Run after the attention (the pool holds this
// step's rows); tasks of (sequence, chunk of heads) each add into their own partial row, summed after.
// Accumulated in double, as PagedAttention's scores.
constexpr int64_t kScoreHeads = 8;  // heads per scoring task

struct ScoreTask {
  int64_t seq, h0, h1;
};

struct ScoreStep {
  const Step* st;
  const int64_t* obs;  // [S] observation_lens
  int64_t score_len;
  std::vector<ScoreTask> tasks;
  std::vector<double> partial;  // [tasks][score_len]
};

template <typename KV>
void score_task(void* user, size_t i) {
  ScoreStep& sc = *static_cast<ScoreStep*>(user);
  const Step& st = *sc.st;
  const Attrs& a = st.a;
  const ScoreTask& t = sc.tasks[i];
  const int64_t W = a.width, bs = a.block_size;
  const int64_t q_start = st.qsl[t.seq], q_len = st.qsl[t.seq + 1] - q_start, total = st.seq_lens[t.seq];
  const int64_t ctx = total - q_len, obs = std::min(sc.obs[t.seq], q_len);
  const int64_t* table = st.tables + t.seq * st.max_blocks;
  const KV* pool = static_cast<const KV*>(st.pool);
  std::vector<float> rows(static_cast<size_t>(total * W));  // the sequence's rows [total, W] as float32
  for (int64_t j = 0; j < total; ++j) {
    float* dst = rows.data() + j * W;
    to_float(pool + (table[j / bs] * bs + j % bs) * W, dst, W);
    if (st.kv_scale)
      for (int64_t c = 0; c < W; ++c) dst[c] *= st.kv_scale[c];
  }
  std::vector<double> p(static_cast<size_t>(total));
  double* acc = sc.partial.data() + i * sc.score_len;
  for (int64_t qi = q_len - obs; qi < q_len; ++qi) {
    const int64_t pos = ctx + qi;
    for (int64_t h = t.h0; h < t.h1; ++h) {
      const float* q = st.query + ((q_start + qi) * a.num_heads + h) * W;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j <= pos; ++j) {
        double s = 0.0;
        const float* r = rows.data() + j * W;
        for (int64_t c = 0; c < W; ++c) s += static_cast<double>(q[c]) * r[c];
        p[j] = s * a.scale;
        m = std::max(m, p[j]);
      }
      double l = 0.0;
      for (int64_t j = 0; j <= pos; ++j) l += (p[j] = std::exp(p[j] - m));
      for (int64_t j = 0; j <= pos; ++j) acc[j] += p[j] / l;
    }
  }
}

constexpr const char* kOp = "PagedMLA";

[[noreturn]] void fail(const std::string& msg) { kvexport_paged::fail(kOp, msg); }

using kvexport_paged::shape_of;

int64_t int_attr(const OrtKernelInfo* info, const char* name) {
  return Ort::ConstKernelInfo(info).GetAttribute<int64_t>(name);
}

struct Kernel {
  Attrs a;

  Kernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    a.num_heads = int_attr(info, "num_heads");
    a.lora = int_attr(info, "kv_lora_rank");
    a.rope = int_attr(info, "qk_rope_head_dim");
    a.block_size = int_attr(info, "block_size");
    a.scale = ki.GetAttribute<float>("scale");
    const std::string kv = ki.GetAttribute<std::string>("kv_dtype");
    if (kv == "float32") a.pool = Pool::F32;
    else if (kv == "float16") a.pool = Pool::F16;
    else if (kv == "bfloat16") a.pool = Pool::BF16;
    else if (kv == "int8") a.pool = Pool::I8;
    else fail("kv_dtype " + kv + " is not one of float32, float16, bfloat16, int8");
    if (a.num_heads < 1 || a.lora < 1 || a.rope < 0 || a.block_size < 1)
      fail("num_heads, kv_lora_rank, block_size must be >= 1 and qk_rope_head_dim >= 0");
    a.width = a.lora + a.rope;
    if (!(a.scale > 0.f) || std::isinf(a.scale)) fail("scale must be finite and > 0");
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return kvexport_paged::as_status([&] { Compute(context); });
  }

  ONNXTensorElementDataType pool_type() const {
    switch (a.pool) {
      case Pool::F16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
      case Pool::BF16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
      case Pool::I8: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
      default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    }
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const size_t n_in = ctx.GetInputCount();
    if (n_in != kInputs && n_in != kInputs + 1) fail("expects 8 inputs (9 with observation_lens)");
    // scoring (spec.py "Attention scores"): observation_lens given and attention_scores asked for
    const bool scoring = n_in == kInputs + 1 && ctx.GetInput(kInputs) != nullptr && ctx.GetOutputCount() > 2;
    Ort::ConstValue query = ctx.GetInput(0), latent = ctx.GetInput(1), pool = ctx.GetInput(2);
    const auto qs = shape_of(query), ls = shape_of(latent), ps = shape_of(pool);
    const auto bt = shape_of(ctx.GetInput(3)), sl = shape_of(ctx.GetInput(4)), ql = shape_of(ctx.GetInput(5));
    const auto sm = shape_of(ctx.GetInput(6)), ss = shape_of(ctx.GetInput(7));
    const int64_t T = qs.size() == 3 ? qs[0] : -1, H = a.num_heads, W = a.width, L = a.lora, bs = a.block_size;
    if (qs != std::vector<int64_t>{T, H, W})
      fail("query must be [num_tokens, num_heads, kv_lora_rank + qk_rope_head_dim]");
    if (ls != std::vector<int64_t>{T, W}) fail("latent must be [num_tokens, kv_lora_rank + qk_rope_head_dim]");
    if (ps.size() != 4 || ps[0] != 1 || ps[2] != bs || ps[3] != W)
      fail("latent_cache must be [1, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]");
    if (pool.GetTensorTypeAndShapeInfo().GetElementType() != pool_type())
      fail("latent_cache element type does not match kv_dtype");
    kvexport_paged::check_index_shapes(kOp, bt, sl, ql, sm, T);
    if (ss != std::vector<int64_t>{W}) fail("kv_scale must be [kv_lora_rank + qk_rope_head_dim]");
    const int64_t S = sl[0], NB = ps[1], MB = bt[1];

    Step st;
    st.a = a;
    st.query = query.GetTensorData<float>();
    st.tables = ctx.GetInput(3).GetTensorData<int64_t>();
    st.seq_lens = ctx.GetInput(4).GetTensorData<int64_t>();
    st.qsl = ctx.GetInput(5).GetTensorData<int64_t>();
    const int64_t* slots = ctx.GetInput(6).GetTensorData<int64_t>();
    const float* scale = ctx.GetInput(7).GetTensorData<float>();
    st.kv_scale = a.pool == Pool::I8 ? scale : nullptr;
    st.max_blocks = MB;
    st.lora_pad = (L + 15) / 16 * 16;

    // validate the step's metadata before anything is written
    kvexport_paged::check_step(kOp, st.qsl, st.seq_lens, st.tables, slots, S, T, MB, NB, bs);
    if (st.kv_scale)
      for (int64_t i = 0; i < W; ++i)
        if (!(scale[i] > 0.f) || std::isinf(scale[i])) fail("int8 kv_scale must be finite and > 0");
    const int64_t* obs = nullptr;
    if (scoring) {
      if (shape_of(ctx.GetInput(kInputs)) != std::vector<int64_t>{S}) fail("observation_lens must be [num_seqs]");
      obs = ctx.GetInput(kInputs).GetTensorData<int64_t>();
      for (int64_t s = 0; s < S; ++s)
        if (obs[s] < 0) fail("observation_lens must be >= 0");
    }

    Ort::UnownedValue out = ctx.GetOutput(0, {T, H, L});
    Ort::UnownedValue pool_out = ctx.GetOutput(1, ps);
    st.out = out.GetTensorMutableData<float>();
    const size_t elem = a.pool == Pool::I8 ? 1 : a.pool == Pool::F32 ? 4 : 2;
    const size_t pool_bytes = static_cast<size_t>(NB * bs * W) * elem;
    void* dst = pool_out.GetTensorMutableRawData();
    if (dst != pool.GetTensorRawData()) std::memcpy(dst, pool.GetTensorRawData(), pool_bytes);
    st.pool = dst;

    // 1. store this step's rows
    const float* src = latent.GetTensorData<float>();
    for (int64_t t = 0; t < T; ++t) {
      if (slots[t] < 0) continue;
      const size_t at = static_cast<size_t>(slots[t] * W);
      const float* x = src + t * W;
      switch (a.pool) {
        case Pool::F32: std::memcpy(static_cast<float*>(dst) + at, x, W * sizeof(float)); break;
        case Pool::F16:
          for (int64_t i = 0; i < W; ++i) static_cast<uint16_t*>(dst)[at + i] = f32_to_f16(x[i]);
          break;
        case Pool::BF16:
          for (int64_t i = 0; i < W; ++i) static_cast<uint16_t*>(dst)[at + i] = f32_to_bf16(x[i]);
          break;
        case Pool::I8:
          for (int64_t i = 0; i < W; ++i) static_cast<int8_t*>(dst)[at + i] = quantize(x[i], scale[i]);
          break;
      }
    }

    // 2. attend: tasks of (sequence, token tile, head chunk); decode contexts split when few tasks
    const int64_t hc = std::min(H, kRows), tt = std::max<int64_t>(1, kRows / hc);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t q_len = st.qsl[s + 1] - st.qsl[s], ctx_len = st.seq_lens[s] - q_len;
      for (int64_t i0 = 0; i0 < q_len; i0 += tt)
        for (int64_t h0 = 0; h0 < H; h0 += hc)
          st.tasks.push_back({s, i0, std::min(q_len, i0 + tt), h0, std::min(H, h0 + hc), 0,
                              ctx_len + std::min(q_len, i0 + tt), -1});
    }
    if (!st.tasks.empty()) attend_all(ctx, st);

    // 3. attention scores of the observation queries: [S, 1, max_blocks * block_size], 0 where unobserved
    if (ctx.GetOutputCount() > 2) {
      ScoreStep sc{&st, obs, MB * bs, {}, {}};
      Ort::UnownedValue scores = ctx.GetOutput(2, std::vector<int64_t>{S, 1, sc.score_len});
      float* out_scores = scores.GetTensorMutableData<float>();
      std::fill(out_scores, out_scores + S * sc.score_len, 0.f);
      for (int64_t s = 0; obs != nullptr && s < S; ++s)
        if (obs[s] > 0 && st.qsl[s + 1] > st.qsl[s])
          for (int64_t h0 = 0; h0 < H; h0 += kScoreHeads) sc.tasks.push_back({s, h0, std::min(H, h0 + kScoreHeads)});
      if (sc.tasks.empty()) return;
      sc.partial.assign(sc.tasks.size() * static_cast<size_t>(sc.score_len), 0.0);
      ctx.ParallelFor(a.pool == Pool::F32    ? score_task<float>
                      : a.pool == Pool::F16  ? score_task<Half>
                      : a.pool == Pool::BF16 ? score_task<BHalf>
                                             : score_task<int8_t>,
                      sc.tasks.size(), 0, &sc);
      std::vector<double> sum(static_cast<size_t>(S * sc.score_len), 0.0);
      for (size_t k = 0; k < sc.tasks.size(); ++k)
        for (int64_t j = 0; j < sc.score_len; ++j)
          sum[sc.tasks[k].seq * sc.score_len + j] += sc.partial[k * sc.score_len + j];
      for (size_t j = 0; j < sum.size(); ++j) out_scores[j] = static_cast<float>(sum[j]);
    }
  }

  // The attention tasks (st.tasks, not empty): decode contexts split when few tasks, then merged.
  void attend_all(Ort::KernelContext& ctx, Step& st) const {
    const int64_t base = static_cast<int64_t>(st.tasks.size());
    std::vector<Task> tasks;
    std::vector<std::pair<size_t, size_t>> groups;  // split row groups: (first task, count)
    int64_t parts = 0;
    for (const Task& t : st.tasks) {
      const int64_t keys = t.k1;
      const int64_t q_len = st.qsl[t.seq + 1] - st.qsl[t.seq];
      const int64_t splits = q_len == 1 && base < kTasksWanted
                                 ? std::min<int64_t>({(kTasksWanted + base - 1) / base, keys / kSplitMin, 64})
                                 : 1;
      if (splits <= 1) {
        tasks.push_back(t);
        continue;
      }
      groups.emplace_back(tasks.size(), static_cast<size_t>(splits));
      const int64_t per = (keys + splits - 1) / splits / KC * KC + KC;  // chunk-aligned
      for (int64_t k = 0; k < splits; ++k) {
        Task u = t;
        u.k0 = std::min(keys, k * per);
        u.k1 = std::min(keys, (k + 1) * per);
        u.part = parts++;
        tasks.push_back(u);
      }
    }
    st.tasks = std::move(tasks);
    st.partials.resize(static_cast<size_t>(parts * kRows * (st.lora_pad + 2)));
    st.order.resize(st.tasks.size());  // longest key range first, so the threads end together
    for (size_t i = 0; i < st.order.size(); ++i) st.order[i] = i;
    std::stable_sort(st.order.begin(), st.order.end(), [&](size_t x, size_t y) {
      return st.tasks[x].k1 - st.tasks[x].k0 > st.tasks[y].k1 - st.tasks[y].k0;
    });
    void (*fn)(void*, size_t) = a.pool == Pool::F32    ? run_task<float>
                                : a.pool == Pool::F16  ? run_task<Half>
                                : a.pool == Pool::BF16 ? run_task<BHalf>
                                                       : run_task<int8_t>;
    ctx.ParallelFor(fn, st.tasks.size(), 0, &st);
    for (const auto& g : groups) merge(st, g.first, g.second);
  }
};

// Output 0: [T, H, kv_lora_rank] of the query's type; output 1: the pool input's type and shape;
// output 2 (attention_scores, float32 [S, 1, score_len]) is left to the graph's declared shape.
OrtStatusPtr infer_types(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  const OrtOpAttr* attr = nullptr;
  if (OrtStatusPtr st = api.ShapeInferContext_GetAttribute(ctx, "kv_lora_rank", &attr)) return st;
  int64_t lora = -1;
  size_t got = 0;
  if (OrtStatusPtr st = api.ReadOpAttr(attr, ORT_OP_ATTR_INT, &lora, sizeof lora, &got)) return st;
  if (OrtStatusPtr st = kvexport_paged::infer_like(ctx, 0, 0, "kvexport_paged_mla_dim_", lora)) return st;
  return kvexport_paged::infer_like(ctx, 1, 2, "kvexport_paged_mla_dim_");
}

struct Op : Ort::CustomOpBase<Op, Kernel, true> {
  Op() { OrtCustomOp::InferOutputShapeFn = infer_types; }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return kvexport_paged::as_status([&] { *kernel = new Kernel(api, info); });
  }
  const char* GetName() const { return "PagedMLA"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kInputs + 1; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == kInputs) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;  // observation_lens
    if (i <= 1 || i == 7) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if (i == 2) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float32, float16, bfloat16 or int8 pool
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == kInputs ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 0 || i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;  // attention_scores
  }
};

}  // namespace

namespace kvexport_mla {

const OrtCustomOp* custom_op() {
  static Op op;
  return &op;
}

}  // namespace kvexport_mla

extern "C" {
// For the loader (plugins/paged_mla/native.py): this library has PagedMLA, in this contract version.
__attribute__((visibility("default"))) int kvexport_paged_mla_version() { return 1; }
}
