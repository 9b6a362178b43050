// kvexport::GatedDeltaRule as a native onnxruntime custom op for the CPU execution provider: the
// gated delta rule of gated DeltaNet layers (Qwen3.5, Qwen3-Next) over packed sequences whose
// recurrent states are read from the state pool by slot.
//
// The contract is plugins/gated_delta/spec.py; reference.py is the executable definition this file
// is tested against (tests/plugins/test_gated_delta_cpu_op.py). Compiled into the same library as
// PagedAttention (plugins/paged_attention/native.py) and registered in the same domain.
//
// Work: one task per (sequence, value head, tile of JT = 16 value channels) on onnxruntime's intra-op
// pool. The columns of a head's state S [Dk][Dv] are independent in the rule, so a task keeps its
// [Dk][16] tile (8 KiB at Dk 128: in L1) and runs the recurrence over all the sequence's new tokens,
// one fused pass over the tile per token:
//   delta = beta (v - kv);  S += k ⊗ delta;  o = Sᵀq;  S *= exp(g');  kv = Sᵀk'   (' = the next token)
// The inner loops run over the 16 columns (two AVX2 / one AVX-512 vector, unrolled by the compiler
// for -march). Prefill uses the same recurrence (README "The CPU op": measured against the `onnx`
// form's chunked WY / UT rule).
// The pool is only read; new states go to output 1 (spec.py: the runtime stores them after the step).

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../../common/cpu/paged_op.h"  // errors, exceptions as statuses, shape inference
#include "gated_delta_ort.h"

namespace {

constexpr int kInputs = 9;
constexpr const char* kOp = "GatedDeltaRule";
constexpr float kEps = 1e-6f;  // l2norm epsilon (spec.L2NORM_EPS)
constexpr int JT = 16;          // value channels per task (a state tile [Dk][JT])

[[noreturn]] void fail(const std::string& msg) { kvexport_paged::fail(kOp, msg); }

using kvexport_paged::shape_of;

struct Attrs {
  int64_t hk = 0, hv = 0, dk = 0, dv = 0;
  float scale = 1.f;
  bool l2norm = true;
};

struct Step {
  Attrs a;
  const float *q, *k, *v, *g, *beta, *pool;
  const int64_t *slots, *seq_lens, *qsl;
  float *out, *new_state;
};

// q or k of one token and q/k head, l2-normalised (spec) and scaled, into dst [Dk]
void prepare(const float* src, int64_t n, bool norm, float scale, float* dst) {
  float f = scale;
  if (norm) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += src[i] * src[i];
    f = scale / std::sqrt(ss + kEps);
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * f;
}

// One token's rank-1 update and output over a [Dk][JT] state tile, fused with the next token's decay
// and Sᵀk (NEXT): r = S[i] + k[i] delta; o += r q[i]; S[i] = r (NEXT: S[i] = r e'; kv' += S[i] k'[i]).
template <bool NEXT>
void update(float* __restrict S, int64_t dk, const float* __restrict k, const float* __restrict q,
            const float* __restrict delta, float* __restrict o, float e_next, const float* __restrict k_next,
            float* __restrict kv_next) {
  float acc[JT] = {}, kvn[JT] = {};
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict row = S + i * JT;
    const float ki = k[i], qi = q[i];
    for (int j = 0; j < JT; ++j) {
      float r = row[j] + ki * delta[j];
      acc[j] += r * qi;
      if (NEXT) {
        r *= e_next;
        kvn[j] += r * k_next[i];
      }
      row[j] = r;
    }
  }
  for (int j = 0; j < JT; ++j) o[j] = acc[j];
  if (NEXT)
    for (int j = 0; j < JT; ++j) kv_next[j] = kvn[j];
}

