// kvexport::PagedAttention as a native onnxruntime custom op for the CPU execution provider.
//
// The contract is plugins/paged_attention/spec.py; reference.py is the executable definition
// this file is tested against (tests/plugins/test_cpu_op.py). One node per layer of an
// `--attention plugin` graph; the same graph builds into TensorRT engines on a GPU.
//
//   1. store: token t's K/V go to slot_mapping[t] of the pools (int8: QuantizeLinear rounding;
//      int4: rows of codes and per-token group scales, paged_attention_int4.h);
//   2. attend: every new token attends causally (optional sliding window) to its sequence's
//      keys, read through the block table straight from the pool: no gather, no padding to
//      the longest sequence, no mask tensor. Query head h reads KV head h / (H / kvH), and the
//      G query heads of a KV head share each K/V row while it is in L1.
//
// Outputs 1 and 2 are the updated pools. The runtime binds each to the same buffer as the
// pool input (IOBinding), so the pools are updated in place; when they are not the same
// buffer the input pool is copied to the output first (correct, O(pool)).
//
// Work is split into (sequence, KV head, tile of query tokens) tasks run on onnxruntime's
// intra-op thread pool (KernelContext_ParallelFor). Online softmax in float32 (flash
// attention), exp by a vectorised polynomial (relative error < 2e-7).

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
#include <utility>
#include <vector>

#include "../../common/cpu/paged_op.h"  // errors, metadata checks, shape inference (shared with PagedMLA)
#include "paged_attention_int4.h"
#include "paged_attention_sinks.h"
#include "paged_attention_simd.h"
#include "../../paged_mla/cpu/paged_mla_ort.h"  // kvexport::PagedMLA, registered below
#include "../../gated_delta/cpu/gated_delta_ort.h"  // kvexport::GatedDeltaRule, registered below

namespace {

constexpr int kInputs = 11;  // + observation_lens (optional input 11: scoring builds, spec.py)
constexpr int64_t kTileTokens = 16;  // query tokens per task (x G query heads = rows)
constexpr int W = 16;                // keys scored at once (one vector of scores)

using namespace kvexport_simd;
using kvexport_int4::Int4;


// Ask for the next block of the sequence while this one is scored: blocks are scattered in
// the pool, so the hardware prefetcher cannot guess them. n = elements to fetch.
template <typename KV>
inline void prefetch_block(const KV* kpool, const KV* vpool, int64_t at, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(KV)) {
    __builtin_prefetch(kpool + at + i);
    __builtin_prefetch(vpool + at + i);
  }
}

// head_dim is NV * 16 when NV > 0 (compile-time: vector registers over head_dim); NV = 0 is
// the generic path for any head_dim. Both loop over CPU registers (vreg: 16 or 8 floats,
// paged_attention_simd.h), each lane's operations in the 16-lane code's order.
template <int NV, typename KV>
inline float dot(const float* q, const KV* k, int64_t d) {
  if constexpr (NV > 0) {
    constexpr int R = NV * 16 / kReg, P = 16 / kReg;  // registers in all; per 16 lanes
    vreg acc[R];
#pragma GCC unroll 16
    for (int c = 0; c < R; ++c) acc[c] = load_reg(q + kReg * c) * load_reg(k + kReg * c);
#pragma GCC unroll 16
    for (int c = P; c < R; ++c) acc[c % P] += acc[c];  // 16-lane chunk c / P into chunk 0
    return hsum_regs(acc);
  } else {
    float s = 0.f;
    for (int64_t i = 0; i < d; ++i) s += q[i] * to_f(k[i]);
    return s;
  }
}

// acc[0:d] = acc * alpha + sum_{j < n} p[j * stride] * v[j, 0:d]
// NOTE: at most 8 accumulator registers at a time (head_dim 96/128 without AVX-512 would need
// 12/16 of AVX2's 16: they spill), so wide heads take two passes over the n rows, and heads of
// 256 / 512 (Gemma, Qwen3.5 attention layers) 2..8 passes of 8 registers.
template <int NV, typename KV>
inline void accumulate(float* acc, float alpha, const float* p, int64_t stride, const KV* v, int64_t n, int64_t d) {
  if constexpr (NV > 0) {
    // R: 2..64 (AVX2 head_dim 512); G divides R
    constexpr int R = NV * 16 / kReg, G = R <= 8 ? R : R <= 16 ? R / 2 : 8;
#pragma GCC unroll 1
    for (int g = 0; g < R; g += G) {
      vreg a[G];
#pragma GCC unroll 16
      for (int c = 0; c < G; ++c) a[c] = load_reg(acc + kReg * (g + c)) * alpha;
      for (int64_t j = 0; j < n; ++j) {
        const float pj = p[j * stride];
#pragma GCC unroll 16
        for (int c = 0; c < G; ++c) a[c] += pj * load_reg(v + j * NV * 16 + kReg * (g + c));
      }
#pragma GCC unroll 16
      for (int c = 0; c < G; ++c) store_reg(acc + kReg * (g + c), a[c]);
    }
  } else {
    for (int64_t i = 0; i < d; ++i) {
      float x = acc[i] * alpha;
      for (int64_t j = 0; j < n; ++j) x += p[j * stride] * to_f(v[j * d + i]);
      acc[i] = x;
    }
  }
}

