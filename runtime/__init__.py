"""kvexport.runtime: serves paged builds with continuous batching.

    core/       BlockPool -> KV cache managers -> Scheduler -> SchedulerOutput (no tensors)
    execution/  ModelRunner -> backend (onnxruntime | TensorRT) -> sampler -> detokenizer
    serving/    engine thread, OpenAI server, metrics, Triton model/repository/launcher, bench
    engine.py (step = schedule -> run -> postprocess), kv_connector.py (the one seam KV blocks
    move through: tiers, disaggregated hand-off, persistence, router events), request_checks.py
    (what add_request checks), llm.py (`LLM`), config.py (the one settings definition),
    sampling_params.py (`SamplingParams`); `LLM` and `SamplingParams` are also importable from
    `kvexport`."""
