// kvexport::PagedMLA, the native CPU op (paged_mla_ort.cc): what the shared library's
// registration (plugins/paged_attention/cpu/paged_attention_ort.cc, RegisterCustomOps) adds to
// the `kvexport` custom-op domain next to PagedAttention.
#pragma once

struct OrtCustomOp;

namespace kvexport_mla {

// The op's definition, a static object (lives as long as the library). Call after
// Ort::InitApi (the registration does).
const OrtCustomOp* custom_op();

}  // namespace kvexport_mla