// task = (s * Hv + h) * tiles + jt: sequence s, value head h, value channels [jt * JT, jt * JT + JT).
// NOTE: the columns of S are independent in the rule (column j only sees v[j], delta[j], o[j]), so a
// task runs every token of the sequence over its [Dk][JT] tile (8 KiB at Dk 128: in L1), one pass
// per token (the update fused with the next token's decay and Sᵀk), instead of streaming the head's
// whole state through the cache twice per token.
void run_task(void* data, size_t task) {
  const Step& st = *static_cast<const Step*>(data);
  const Attrs& a = st.a;
  const int64_t tiles = (a.dv + JT - 1) / JT, dk = a.dk, dv = a.dv;
  const int64_t jt = static_cast<int64_t>(task) % tiles, sh = static_cast<int64_t>(task) / tiles;
  const int64_t s = sh / a.hv, h = sh % a.hv, c = h / (a.hv / a.hk), j0 = jt * JT;
  const int w = static_cast<int>(std::min<int64_t>(JT, dv - j0));  // real columns of this tile
  const int64_t t0 = st.qsl[s], t1 = st.qsl[s + 1], ctx = st.seq_lens[s] - (t1 - t0);
  std::vector<float> buf(dk * JT + 4 * dk);
  float* __restrict S = buf.data();  // [Dk][JT], padding columns stay 0 (their v is 0)
  float* qk[2][2] = {{S + dk * JT, S + dk * JT + dk}, {S + dk * JT + 2 * dk, S + dk * JT + 3 * dk}};
  if (ctx > 0) {
    const float* src = st.pool + (st.slots[s] * a.hv + h) * dk * dv + j0;
    for (int64_t i = 0; i < dk; ++i) std::memcpy(S + i * JT, src + i * dv, sizeof(float) * w);
  }
  float kv[JT] = {}, delta[JT], o[JT], v[JT] = {};
  auto load_qk = [&](int64_t t, int slot) {
    prepare(st.q + (t * a.hk + c) * dk, dk, a.l2norm, a.scale, qk[slot][0]);
    prepare(st.k + (t * a.hk + c) * dk, dk, a.l2norm, 1.f, qk[slot][1]);
  };
  if (t0 < t1) {  // the first token's decay and Sᵀk
    load_qk(t0, 0);
    const float e = std::exp(st.g[t0 * a.hv + h]);
    const float* k = qk[0][1];
    for (int64_t i = 0; i < dk; ++i)
      for (int j = 0; j < JT; ++j) {
        S[i * JT + j] *= e;
        kv[j] += S[i * JT + j] * k[i];
      }
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int cur = static_cast<int>((t - t0) & 1);
    const float b = st.beta[t * a.hv + h];
    std::memcpy(v, st.v + (t * a.hv + h) * dv + j0, sizeof(float) * w);
    for (int j = 0; j < JT; ++j) delta[j] = (v[j] - kv[j]) * b;
    if (t + 1 < t1) {
      load_qk(t + 1, cur ^ 1);
      update<true>(S, dk, qk[cur][1], qk[cur][0], delta, o, std::exp(st.g[(t + 1) * a.hv + h]), qk[cur ^ 1][1], kv);
    } else {
      update<false>(S, dk, qk[cur][1], qk[cur][0], delta, o, 0.f, nullptr, nullptr);
    }
    std::memcpy(st.out + (t * a.hv + h) * dv + j0, o, sizeof(float) * w);
  }
  float* dst = st.new_state + (s * a.hv + h) * dk * dv + j0;
  for (int64_t i = 0; i < dk; ++i) std::memcpy(dst + i * dv, S + i * JT, sizeof(float) * w);
}

int64_t int_attr(const OrtKernelInfo* info, const char* name) {
  return Ort::ConstKernelInfo(info).GetAttribute<int64_t>(name);
}

struct Kernel {
  Attrs a;

  Kernel(const OrtApi&, const OrtKernelInfo* info) {
    a.hk = int_attr(info, "num_k_heads");
    a.hv = int_attr(info, "num_v_heads");
    a.dk = int_attr(info, "k_head_dim");
    a.dv = int_attr(info, "v_head_dim");
    a.scale = Ort::ConstKernelInfo(info).GetAttribute<float>("scale");
    const int64_t l2 = int_attr(info, "use_qk_l2norm");
    if (a.hk < 1 || a.hv < 1 || a.dk < 1 || a.dv < 1)
      fail("num_k_heads, num_v_heads, k_head_dim, v_head_dim must be >= 1");
    if (a.hv % a.hk) fail("num_v_heads must be a multiple of num_k_heads");
    if (!(a.scale > 0.f) || std::isinf(a.scale)) fail("scale must be finite and > 0");
    if (l2 != 0 && l2 != 1) fail("use_qk_l2norm must be 0 or 1");
    a.l2norm = l2 == 1;
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return kvexport_paged::as_status([&] { Compute(context); });
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    if (ctx.GetInputCount() != kInputs) fail("expects 9 inputs");
    const auto qs = shape_of(ctx.GetInput(0)), ks = shape_of(ctx.GetInput(1)), vs = shape_of(ctx.GetInput(2));
    const auto gs = shape_of(ctx.GetInput(3)), bs = shape_of(ctx.GetInput(4)), ps = shape_of(ctx.GetInput(5));
    const auto ss = shape_of(ctx.GetInput(6)), ls = shape_of(ctx.GetInput(7)), qls = shape_of(ctx.GetInput(8));
    const int64_t T = qs.size() == 3 ? qs[0] : -1;
    if (qs != std::vector<int64_t>{T, a.hk, a.dk} || ks != qs)
      fail("query and key must be [num_tokens, num_k_heads, k_head_dim]");
    if (vs != std::vector<int64_t>{T, a.hv, a.dv}) fail("value must be [num_tokens, num_v_heads, v_head_dim]");
    if (gs != std::vector<int64_t>{T, a.hv} || bs != gs) fail("g and beta must be [num_tokens, num_v_heads]");
    if (ps.size() != 4 || ps[1] != a.hv || ps[2] != a.dk || ps[3] != a.dv)
      fail("recurrent_state must be [num_state_slots, num_v_heads, k_head_dim, v_head_dim]");
    if (ss.size() != 1 || ls != ss || qls != std::vector<int64_t>{ss[0] + 1})
      fail("state_slots [S], seq_lens [S], query_start_loc [S+1] disagree");
    const int64_t S = ss[0], NS = ps[0];
    Step st;
    st.a = a;
    st.q = ctx.GetInput(0).GetTensorData<float>();
    st.k = ctx.GetInput(1).GetTensorData<float>();
    st.v = ctx.GetInput(2).GetTensorData<float>();
    st.g = ctx.GetInput(3).GetTensorData<float>();
    st.beta = ctx.GetInput(4).GetTensorData<float>();
    st.pool = ctx.GetInput(5).GetTensorData<float>();
    st.slots = ctx.GetInput(6).GetTensorData<int64_t>();
    st.seq_lens = ctx.GetInput(7).GetTensorData<int64_t>();
    st.qsl = ctx.GetInput(8).GetTensorData<int64_t>();
    // the step's metadata, checked before any work
    if (st.qsl[0] != 0 || st.qsl[S] != T) fail("query_start_loc must start at 0 and end at num_tokens");
    for (int64_t s = 0; s < S; ++s) {
      const int64_t q_len = st.qsl[s + 1] - st.qsl[s];
      if (q_len < 0) fail("query_start_loc must be non-decreasing");
      if (st.seq_lens[s] < q_len) fail("seq_lens[s] is smaller than the sequence's new tokens");
      if (st.seq_lens[s] > q_len && (st.slots[s] < 0 || st.slots[s] >= NS))
        fail("state_slots names a slot outside the recurrent_state pool");
    }
    st.out = ctx.GetOutput(0, {T, a.hv, a.dv}).GetTensorMutableData<float>();
    st.new_state = ctx.GetOutput(1, {S, a.hv, a.dk, a.dv}).GetTensorMutableData<float>();
    const int64_t tasks = S * a.hv * ((a.dv + JT - 1) / JT);
    if (tasks > 0) ctx.ParallelFor(run_task, static_cast<size_t>(tasks), 0, &st);
  }
};

