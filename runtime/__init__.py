"""kvexport.runtime: serves paged builds with continuous batching.

BlockPool -> KVCacheManager -> Scheduler -> SchedulerOutput -> backend (onnxruntime) ->
sampler -> detokenizer; public API `LLM` and `SamplingParams` (also importable from
`kvexport`)."""