struct Attrs {
  int64_t num_heads, num_kv_heads, head_dim, block_size, sliding_window;
  float scale, logit_softcap;  // logit_softcap 0: off
  bool int8, int4;
  int64_t row;  // elements of one pool row: head_dim, or int4's bytes (codes + scales)
  const float* sinks = nullptr;  // [num_heads] learned sink logits (paged_attention_sinks.h); nullptr: none
};

struct Task {
  int64_t seq, kv_head, i0, i1;  // query tokens [i0, i1) of the sequence
};

struct Step {
  Attrs a;
  const float *query;
  float* out;
  void *key_cache, *value_cache;  // the output pools (already holding this step's K/V)
  const int64_t *tables, *seq_lens, *qsl;
  const float *k_scale, *v_scale;  // int8: [kvH, D] per-channel scales
  int64_t num_blocks, max_blocks;
  std::vector<Task> tasks;
};

// What one task sees: rows r = (token i0 + r / g, query head kv_head * g + r % g).
struct Tile {
  int64_t d, g, rows, ctx, q_start, first, last;  // keys [first, last] may be visible
  const float *k_scale, *v_scale;  // int8: this head's [D] scales; nullptr for float pools
  const float* sinks;  // [num_heads] or nullptr
  Tile(const Step& st, const Task& t) {
    const Attrs& a = st.a;
    d = a.head_dim;
    g = a.num_heads / a.num_kv_heads;
    rows = (t.i1 - t.i0) * g;
    q_start = st.qsl[t.seq];
    ctx = st.seq_lens[t.seq] - (st.qsl[t.seq + 1] - q_start);
    last = ctx + t.i1 - 1;
    first = a.sliding_window > 0 ? std::max<int64_t>(0, ctx + t.i0 - a.sliding_window + 1) : 0;
    k_scale = a.int8 ? st.k_scale + t.kv_head * d : nullptr;
    v_scale = a.int8 ? st.v_scale + t.kv_head * d : nullptr;
    sinks = a.sinks;
  }
  // int8: k = code * k_scale, so q_i * scale * k_scale_i meets the codes as exact integers
  void load_query(const float* src, float* dst, int64_t stride, float scale) const {
    for (int64_t i = 0; i < d; ++i) dst[i * stride] = src[i] * scale * (k_scale ? k_scale[i] : 1.f);
  }
  // out_i = v_scale_i * acc_i / l (int8: v = code * v_scale); with sinks the query head's sink
  // joins the denominator (the online softmax ended at max m)
  void store_output(const float* acc, float* dst, float l, float m, int64_t head) const {
    const float f = sinks ? kvexport_sinks::output_factor(l, m, sinks[head]) : l > 0.f ? 1.f / l : 0.f;
    for (int64_t i = 0; i < d; ++i) dst[i] = acc[i] * f * (v_scale ? v_scale[i] : 1.f);
  }
  int64_t token(const Task& t, int64_t r) const { return q_start + t.i0 + r / g; }
  int64_t head(const Task& t, int64_t r) const { return t.kv_head * g + r % g; }
  int64_t pos(const Task& t, int64_t r) const { return ctx + t.i0 + r / g; }
};