// Output 0: the value input's type and shape [T, Hv, Dv]; output 1: [S, Hv, Dk, Dv] float32, S from
// state_slots, the rest from the pool.
OrtStatusPtr infer_types(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  if (OrtStatusPtr st = kvexport_paged::infer_like(ctx, 0, 2, "kvexport_gated_delta_dim_")) return st;
  OrtTensorTypeAndShapeInfo *slots = nullptr, *pool = nullptr;  // owned by the context
  if (OrtStatusPtr st = api.ShapeInferContext_GetInputTypeShape(ctx, 6, &slots)) return st;
  if (OrtStatusPtr st = api.ShapeInferContext_GetInputTypeShape(ctx, 5, &pool)) return st;
  size_t rs = 0, rp = 0;
  if (OrtStatusPtr st = api.GetDimensionsCount(slots, &rs)) return st;
  if (OrtStatusPtr st = api.GetDimensionsCount(pool, &rp)) return st;
  if (rs != 1 || rp != 4) return nullptr;  // left to the run's checks
  int64_t sd = -1;
  const char* sname = nullptr;
  std::vector<int64_t> pd(4);
  std::vector<const char*> pn(4, nullptr);
  if (OrtStatusPtr st = api.GetDimensions(slots, &sd, 1)) return st;
  if (OrtStatusPtr st = api.GetSymbolicDimensions(slots, &sname, 1)) return st;
  if (OrtStatusPtr st = api.GetDimensions(pool, pd.data(), 4)) return st;
  if (OrtStatusPtr st = api.GetSymbolicDimensions(pool, pn.data(), 4)) return st;
  std::vector<int64_t> dims{sd, pd[1], pd[2], pd[3]};
  std::string own = sname && sname[0] ? sname : (sd < 0 ? "kvexport_gated_delta_seqs" : "");
  std::vector<const char*> names{own.c_str(), pn[1] ? pn[1] : "", pn[2] ? pn[2] : "", pn[3] ? pn[3] : ""};
  OrtTensorTypeAndShapeInfo* shaped = nullptr;
  if (OrtStatusPtr st = api.CreateTensorTypeAndShapeInfo(&shaped)) return st;
  OrtStatusPtr st = api.SetTensorElementType(shaped, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  if (!st) st = api.SetDimensions(shaped, dims.data(), 4);
  if (!st) st = api.SetSymbolicDimensions(shaped, names.data(), 4);
  if (!st) st = api.ShapeInferContext_SetOutputTypeShape(ctx, 1, shaped);
  api.ReleaseTensorTypeAndShapeInfo(shaped);
  return st;
}

struct Op : Ort::CustomOpBase<Op, Kernel, true> {
  Op() { OrtCustomOp::InferOutputShapeFn = infer_types; }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    return kvexport_paged::as_status([&] { *kernel = new Kernel(api, info); });
  }
  const char* GetName() const { return kOp; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kInputs; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i <= 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

namespace kvexport_gdn {

const OrtCustomOp* custom_op() {
  static Op op;
  return &op;
}

}  // namespace kvexport_gdn

extern "C" {
// For the loader (plugins/gated_delta/native.py): this library has GatedDeltaRule, in this contract version.
__attribute__((visibility("default"))) int kvexport_gated_delta_version() { return 1; }
}
