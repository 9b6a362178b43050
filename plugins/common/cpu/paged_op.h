// What the native CPU ops over a paged pool share (plugins/paged_attention/cpu/paged_attention_ort.cc,
// plugins/paged_mla/cpu/paged_mla_ort.cc): errors, the checks of a step's paged metadata before
// anything is written, exceptions turned into onnxruntime statuses, and output type / shape
// inference from an input. An op includes it after onnxruntime_cxx_api.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

namespace kvexport_paged {

// A user-facing error of op `op` ("kvexport::<op>: <msg>"), reported as ORT_INVALID_ARGUMENT.
[[noreturn]] inline void fail(const char* op, const std::string& msg) {
  throw std::invalid_argument(std::string("kvexport::") + op + ": " + msg);
}

inline std::vector<int64_t> shape_of(const Ort::ConstValue& v) { return v.GetTensorTypeAndShapeInfo().GetShape(); }

// f() with a std::exception turned into an ORT_INVALID_ARGUMENT status (CreateKernelV2, ComputeV2).
template <typename F>
OrtStatusPtr as_status(F&& f) {
  try {
    f();
    return nullptr;
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, e.what());
  }
}

// The shapes of the index inputs: block_tables [S, max_blocks], seq_lens [S], query_start_loc [S+1],
// slot_mapping [T].
inline void check_index_shapes(const char* op, const std::vector<int64_t>& bt, const std::vector<int64_t>& sl,
                               const std::vector<int64_t>& ql, const std::vector<int64_t>& sm, int64_t T) {
  if (bt.size() != 2 || sl.size() != 1 || bt[0] != sl[0] || ql != std::vector<int64_t>{sl[0] + 1} ||
      sm != std::vector<int64_t>{T})
    fail(op, "block_tables [S, max_blocks], seq_lens [S], query_start_loc [S+1], slot_mapping [T] disagree");
}

// The step's metadata, checked before anything is written: query_start_loc runs from 0 to T without
// going back; each sequence with new tokens has seq_lens covering them, fits its block table row
// (MB columns of blocks of bs slots) and names blocks of the pool (NB blocks); every slot is within
// the pool (slot -1: a token not stored).
inline void check_step(const char* op, const int64_t* qsl, const int64_t* seq_lens, const int64_t* tables,
                       const int64_t* slots, int64_t S, int64_t T, int64_t MB, int64_t NB, int64_t bs) {
  if (qsl[0] != 0 || qsl[S] != T) fail(op, "query_start_loc must start at 0 and end at num_tokens");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    if (q_len < 0) fail(op, "query_start_loc must be non-decreasing");
    if (seq_lens[s] < q_len) fail(op, "seq_lens[s] is smaller than the sequence's new tokens");
    if (q_len == 0) continue;
    if (seq_lens[s] > MB * bs) fail(op, "a sequence needs more blocks than block_tables has columns");
    const int64_t need = (seq_lens[s] + bs - 1) / bs;
    for (int64_t b = 0; b < need; ++b)
      if (tables[s * MB + b] < 0 || tables[s * MB + b] >= NB) fail(op, "block id out of range of the pool");
  }
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= NB * bs) fail(op, "slot_mapping points past the pool");
}

// Output `out` gets input `in`'s element type and shape; last_dim >= 0 replaces its last dim.
// NOTE: an input dim that is neither known nor named comes back as -1 with an empty name, and
// written back as it is it becomes dim_value -1, which later shape inference rejects (a Concat
// along that axis: "Negative dimension value"). Such dims get a name of their own instead
// (dim_prefix + a counter).
inline OrtStatusPtr infer_like(OrtShapeInferContext* ctx, size_t out, size_t in, const char* dim_prefix,
                               int64_t last_dim = -1) {
  const OrtApi& api = Ort::GetApi();
  static std::atomic<uint64_t> unnamed{0};
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context (not released here)
  if (OrtStatusPtr st = api.ShapeInferContext_GetInputTypeShape(ctx, in, &info)) return st;
  size_t rank = 0;
  if (OrtStatusPtr st = api.GetDimensionsCount(info, &rank)) return st;
  std::vector<int64_t> dims(rank);
  std::vector<const char*> names(rank, nullptr);
  if (rank) {
    if (OrtStatusPtr st = api.GetDimensions(info, dims.data(), rank)) return st;
    if (OrtStatusPtr st = api.GetSymbolicDimensions(info, names.data(), rank)) return st;
  }
  std::vector<std::string> own(rank);
  std::vector<const char*> out_names(rank);
  bool changed = false;
  for (size_t d = 0; d < rank; ++d) {
    out_names[d] = names[d] ? names[d] : "";
    if (dims[d] < 0 && out_names[d][0] == '\0') {
      own[d] = dim_prefix + std::to_string(unnamed++);
      out_names[d] = own[d].c_str();
      changed = true;
    }
  }
  if (last_dim >= 0 && rank) {
    dims[rank - 1] = last_dim;
    out_names[rank - 1] = "";
    changed = true;
  }
  if (!changed) return api.ShapeInferContext_SetOutputTypeShape(ctx, out, info);
  ONNXTensorElementDataType type;
  if (OrtStatusPtr st = api.GetTensorElementType(info, &type)) return st;
  OrtTensorTypeAndShapeInfo* shaped = nullptr;
  if (OrtStatusPtr st = api.CreateTensorTypeAndShapeInfo(&shaped)) return st;
  OrtStatusPtr st = api.SetTensorElementType(shaped, type);
  if (!st) st = api.SetDimensions(shaped, dims.data(), rank);
  if (!st) st = api.SetSymbolicDimensions(shaped, out_names.data(), rank);
  if (!st) st = api.ShapeInferContext_SetOutputTypeShape(ctx, out, shaped);
  api.ReleaseTensorTypeAndShapeInfo(shaped);
  return st;
}

}  // namespace kvexport_paged
