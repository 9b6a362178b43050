"""`kvexport bench`: serve a fixed-seed synthetic request trace through the engine and
report what was measured: useful output tokens/s, TTFT and time per output token (p50/p99),
KV-pool utilisation and waste (and what a contiguous per-request reservation would waste),
preemptions, prefix-cache hits, and the share of step time spent outside the model
(scheduler + bookkeeping + sampling). Requests arrive all at t=0 (offline) or by a seeded
Poisson process (`arrival_rate`). `prefix_ttft()` measures the time to first token of a
request sharing a long prefix with an earlier one, with and without prefix caching."""

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

from ..engine import EngineConfig, LLMEngine
from ..sampling_params import SamplingParams, StructuredOutputs


@dataclass(frozen=True, slots=True)
class TraceRequest:
    prompt_len: int  # tokens
    output_len: int  # tokens generated (forced: ignore_eos)


MAX_TRACE_LEN = 1 << 20  # tokens: a trace's prompt_len and output_len, max


def load_trace(name_or_path: str = "mixed-64") -> tuple[dict, list[TraceRequest]]:
    p = Path(name_or_path)
    if not p.is_file():
        p = resources.files("kvexport.runtime.serving").joinpath(f"traces/{name_or_path}.json")
    try:
        data = json.loads(p.read_text())
        reqs = [TraceRequest(int(r["prompt_len"]), int(r["output_len"])) for r in data["requests"]]
        seed = data["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed {seed!r} is not an integer >= 0")
        if not reqs or any(not (1 <= r.prompt_len <= MAX_TRACE_LEN and 1 <= r.output_len <= MAX_TRACE_LEN)
                           for r in reqs):
            raise ValueError(f"it needs at least one request, each with prompt_len and output_len in "
                             f"1..{MAX_TRACE_LEN}")
        data.setdefault("name", Path(name_or_path).stem)
        return data, reqs
    except (OSError, UnicodeDecodeError):
        raise ConfigError(f"trace {name_or_path!r} is neither a readable file nor a shipped trace (mixed-64)") from None
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise ConfigError(f"trace {name_or_path!r} is malformed ({e}); it needs "
                          f"{{\"seed\": int, \"requests\": [{{\"prompt_len\", \"output_len\"}}]}}") from None


def trace_prompts(trace: dict, reqs: list[TraceRequest], vocab_size: int) -> list[list[int]]:
    """The trace's prompt token ids: seeded, so every run and every system sees the same."""
    rng = np.random.default_rng(trace["seed"])
    return [rng.integers(3, vocab_size, size=r.prompt_len).tolist() for r in reqs]


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


class _TimedBackend:
    """Wraps a backend to add up the time spent in the model (graph runs + KV stores)."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, inp, all_tokens: bool = False):
        t = time.perf_counter()
        try:
            return self.inner.execute(inp, all_tokens)
        finally:
            self.seconds += time.perf_counter() - t


def arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives: all 0, or a Poisson process
    of `rate` requests/s (exponential gaps, seeded)."""
    if rate is None or rate == 0:
        return [0.0] * n
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < float("inf"):
        raise ConfigError(f"arrival rate must be a finite number > 0 requests/s, got {rate!r}")
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


