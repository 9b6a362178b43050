// Learned attention sinks (GPT-OSS) of the native CPU PagedAttention (paged_attention_ort.cc):
// reading the `attention_sinks` attribute and folding a head's sink into the softmax.
//
// A sink is one logit per query head that joins the softmax's denominator and carries no
// value (spec.py): out = sum_j exp(s_j - m) v_j / (exp(sink - m) + sum_j exp(s_j - m)),
// m = max(sink, max_j s_j). The online softmax ends with (acc, l) relative to its own max m;
// the sink is folded in once per row at the end, rescaled to the larger of the two maxima,
// so a sink far above every score neither overflows nor loses the scores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

namespace kvexport_sinks {

// The node's sinks: num_heads floats, or none (the attribute absent or empty: graphs exported
// before sinks existed, and every model without them).
inline std::vector<float> read(const OrtKernelInfo* info, int64_t num_heads) {
  const OrtApi& api = Ort::GetApi();
  size_t n = 0;
  if (OrtStatus* missing = api.KernelInfoGetAttributeArray_float(info, "attention_sinks", nullptr, &n)) {
    api.ReleaseStatus(missing);
    return {};
  }
  std::vector<float> sinks(n);
  if (n > 0) Ort::ThrowOnError(api.KernelInfoGetAttributeArray_float(info, "attention_sinks", sinks.data(), &n));
  if (n != 0 && static_cast<int64_t>(n) != num_heads)
    throw std::invalid_argument("kvexport::PagedAttention: attention_sinks must list one value per query head (" +
                                std::to_string(num_heads) + "), got " + std::to_string(n));
  for (float s : sinks)
    if (!std::isfinite(s)) throw std::invalid_argument("kvexport::PagedAttention: attention_sinks must be finite");
  return sinks;
}

// The factor f with out_i = acc_i * f, for a row whose online softmax ended at (l, m).
inline float output_factor(float l, float m, float sink) {
  if (!(l > 0.f)) return 0.f;  // nothing visible (pad rows)
  const float top = std::max(m, sink);
  const float a = std::exp(m - top);
  return a / (l * a + std::exp(sink - top));
}

}  // namespace kvexport_sinks
