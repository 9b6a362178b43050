"""kvexport.plugins: custom ops for TensorRT, one folder per op (spec, reference, kernels,
registration, README). Today: `paged_attention` (kvexport::PagedAttention)."""
