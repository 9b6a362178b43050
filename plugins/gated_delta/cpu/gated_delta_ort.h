// kvexport::GatedDeltaRule, the native CPU op (gated_delta_ort.cc): what the shared library's
// registration (plugins/paged_attention/cpu/paged_attention_ort.cc, RegisterCustomOps) adds to
// the `kvexport` custom-op domain next to PagedAttention and PagedMLA.
#pragma once

struct OrtCustomOp;

namespace kvexport_gdn {

// The op's definition, a static object (lives as long as the library). Call after
// Ort::InitApi (the registration does).
const OrtCustomOp* custom_op();

}  // namespace kvexport_gdn