// Few rows (decode: the G query heads of one token): one dot product per (row, key).
template <int NV, typename KV>
void attend_dots(const Step& st, const Task& t) {
  const Attrs& a = st.a;
  const Tile tl(st, t);
  constexpr bool I4 = std::is_same_v<KV, Int4>;
  const int64_t d = NV > 0 ? NV * 16 : tl.d, bs = a.block_size, rows = tl.rows, rs = a.row;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(rows * (2 * d + 2)));
  float* q = scratch.data();
  float* acc = q + rows * d;
  float* m = acc + rows * d;
  float* l = m + rows;
  for (int64_t r = 0; r < rows; ++r) {
    tl.load_query(st.query + (tl.token(t, r) * a.num_heads + tl.head(t, r)) * d, q + r * d, 1, a.scale);
    if constexpr (I4) kvexport_int4::to_group_order(q + r * d, d);  // int4: q and acc in the codes' order
    std::fill(acc + r * d, acc + (r + 1) * d, 0.f);
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  const KV* kpool = static_cast<const KV*>(st.key_cache);
  const KV* vpool = static_cast<const KV*>(st.value_cache);
  const int64_t* table = st.tables + t.seq * st.max_blocks;
  alignas(64) float s[W];
  for (int64_t j0 = tl.first - tl.first % bs; j0 <= tl.last; j0 += bs) {  // one block
    const size_t base = static_cast<size_t>((t.kv_head * st.num_blocks + table[j0 / bs]) * bs) * rs;
    const int64_t end = std::min(j0 + bs, tl.last + 1);
    if (j0 + bs <= tl.last) prefetch_block(kpool, vpool, (t.kv_head * st.num_blocks + table[j0 / bs + 1]) * bs * rs,
                                           std::min(bs, tl.last + 1 - j0 - bs) * rs);
    for (int64_t c0 = j0; c0 < end; c0 += W) {  // up to W keys of the block
      const KV* kb = kpool + base + (c0 - j0) * rs;
      const KV* vb = vpool + base + (c0 - j0) * rs;
      auto visible = [&](int64_t r) {  // [j_lo, j_hi]: the chunk's keys row r sees
        const int64_t pos = tl.pos(t, r);
        const int64_t lo = a.sliding_window > 0 ? pos - a.sliding_window + 1 : 0;
        return std::pair<int64_t, int64_t>{std::max(lo, c0), std::min({pos, c0 + W - 1, end - 1})};
      };
      if constexpr (I4) {  // fused: scores and values straight from the codes (paged_attention_int4.h)
        int lo[kvexport_int4::kMaxRows], hi[kvexport_int4::kMaxRows];
        for (int64_t r = 0; r < rows; ++r) {
          const auto [j_lo, j_hi] = visible(r);
          lo[r] = static_cast<int>(std::min<int64_t>(j_lo - c0, W));
          hi[r] = static_cast<int>(j_hi - c0);
        }
        kvexport_int4::attend_chunk(q, static_cast<int>(rows), d, &kb->byte, &vb->byte, rs, lo, hi, a.logit_softcap,
                                    m, l, acc);
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          const auto [j_lo, j_hi] = visible(r);
          if (j_lo > j_hi) continue;
          for (int64_t j = j_lo; j <= j_hi; ++j) s[j - j_lo] = dot<NV>(q + r * d, kb + (j - c0) * d, d);
          const int64_t n = j_hi - j_lo + 1;
          if (a.logit_softcap > 0.f)  // lanes >= n: reset below
            for (int c = 0; c < W; c += kReg) store_reg(s + c, vsoftcap(load_reg(s + c), a.logit_softcap));
          float mx = kNegInf;
          for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
          for (int64_t j = n; j < W; ++j) s[j] = kNegInf;
          const float m_new = std::max(m[r], mx);
          const float alpha = std::exp(m[r] - m_new);  // 0 on the first visible block
          vreg p[W / kReg];
          for (int c = 0; c < W / kReg; ++c) {
            p[c] = vexp(load_reg(s + c * kReg) - m_new);
            store_reg(s + c * kReg, p[c]);
          }
          l[r] = l[r] * alpha + hsum_regs(p);
          m[r] = m_new;
          accumulate<NV>(acc + r * d, alpha, s, 1, vb + (j_lo - c0) * d, n, d);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (I4) kvexport_int4::from_group_order(acc + r * d, d);
    tl.store_output(acc + r * d, st.out + (tl.token(t, r) * a.num_heads + tl.head(t, r)) * d, l[r], m[r],
                    tl.head(t, r));
  }
}

// Many rows (prompt tiles): scores are computed RG rows at a time (one register: 16 with
// AVX-512, 8 with AVX2), vectorised over rows (queries transposed once per task), so a key's
// elements are broadcast and no horizontal sums are needed: s[j][row] += qt[d][row] * k[j][d].
// Rows are independent lanes: a row's operations are the same whatever RG is.
template <int NV, typename KV>
void attend_rows(const Step& st, const Task& t) {
  constexpr int RG = kReg;
  // keys scored per pass over d: W accumulators where 32 registers hold them (AVX-512), 8 of
  // AVX2's 16 (W would spill every one of them, every element of d)
  constexpr int KJ = kReg == 16 ? W : 8;
  const Attrs& a = st.a;
  const Tile tl(st, t);
  const int64_t d = NV > 0 ? NV * 16 : tl.d, bs = a.block_size, rows = tl.rows, rs = a.row;
  const int64_t groups = (rows + RG - 1) / RG;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(groups * RG * (2 * d + 2) + RG * W + 2 * W * d));
  float* qt = scratch.data();         // [groups][d][RG]
  float* acc = qt + groups * RG * d;  // [groups * RG][d]
  float* m = acc + groups * RG * d;   // [groups * RG]
  float* l = m + groups * RG;
  float* p = l + groups * RG;  // [W][RG] probabilities of one chunk
  float* kv_f = p + RG * W;    // int8 / int4 pools: [2][W][d] the chunk's keys and values as float32
  std::fill(qt, qt + groups * RG * d, 0.f);
  std::fill(acc, acc + groups * RG * d, 0.f);
  std::fill(m, m + groups * RG, kNegInf);
  std::fill(l, l + groups * RG, 0.f);
  alignas(64) int32_t posv[RG];
  for (int64_t r = 0; r < rows; ++r) {
    tl.load_query(st.query + (tl.token(t, r) * a.num_heads + tl.head(t, r)) * d, qt + (r / RG) * d * RG + r % RG,
                  RG, a.scale);
  }
  const KV* kpool = static_cast<const KV*>(st.key_cache);
  const KV* vpool = static_cast<const KV*>(st.value_cache);
  const int64_t* table = st.tables + t.seq * st.max_blocks;
  for (int64_t j0 = tl.first - tl.first % bs; j0 <= tl.last; j0 += bs) {  // one block
    const size_t base = static_cast<size_t>((t.kv_head * st.num_blocks + table[j0 / bs]) * bs) * rs;
    const int64_t end = std::min(j0 + bs, tl.last + 1);
    for (int64_t c0 = j0; c0 < end; c0 += W) {  // up to W keys of the block
      const int64_t n = std::min<int64_t>(W, end - c0);
      const KV* kb = kpool + base + (c0 - j0) * rs;
      const KV* vb = vpool + base + (c0 - j0) * rs;
      const float* kf = nullptr;  // the chunk's keys / values as float32
      const float* vf = nullptr;
      if constexpr (std::is_same_v<KV, float>) {
        kf = kb;
        vf = vb;
      } else if constexpr (std::is_same_v<KV, Int4>) {  // rows -> float once per chunk
        kvexport_int4::dequantize_rows(kb, n, d, rs, kv_f);
        kvexport_int4::dequantize_rows(vb, n, d, rs, kv_f + W * d);
        kf = kv_f;
        vf = kv_f + W * d;
      } else {  // int8 codes -> float once per chunk, shared by every row group
        int64_t i = 0;
        for (; i + kReg <= n * d; i += kReg) {
          store_reg(kv_f + i, load_reg(kb + i));
          store_reg(kv_f + W * d + i, load_reg(vb + i));
        }
        for (; i < n * d; ++i) {
          kv_f[i] = static_cast<float>(kb[i]);
          kv_f[W * d + i] = static_cast<float>(vb[i]);
        }
        kf = kv_f;
        vf = kv_f + W * d;
      }
      const float* kr[W];
      for (int j = 0; j < W; ++j) kr[j] = kf + std::min<int64_t>(j, n - 1) * d;  // keys past n: masked
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t r0 = gi * RG;
        for (int i = 0; i < RG; ++i)  // positions relative to c0 (pad rows: -1, nothing visible)
          posv[i] = r0 + i < rows ? static_cast<int32_t>(tl.pos(t, r0 + i) - c0) : -1;
        vregi rp;
        std::memcpy(&rp, posv, sizeof rp);
        vreg sc[W];
        const float* qg = qt + gi * d * RG;
#pragma GCC unroll 2
        for (int j1 = 0; j1 < W; j1 += KJ) {
          vreg s[KJ];
#pragma GCC unroll 16
          for (int j = 0; j < KJ; ++j) s[j] = vreg{};
          for (int64_t i = 0; i < d; ++i) {
            const vreg qi = load_reg(qg + i * RG);
#pragma GCC unroll 16
            for (int j = 0; j < KJ; ++j) s[j] += qi * kr[j1 + j][i];
          }
#pragma GCC unroll 16
          for (int j = 0; j < KJ; ++j) sc[j1 + j] = s[j];
        }
        vreg mx = vreg{} + kNegInf;
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) {  // key c0 + j is visible to a row at pos iff j <= pos (and window)
          if (a.logit_softcap > 0.f) sc[j] = vsoftcap(sc[j], a.logit_softcap);
          vregi vis = rp >= j;
          if (j >= n) vis = vregi{};
          if (a.sliding_window > 0) vis &= (rp - j) < static_cast<int32_t>(a.sliding_window);
          sc[j] = vis ? sc[j] : vreg{} + kNegInf;
          mx = mx > sc[j] ? mx : sc[j];
        }
        const vreg m_old = load_reg(m + r0);
        const vreg m_new = m_old > mx ? m_old : mx;
        const vreg m_safe = m_new == kNegInf ? vreg{} : m_new;  // rows with nothing visible yet
        const vreg alpha = vexp(m_old - m_safe);
        vreg sum = vreg{};
#pragma GCC unroll 16
        for (int j = 0; j < W; ++j) {
          const vreg pj = vexp(sc[j] - m_safe);
          sum += pj;
          store_reg(p + j * RG, pj);
        }
        store_reg(l + r0, load_reg(l + r0) * alpha + sum);
        store_reg(m + r0, m_new);
        for (int64_t i = 0; i < RG && r0 + i < rows; ++i)
          accumulate<NV>(acc + (r0 + i) * d, alpha[i], p + i, RG, vf, n, d);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    tl.store_output(acc + r * d, st.out + (tl.token(t, r) * a.num_heads + tl.head(t, r)) * d, l[r], m[r],
                    tl.head(t, r));
}

// Importance scores (optional input 11 / output 3, spec.py "Attention scores"): the last obs tokens of
// sequence s are observation queries; scores[s, h, j] = sum over them and over the G query heads of KV
// head h of softmax(q · k)_j. Run after the attention (the pools hold this step's keys), one task per
// (sequence, KV head): each writes only its own row, so the tasks need no synchronisation.
// NOTE: a second pass over the observed rows' keys, inside the op: the online softmax above ends
// with m and l but never holds every p_j, and keeping them for all rows would cost O(rows x keys) for
// the few rows that are observed. Accumulated in double (sums of up to obs x G probabilities).
struct ScoreTask {
  int64_t seq, kv_head;
};

struct ScoreStep {
  const Step* st;
  const int64_t* obs;  // [S] observation_lens
  float* scores;       // [S, kvH, score_len]
  int64_t score_len;
  std::vector<ScoreTask> tasks;
};

template <typename KV>
void score_task(void* user, size_t i) {
  const ScoreStep& sc = *static_cast<const ScoreStep*>(user);
  const Step& st = *sc.st;
  const Attrs& a = st.a;
  const ScoreTask& t = sc.tasks[i];
  const int64_t d = a.head_dim, g = a.num_heads / a.num_kv_heads, bs = a.block_size, rs = a.row;
  const int64_t q_start = st.qsl[t.seq], q_len = st.qsl[t.seq + 1] - q_start, total = st.seq_lens[t.seq];
  const int64_t ctx = total - q_len, obs = std::min(sc.obs[t.seq], q_len);
  const int64_t* table = st.tables + t.seq * st.max_blocks;
  const KV* kpool = static_cast<const KV*>(st.key_cache);
  const float* k_scale = a.int8 ? st.k_scale + t.kv_head * d : nullptr;
  std::vector<float> keys(static_cast<size_t>(total * d));  // this head's keys [total, d] as float32
  for (int64_t j = 0; j < total; ++j) {
    const KV* row = kpool + static_cast<size_t>(((t.kv_head * st.num_blocks + table[j / bs]) * bs + j % bs) * rs);
    float* dst = keys.data() + j * d;
    if constexpr (std::is_same_v<KV, Int4>) {
      kvexport_int4::dequantize_rows(row, 1, d, rs, dst);
    } else {
      for (int64_t c = 0; c < d; ++c) dst[c] = to_f(row[c]) * (k_scale ? k_scale[c] : 1.f);
    }
  }
  std::vector<double> p(static_cast<size_t>(total)), acc(static_cast<size_t>(total), 0.0);
  for (int64_t qi = q_len - obs; qi < q_len; ++qi) {
    const int64_t pos = ctx + qi;
    const int64_t first = a.sliding_window > 0 ? std::max<int64_t>(0, pos - a.sliding_window + 1) : 0;
    for (int64_t hq = t.kv_head * g; hq < (t.kv_head + 1) * g; ++hq) {
      const float* q = st.query + ((q_start + qi) * a.num_heads + hq) * d;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = first; j <= pos; ++j) {
        double s = 0.0;
        const float* k = keys.data() + j * d;
        for (int64_t c = 0; c < d; ++c) s += static_cast<double>(q[c]) * k[c];
        s *= a.scale;
        if (a.logit_softcap > 0.f) s = a.logit_softcap * std::tanh(s / a.logit_softcap);
        p[j] = s;
        m = std::max(m, s);
      }
      const double sink = a.sinks ? static_cast<double>(a.sinks[hq]) : -std::numeric_limits<double>::infinity();
      m = std::max(m, sink);
      double l = a.sinks ? std::exp(sink - m) : 0.0;
      for (int64_t j = first; j <= pos; ++j) l += (p[j] = std::exp(p[j] - m));
      for (int64_t j = first; j <= pos; ++j) acc[j] += p[j] / l;
    }
  }
  float* out = sc.scores + (t.seq * a.num_kv_heads + t.kv_head) * sc.score_len;
  for (int64_t j = 0; j < total; ++j) out[j] = static_cast<float>(acc[j]);
}

constexpr int64_t kRowsMin = 8;  // tasks with fewer rows take the dot-product path
static_assert(kRowsMin - 1 <= kvexport_int4::kMaxRows, "int4 decode tasks: attend_chunk's row count");

template <int NV, typename KV>
void run_task(void* user, size_t i) {
  const Step& st = *static_cast<const Step*>(user);
  const Task& t = st.tasks[i];
  if ((t.i1 - t.i0) * (st.a.num_heads / st.a.num_kv_heads) < kRowsMin)
    attend_dots<NV, KV>(st, t);
  else
    attend_rows<NV, KV>(st, t);
}

template <typename KV>
void (*task_fn(int64_t head_dim))(void*, size_t) {
  switch (head_dim) {
    case 32: return run_task<2, KV>;
    case 64: return run_task<4, KV>;
    case 96: return run_task<6, KV>;
    case 128: return run_task<8, KV>;
    // Gemma 2/3/4 and Qwen3.5 / Qwen3-Next attention layers (before these, their heads took the scalar
    // path: at Qwen3.5's 8 x 256 heads a 32k-token decode ran 2.4x slower than the standard-ONNX form)
    case 256: return run_task<16, KV>;
    case 512: return run_task<32, KV>;
    default: return run_task<0, KV>;
  }
}

int8_t quantize(float x, float scale) {  // ONNX QuantizeLinear, zero point 0
  const float q = std::nearbyint(x / scale);  // IEEE float32 division, round half to even
  return static_cast<int8_t>(std::min(127.f, std::max(-128.f, q)));
}

constexpr const char* kOp = "PagedAttention";

[[noreturn]] void fail(const std::string& msg) { kvexport_paged::fail(kOp, msg); }

using kvexport_paged::shape_of;

struct Kernel {
  Attrs a;
  std::vector<float> sinks;  // a.sinks points here (the kernel object is never moved)

  Kernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    a.num_heads = ki.GetAttribute<int64_t>("num_heads");
    a.num_kv_heads = ki.GetAttribute<int64_t>("num_kv_heads");
    a.head_dim = ki.GetAttribute<int64_t>("head_dim");
    a.block_size = ki.GetAttribute<int64_t>("block_size");
    a.sliding_window = ki.GetAttribute<int64_t>("sliding_window");
    a.scale = ki.GetAttribute<float>("scale");
    a.logit_softcap = 0.f;  // optional: graphs exported before soft-capping lack it
    if (OrtStatus* missing = Ort::GetApi().KernelInfoGetAttribute_float(info, "logit_softcap", &a.logit_softcap)) {
      Ort::GetApi().ReleaseStatus(missing);
      a.logit_softcap = 0.f;
    }
    const std::string kv = ki.GetAttribute<std::string>("kv_dtype");
    if (kv != "float32" && kv != "int8" && kv != "int4")
      fail("kv_dtype " + kv + " runs only as a TensorRT plugin; the CPU op takes float32, int8 or int4 pools");
    a.int8 = kv == "int8";
    a.int4 = kv == "int4";
    if (a.int4 && (a.head_dim < 1 || a.head_dim % kvexport_int4::kGroup)) fail("int4 KV needs head_dim a multiple of 32");
    a.row = a.int4 ? kvexport_int4::row_bytes(a.head_dim) : a.head_dim;
    if (a.num_heads < 1 || a.num_kv_heads < 1 || a.head_dim < 1 || a.block_size < 1 || a.num_heads % a.num_kv_heads)
      fail("bad head attributes");
    if (a.sliding_window < 0 || a.sliding_window > std::numeric_limits<int32_t>::max())
      fail("sliding_window must be in [0, 2^31)");
    if (!(a.scale > 0.f)) fail("scale must be > 0");
    if (!(a.logit_softcap >= 0.f) || std::isinf(a.logit_softcap)) fail("logit_softcap must be finite and >= 0 (0 = off)");
    sinks = kvexport_sinks::read(info, a.num_heads);  // optional: absent = no sinks
    a.sinks = sinks.empty() ? nullptr : sinks.data();
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return kvexport_paged::as_status([&] { Compute(context); });
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const size_t n_in = ctx.GetInputCount();
    if (n_in != kInputs && n_in != kInputs + 1) fail("expects 11 inputs (12 with observation_lens)");
    // scoring (spec.py "Attention scores"): observation_lens given and attention_scores asked for
    const bool scoring = n_in == kInputs + 1 && ctx.GetInput(kInputs) != nullptr && ctx.GetOutputCount() > 3;
    Ort::ConstValue query = ctx.GetInput(0), key = ctx.GetInput(1), value = ctx.GetInput(2);
    Ort::ConstValue kc = ctx.GetInput(3), vc = ctx.GetInput(4);
    const auto qs = shape_of(query), ks = shape_of(key), vs = shape_of(value), ps = shape_of(kc);
    const auto bt = shape_of(ctx.GetInput(5)), sl = shape_of(ctx.GetInput(6)), ql = shape_of(ctx.GetInput(7));
    const auto sm = shape_of(ctx.GetInput(8));
    const int64_t T = qs.size() == 3 ? qs[0] : -1, H = a.num_heads, kvH = a.num_kv_heads, D = a.head_dim;
    if (qs != std::vector<int64_t>{T, H, D}) fail("query must be [num_tokens, num_heads, head_dim]");
    if (ks != std::vector<int64_t>{T, kvH, D} || vs != ks) fail("key/value must be [num_tokens, num_kv_heads, head_dim]");
    if (ps.size() != 4 || ps[0] != kvH || ps[2] != a.block_size || ps[3] != a.row || shape_of(vc) != ps)
      fail("pools must be [num_kv_heads, num_blocks, block_size, head_dim] (int4: head_dim / 2 + head_dim / 16 "
           "bytes), key and value alike");
    const ONNXTensorElementDataType pool_type = kc.GetTensorTypeAndShapeInfo().GetElementType();
    const ONNXTensorElementDataType want = a.int8   ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8
                                           : a.int4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
                                                    : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if (pool_type != want || vc.GetTensorTypeAndShapeInfo().GetElementType() != want)
      fail("pool element type does not match kv_dtype");
    kvexport_paged::check_index_shapes(kOp, bt, sl, ql, sm, T);
    const int64_t S = sl[0], NB = ps[1], MB = bt[1], bs = a.block_size;
    const auto kss = shape_of(ctx.GetInput(9));
    const bool per_head = kss == std::vector<int64_t>{kvH};  // builds calibrated before per-channel scales
    if ((!per_head && kss != std::vector<int64_t>{kvH, D}) || shape_of(ctx.GetInput(10)) != kss)
      fail("k_scale/v_scale must both be [num_kv_heads, head_dim] (per channel) or [num_kv_heads] (per head)");

    Step st;
    st.a = a;
    st.query = query.GetTensorData<float>();
    st.tables = ctx.GetInput(5).GetTensorData<int64_t>();
    st.seq_lens = ctx.GetInput(6).GetTensorData<int64_t>();
    st.qsl = ctx.GetInput(7).GetTensorData<int64_t>();
    st.k_scale = ctx.GetInput(9).GetTensorData<float>();
    st.v_scale = ctx.GetInput(10).GetTensorData<float>();
    std::vector<float> expanded;  // per-head scales repeated along head_dim: one layout below
    if (a.int8 && per_head) {
      expanded.resize(static_cast<size_t>(2 * kvH * D));
      for (int64_t h = 0; h < kvH; ++h)
        for (int64_t i = 0; i < D; ++i) {
          expanded[h * D + i] = st.k_scale[h];
          expanded[(kvH + h) * D + i] = st.v_scale[h];
        }
      st.k_scale = expanded.data();
      st.v_scale = expanded.data() + kvH * D;
    }
    st.num_blocks = NB;
    st.max_blocks = MB;
    const int64_t* slots = ctx.GetInput(8).GetTensorData<int64_t>();

    // validate the step's metadata before anything is written
    kvexport_paged::check_step(kOp, st.qsl, st.seq_lens, st.tables, slots, S, T, MB, NB, bs);
    const int64_t* obs = nullptr;
    if (scoring) {
      if (shape_of(ctx.GetInput(kInputs)) != std::vector<int64_t>{S}) fail("observation_lens must be [num_seqs]");
      obs = ctx.GetInput(kInputs).GetTensorData<int64_t>();
      for (int64_t s = 0; s < S; ++s)
        if (obs[s] < 0) fail("observation_lens must be >= 0");
    }
    if (a.int8)
      for (int64_t i = 0; i < kvH * D; ++i)
        if (!(st.k_scale[i] > 0.f) || !(st.v_scale[i] > 0.f)) fail("int8 scales must be > 0");

    Ort::UnownedValue out = ctx.GetOutput(0, qs);
    Ort::UnownedValue kc_out = ctx.GetOutput(1, ps), vc_out = ctx.GetOutput(2, ps);
    st.out = out.GetTensorMutableData<float>();
    const size_t elem = a.int8 || a.int4 ? 1 : 4;
    const size_t pool_bytes = static_cast<size_t>(kvH * NB * bs * a.row) * elem;
    void* kdst = kc_out.GetTensorMutableRawData();
    void* vdst = vc_out.GetTensorMutableRawData();
    if (kdst != kc.GetTensorRawData()) std::memcpy(kdst, kc.GetTensorRawData(), pool_bytes);
    if (vdst != vc.GetTensorRawData()) std::memcpy(vdst, vc.GetTensorRawData(), pool_bytes);
    st.key_cache = kdst;
    st.value_cache = vdst;

    // 1. store this step's K/V
    const float* kin = key.GetTensorData<float>();
    const float* vin = value.GetTensorData<float>();
    for (int64_t t = 0; t < T; ++t) {
      if (slots[t] < 0) continue;
      const int64_t b = slots[t] / bs, o = slots[t] % bs;
      for (int64_t h = 0; h < kvH; ++h) {
        const size_t at = static_cast<size_t>(((h * NB + b) * bs + o) * a.row);
        const float* ksrc = kin + (t * kvH + h) * D;
        const float* vsrc = vin + (t * kvH + h) * D;
        if (a.int4) {
          kvexport_int4::quantize_row(ksrc, D, static_cast<uint8_t*>(kdst) + at);
          kvexport_int4::quantize_row(vsrc, D, static_cast<uint8_t*>(vdst) + at);
        } else if (a.int8) {
          int8_t* kp = static_cast<int8_t*>(kdst) + at;
          int8_t* vp = static_cast<int8_t*>(vdst) + at;
          for (int64_t i = 0; i < D; ++i) {
            kp[i] = quantize(ksrc[i], st.k_scale[h * D + i]);
            vp[i] = quantize(vsrc[i], st.v_scale[h * D + i]);
          }
        } else {
          std::memcpy(static_cast<float*>(kdst) + at, ksrc, D * sizeof(float));
          std::memcpy(static_cast<float*>(vdst) + at, vsrc, D * sizeof(float));
        }
      }
    }

    // 2. attend, one task per (sequence, KV head, tile of query tokens)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t q_len = st.qsl[s + 1] - st.qsl[s];
      for (int64_t i0 = 0; i0 < q_len; i0 += kTileTokens)
        for (int64_t h = 0; h < kvH; ++h) st.tasks.push_back({s, h, i0, std::min(q_len, i0 + kTileTokens)});
    }
    // longest context first, so the thread pool ends together
    std::sort(st.tasks.begin(), st.tasks.end(), [&](const Task& x, const Task& y) {
      return st.seq_lens[x.seq] - (st.qsl[x.seq + 1] - st.qsl[x.seq]) + x.i1 >
             st.seq_lens[y.seq] - (st.qsl[y.seq + 1] - st.qsl[y.seq]) + y.i1;
    });
    if (!st.tasks.empty())
      ctx.ParallelFor(a.int4 ? task_fn<Int4>(D) : a.int8 ? task_fn<int8_t>(D) : task_fn<float>(D), st.tasks.size(), 0,
                      &st);

    // 3. attention scores of the observation queries: [S, kvH, max_blocks * block_size], 0 where unobserved
    if (ctx.GetOutputCount() > 3) {
      ScoreStep sc{&st, obs, nullptr, MB * bs, {}};
      Ort::UnownedValue scores = ctx.GetOutput(3, std::vector<int64_t>{S, kvH, sc.score_len});
      sc.scores = scores.GetTensorMutableData<float>();
      std::fill(sc.scores, sc.scores + S * kvH * sc.score_len, 0.f);
      for (int64_t s = 0; obs != nullptr && s < S; ++s)
        if (obs[s] > 0 && st.qsl[s + 1] > st.qsl[s])
          for (int64_t h = 0; h < kvH; ++h) sc.tasks.push_back({s, h});
      if (!sc.tasks.empty())
        ctx.ParallelFor(a.int4 ? score_task<Int4> : a.int8 ? score_task<int8_t> : score_task<float>, sc.tasks.size(), 0,
                        &sc);
    }
  }
};