def run_bench(build_dir: str | Path, config: EngineConfig, trace_name: str = "mixed-64",
              limit: int | None = None, progress=None, arrival_rate: float | None = None,
              json_schema: str | None = None) -> dict:
    """Serve the trace and return the figures as a dict. Requests arrive at t=0, or by a
    seeded Poisson process of `arrival_rate` requests/s (TTFT then counts from arrival).
    `json_schema` (a JSON schema's text): every request's output is constrained to it (structured
    output, as response_format json_schema), compiled once before the clock starts; a request ends
    where its grammar does or at its output length, whichever is first (for a per-token overhead,
    give a schema whose documents are longer than the trace's outputs). With LoRA adapters loaded
    (config.lora_modules) the requests take the base and each adapter in turn (runtime/lora.py)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit must be an integer >= 1 (requests), got {limit!r}")
    trace, reqs = load_trace(trace_name)  # bad traces and rates fail before the engine loads
    reqs = reqs[:limit]
    arrivals = arrival_times(len(reqs), arrival_rate, trace["seed"])
    structured = StructuredOutputs(json=json_schema) if json_schema is not None else None  # bad JSON: before loading
    engine = LLMEngine(build_dir, config)
    compile_s = None
    if structured is not None:
        tc = time.perf_counter()
        engine.structured.compile(structured, "--json-schema")  # cached: the requests reuse it
        compile_s = time.perf_counter() - tc
    timed = _TimedBackend(engine.backend)
    engine.backend = timed
    prompts = trace_prompts(trace, reqs, engine.manifest.model.vocab_size)
    loras = (None, *engine.loras.names) if engine.loras is not None else (None,)  # request i: loras[i % len]
    total_out = sum(r.output_len for r in reqs)
    max_len = engine.max_model_len
    reserve = {}  # request id -> tokens a contiguous cache would reserve for it
    due = {}  # request id -> when it was due to arrive (perf_counter clock)
    rids: list[str] = []
    steps, util, waste, waste_max_len, waste_exact = 0, [], [], [], []
    done_tokens, step_s = 0, 0.0
    t0 = time.perf_counter()
    while len(rids) < len(reqs) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while len(rids) < len(reqs) and arrivals[len(rids)] <= now:
            i = len(rids)
            # NOTE: with a schema the grammar may end a request (its EOS is the only token left), so EOS counts
            rid = engine.add_request(prompts[i], SamplingParams(max_tokens=reqs[i].output_len,
                                                                 ignore_eos=structured is None, structured=structured,
                                                                 lora=loras[i % len(loras)]))
            reserve[rid] = reqs[i].prompt_len + reqs[i].output_len
            due[rid] = t0 + arrivals[i]
            rids.append(rid)
        if not engine.has_unfinished():  # idle until the next arrival (none left: every request was refused)
            if len(rids) < len(reqs):
                time.sleep(max(0.0, min(arrivals[len(rids)] - now, 0.05)))
            continue
        ts = time.perf_counter()
        changed = engine.step()
        step_s += time.perf_counter() - ts
        steps += 1
        now_stats = engine.stats()
        used = now_stats.kv_blocks_used
        util.append(now_stats.kv_cache_usage)
        running = now_stats.running_computed_tokens  # (request id, tokens stored)
        stored = sum(n for _, n in running)
        if used:
            waste.append(1.0 - stored / (used * engine.kv_connector.block_size))
            # contiguous caches reserve per request up front: the build's whole context
            # (HF static cache), or at best exactly prompt + max_tokens
            waste_max_len.append(1.0 - stored / (len(running) * max_len))
            waste_exact.append(1.0 - stored / sum(reserve[rid] for rid, _ in running))
        new = sum(len(o.new_token_ids) for o in changed)
        done_tokens += new
        if progress:
            progress(done_tokens, total_out)
    wall = time.perf_counter() - t0
    outs = [engine.output(r) for r in rids]
    errors = [o.error for o in outs if o.error]
    # NOTE: from when each request was due, not when it was added: a request due during a
    # step is only added after it, and that wait is part of its TTFT
    ttft = [o.first_token_time - due[r] for r, o in zip(rids, outs) if o.first_token_time]
    tpot = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1)
            for o in outs if o.first_token_time and len(o.token_ids) > 1]
    useful = sum(len(o.token_ids) for o in outs)
    stats = engine.stats()
    return {
        "trace": trace["name"], "requests": len(reqs), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "build": str(build_dir), "model": engine.manifest.model.family,
        "dtype": engine.manifest.dtype, "kv_dtype": engine.manifest.kv.dtype,
        "attention": engine.backend.attention_impl,
        "config": {"kv_cache_memory": str(config.kv_cache_memory), "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens, "threads": config.threads,
                   "arrival_rate": arrival_rate},
        "prompt_tokens": sum(r.prompt_len for r in reqs), "output_tokens": useful, "wall_s": round(wall, 2),
        "output_tokens_per_s": round(useful / wall, 2),
        "total_tokens_per_s": round((useful + sum(r.prompt_len for r in reqs)) / wall, 2),
        "ttft_s": {"p50": round(_pct(ttft, 50), 3), "p99": round(_pct(ttft, 99), 3)},
        "tpot_s": {"p50": round(_pct(tpot, 50), 4), "p99": round(_pct(tpot, 99), 4)},
        "steps": steps,
        "kv": {"blocks_total": stats.kv_blocks_total, "block_size": engine.kv_connector.block_size,
               "peak_utilisation": round(max(util, default=0.0), 3), "mean_utilisation": round(float(np.mean(util)) if util else 0.0, 3),
               "mean_waste": round(float(np.mean(waste)) if waste else 0.0, 3),
               "contiguous_max_len_mean_waste": round(float(np.mean(waste_max_len)) if waste_max_len else 0.0, 3),
               "contiguous_exact_mean_waste": round(float(np.mean(waste_exact)) if waste_exact else 0.0, 3),
               "prefix_hits": stats.prefix_cache.hits, "prefix_queries": stats.prefix_cache.queries},
        "preemptions": stats.num_preemptions, "errors": errors,
        # --json-schema: every request constrained to it; its compile time (before the clock started)
        "structured": ({"json_schema_bytes": len(json_schema), "compile_s": round(compile_s, 3),
                        "finished_by_grammar": sum(o.finish_reason == "stop" for o in outs)}
                       if structured is not None else None),
        # speculative decoding (--speculative): drafted / accepted tokens, acceptance rate, mean accepted length
        "speculative": ({"mode": config.speculative, "num_speculative_tokens": config.num_speculative_tokens,
                         **stats.spec_decoding.to_json()} if stats.spec_decoding is not None else None),
        # LoRA adapters (--lora-modules): the requests took the base and each adapter in turn
        "lora": ({"adapters": list(loras[1:]), "max_rank": engine.manifest.lora["max_rank"],
                  "factor_bytes": int(sum(a.nbytes for a in engine.loras.factors.values()))}
                 if engine.loras is not None else None),
        "time_s": {"steps": round(step_s, 2), "model": round(timed.seconds, 2),
                   "outside_model_share_of_step": round(1.0 - timed.seconds / step_s, 4) if step_s else 0.0},
    }


def prefix_ttft(build_dir: str | Path, config: EngineConfig, prefix_len: int = 1000, suffix_len: int = 32,
                repeats: int = 3, seed: int = 0) -> dict:
    """TTFT of requests that share a `prefix_len`-token prefix with an earlier request,
    with prefix caching on and off (fresh engines; the earlier request has finished)."""
    from dataclasses import replace

    for name, v in (("prefix_len", prefix_len), ("suffix_len", suffix_len), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"prefix test: {name} must be an integer >= 1, got {v!r}")
    out = {"prefix_len": prefix_len, "suffix_len": suffix_len, "repeats": repeats}
    for caching in (True, False):
        engine = LLMEngine(build_dir, replace(config, enable_prefix_caching=caching))
        if prefix_len + suffix_len + 1 > engine.max_model_len:
            raise ConfigError(f"prefix test needs a context of {prefix_len + suffix_len + 1} tokens; "
                              f"this build/pool serves {engine.max_model_len}")
        rng = np.random.default_rng(seed)
        vocab = engine.manifest.model.vocab_size
        prefix = rng.integers(3, vocab, size=prefix_len).tolist()
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        _drain(engine, [engine.add_request(prefix + rng.integers(3, vocab, size=suffix_len).tolist(), params)])
        ttfts, cached = [], []
        for _ in range(repeats):
            rid = engine.add_request(prefix + rng.integers(3, vocab, size=suffix_len).tolist(), params)
            o = _drain(engine, [rid])[0]
            ttfts.append(o.first_token_time - o.arrival_time)
            cached.append(o.num_cached_prompt_tokens)
        out["with_prefix_caching" if caching else "without_prefix_caching"] = {
            "ttft_s_median": round(float(np.median(ttfts)), 4), "cached_prompt_tokens": cached}
    on, off = out["with_prefix_caching"]["ttft_s_median"], out["without_prefix_caching"]["ttft_s_median"]
    out["speedup"] = round(off / on, 2) if on else None
    return out


def _drain(engine: LLMEngine, rids: list[str]):
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_output(r) for r in rids]
