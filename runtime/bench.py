"""`kvexport bench`: serve a fixed-seed synthetic request trace through the engine and
report what was measured: useful output tokens/s, TTFT and time per output token (p50/p99),
KV-pool utilisation and waste, preemptions, prefix-cache hits."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from kvexport.errors import ConfigError

from .engine import EngineConfig, LLMEngine
from .sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class TraceRequest:
    prompt_len: int  # tokens
    output_len: int  # tokens generated (forced: ignore_eos)


def load_trace(name_or_path: str = "mixed-64") -> tuple[dict, list[TraceRequest]]:
    p = Path(name_or_path)
    if not p.is_file():
        p = resources.files("kvexport.runtime").joinpath(f"traces/{name_or_path}.json")
    try:
        data = json.loads(p.read_text())
        return data, [TraceRequest(int(r["prompt_len"]), int(r["output_len"])) for r in data["requests"]]
    except OSError:
        raise ConfigError(f"trace {name_or_path!r} is neither a file nor a shipped trace (mixed-64)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"trace {name_or_path!r} is malformed ({e}); it needs "
                          f"{{\"seed\": int, \"requests\": [{{\"prompt_len\", \"output_len\"}}]}}") from None


def trace_prompts(trace: dict, reqs: list[TraceRequest], vocab_size: int) -> list[list[int]]:
    """The trace's prompt token ids: seeded, so every run and every system sees the same."""
    rng = np.random.default_rng(trace["seed"])
    return [rng.integers(3, vocab_size, size=r.prompt_len).tolist() for r in reqs]


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_bench(build_dir: str | Path, config: EngineConfig, trace_name: str = "mixed-64",
              limit: int | None = None, progress=None) -> dict:
    """Serve the trace (all requests arrive at t=0) and return the figures as a dict."""
    engine = LLMEngine(build_dir, config)
    trace, reqs = load_trace(trace_name)
    reqs = reqs[:limit] if limit else reqs
    prompts = trace_prompts(trace, reqs, engine.manifest.model["vocab_size"])
    total_out = sum(r.output_len for r in reqs)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
            for p, r in zip(prompts, reqs)]
    steps, util, waste = 0, [], []
    done_tokens = 0
    while engine.has_unfinished():
        changed = engine.step()
        steps += 1
        used = engine.pool.num_used_blocks
        util.append(used / engine.pool.num_usable_blocks)
        stored = sum(r.num_computed_tokens for r in engine.scheduler.running)
        if used:
            waste.append(1.0 - stored / (used * engine.pool.block_size))
        new = sum(len(o.new_token_ids) for o in changed)
        done_tokens += new
        if progress:
            progress(done_tokens, total_out)
    wall = time.perf_counter() - t0
    outs = [engine.output(r) for r in rids]
    errors = [o.error for o in outs if o.error]
    ttft = [o.first_token_time - o.arrival_time for o in outs if o.first_token_time]
    tpot = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1)
            for o in outs if o.first_token_time and len(o.token_ids) > 1]
    useful = sum(len(o.token_ids) for o in outs)
    stats = engine.kv_stats()
    return {
        "trace": trace["name"], "requests": len(reqs), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "build": str(build_dir), "model": engine.manifest.model["family"],
        "dtype": engine.manifest.dtype, "kv_dtype": engine.manifest.kv.dtype,
        "config": {"kv_cache_memory": str(config.kv_cache_memory), "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens, "threads": config.threads},
        "prompt_tokens": sum(r.prompt_len for r in reqs), "output_tokens": useful, "wall_s": round(wall, 2),
        "output_tokens_per_s": round(useful / wall, 2),
        "total_tokens_per_s": round((useful + sum(r.prompt_len for r in reqs)) / wall, 2),
        "ttft_s": {"p50": round(_pct(ttft, 50), 3), "p99": round(_pct(ttft, 99), 3)},
        "tpot_s": {"p50": round(_pct(tpot, 50), 4), "p99": round(_pct(tpot, 99), 4)},
        "steps": steps,
        "kv": {"blocks_total": stats["blocks_total"], "block_size": engine.pool.block_size,
               "peak_utilisation": round(max(util, default=0.0), 3), "mean_utilisation": round(float(np.mean(util)) if util else 0.0, 3),
               "mean_waste": round(float(np.mean(waste)) if waste else 0.0, 3),
               "prefix_hits": stats["prefix_hits"], "prefix_queries": stats["prefix_queries"]},
        "preemptions": stats["preemptions"], "errors": errors,
    }
