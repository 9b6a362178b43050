"""kvexport.runtime.serving: the front ends over the engine.

engine_thread.py (the engine's own thread; every server's one way in), requests.py (prompt
and parameter parsing shared by every front end), openai_protocol.py + server.py (the
OpenAI-compatible HTTP server), metrics.py (one metrics table for /metrics and Triton),
triton_model.py / triton_repo.py / triton_local.py (the Triton model, its repository and
launcher), bench.py (`kvexport bench`, with its traces/)."""