// Output 0 has the query's type and shape, outputs 1 and 2 the pools' (float32, int8 or uint8);
// output 3 (attention_scores, float32 [S, kvH, score_len]) is left to the graph's declared shape.
OrtStatusPtr infer_types(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const size_t from[3] = {0, 3, 4};
  for (size_t i = 0; i < 3; ++i)
    if (OrtStatusPtr st = kvexport_paged::infer_like(ctx, i, from[i], "kvexport_paged_attention_dim_")) return st;
  return nullptr;
}

struct Op : Ort::CustomOpBase<Op, Kernel, true> {
  Op() { OrtCustomOp::InferOutputShapeFn = infer_types; }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return kvexport_paged::as_status([&] { *kernel = new Kernel(api, info); });
  }
  const char* GetName() const { return "PagedAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kInputs + 1; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == kInputs) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;  // observation_lens
    if (i <= 2 || i >= 9) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    if (i <= 4) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float32, int8 or int4 (uint8) pools
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == kInputs ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 0 || i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;  // attention_scores
  }
};

}  // namespace

extern "C" {

// The onnxruntime entry point for `SessionOptions.register_custom_ops_library(path)`.
__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr)  // an onnxruntime older than these headers (native.py checks first)
    return api_base->GetApi(1)->CreateStatus(ORT_FAIL, "kvexport::PagedAttention was compiled against a newer "
                                                       "onnxruntime API than the one loading it: rebuild it");
  Ort::InitApi(api);
  static Op op;
  static OrtCustomOpDomain* domain = [] {
    OrtCustomOpDomain* d = nullptr;
    Ort::ThrowOnError(Ort::GetApi().CreateCustomOpDomain("kvexport", &d));
    Ort::ThrowOnError(Ort::GetApi().CustomOpDomain_Add(d, &op));
    Ort::ThrowOnError(Ort::GetApi().CustomOpDomain_Add(d, const_cast<OrtCustomOp*>(kvexport_mla::custom_op())));
    Ort::ThrowOnError(Ort::GetApi().CustomOpDomain_Add(d, const_cast<OrtCustomOp*>(kvexport_gdn::custom_op())));
    return d;
  }();
  return api->AddCustomOpDomain(options, domain);
}

// For the loader: the API version this library was compiled against.
__attribute__((visibility("default"))) int kvexport_ort_api_version() { return ORT_API_VERSION; }
}
