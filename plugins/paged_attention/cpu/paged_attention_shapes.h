// Output type and shape inference of the native CPU PagedAttention (paged_attention_ort.cc),
// kept apart so the op's file stays one noun: what onnxruntime's shape inference is told.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

namespace kvexport_shapes {

// Output 0 has the query's type and shape, outputs 1 and 2 the pools' (float32, int8 or uint8).
// NOTE: an input dim that is neither known nor named comes back as -1 with an empty name, and
// written back as it is it becomes dim_value -1, which later shape inference rejects (a Concat
// along that axis: "Negative dimension value"). Such dims get a name of their own instead.
inline OrtStatusPtr infer_types(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  static std::atomic<uint64_t> unnamed{0};
  const size_t from[3] = {0, 3, 4};
  for (size_t i = 0; i < 3; ++i) {
    OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context (not released here)
    if (OrtStatusPtr st = api.ShapeInferContext_GetInputTypeShape(ctx, from[i], &info)) return st;
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
    bool renamed = false;
    for (size_t d = 0; d < rank; ++d) {
      out_names[d] = names[d] ? names[d] : "";
      if (dims[d] < 0 && out_names[d][0] == '\0') {
        own[d] = "kvexport_paged_attention_dim_" + std::to_string(unnamed++);
        out_names[d] = own[d].c_str();
        renamed = true;
      }
    }
    if (!renamed) {
      if (OrtStatusPtr st = api.ShapeInferContext_SetOutputTypeShape(ctx, i, info)) return st;
      continue;
    }
    ONNXTensorElementDataType type;
    if (OrtStatusPtr st = api.GetTensorElementType(info, &type)) return st;
    OrtTensorTypeAndShapeInfo* named = nullptr;
    if (OrtStatusPtr st = api.CreateTensorTypeAndShapeInfo(&named)) return st;
    OrtStatusPtr st = api.SetTensorElementType(named, type);
    if (!st) st = api.SetDimensions(named, dims.data(), rank);
    if (!st) st = api.SetSymbolicDimensions(named, out_names.data(), rank);
    if (!st) st = api.ShapeInferContext_SetOutputTypeShape(ctx, i, named);
    api.ReleaseTensorTypeAndShapeInfo(named);
    if (st) return st;
  }
  return nullptr;
}

}  // namespace kvexport_shapes
