"""Streaming eviction (--kv-eviction streaming, runtime/core/streaming.py) on a real build: the
perplexity table of StreamingLLM's shape, and memory / decode speed over a long generation.

    .venv/bin/python bench/streaming.py --build BUILD [--tokens 2048] [--sinks 4] [--recent 256]
        [--generate 10000] [--gen-max-model-len 512] [--out bench/results/streaming.json]

BUILD: a paged build with --all-logits (e.g. `kvexport build smollm2-135m --all-logits
--max-seq-len 2048`). Perplexity: the first --tokens tokens of King Lear scored as one prompt
(prompt_logprobs) through the engine, fed --chunk tokens per step (max_num_batched_tokens; 1: every
token attends to exactly what the policy keeps when it is computed; 16, one block: a query also sees
the < 16 tokens of its chunk before it, and the window is released once per chunk):
  full cache        --kv-eviction none
  window            streaming, 0 sinks: a plain sliding window of --recent tokens (+ < 1 block)
  sinks + window    streaming, --sinks sink tokens (whole blocks) + --recent tokens
Generation: one greedy request of --generate tokens with streaming at --gen-max-model-len (context
shifts every ~(max_model_len - sinks - recent) tokens); blocks in use (the engine's stats().kv_blocks_used, what
/metrics exports as kvexport_kv_blocks_used) and decode time per 1000 tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")


def perplexity(build: str, ids: list[int], **settings) -> tuple[float, float]:
    """exp(mean NLL) of ids[1:] given the tokens before, and the seconds it took."""
    from kvexport import LLM, SamplingParams

    llm = LLM(build, kv_cache_memory="256MiB", **settings)
    t0 = time.time()
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    if out.prompt_logprobs is None:
        raise SystemExit(f"no prompt logprobs: {out.error} (the text and one more token must fit max_model_len)")
    lp = out.prompt_logprobs.logprobs
    assert len(lp) == len(ids) - 1, (len(lp), len(ids))
    return math.exp(-sum(lp) / len(lp)), time.time() - t0


def long_generation(build: str, prompt: list[int], n: int, **settings) -> dict:
    """One greedy request of n tokens; per 1000 tokens: blocks in use (max, min) and decode seconds."""
    from kvexport.runtime.config import EngineConfig
    from kvexport.runtime.engine import LLMEngine
    from kvexport.runtime.sampling_params import SamplingParams

    e = LLMEngine(build, EngineConfig(kv_cache_memory="256MiB", **settings))
    rid = e.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    e.step()  # the prompt
    marks, t0, used, windows, steps = [], time.time(), [], [], []
    produced = 1
    while e.has_unfinished():
        ts = time.perf_counter()
        outs = e.step()
        steps.append(time.perf_counter() - ts)
        if outs:
            produced = len(outs[0].token_ids)
        used.append(e.stats().kv_blocks_used)
        if produced % 1000 == 0 and (not marks or marks[-1] != produced):
            t = time.time()
            windows.append({"tokens": produced, "seconds": round(t - t0, 2),
                            "median_step_ms": round(1000 * sorted(steps)[len(steps) // 2], 1),
                            "blocks_used_max": max(used), "blocks_used_min": min(used)})
            print(windows[-1], flush=True)
            marks.append(produced)
            t0, used, steps = t, [], []
    o = e.output(rid)
    text = e.tokenizer.decode(o.token_ids[-200:]) if e.tokenizer is not None else ""
    return {"generated": len(o.token_ids), "finish_reason": o.finish_reason, "windows": windows,
            "context_shifts": e.scheduler.num_context_shifts, "blocks_total": e.stats().kv_blocks_total,
            "last_200_tokens_text": text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--recent", type=int, default=256)
    ap.add_argument("--generate", type=int, default=10000)
    ap.add_argument("--gen-max-model-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=16, help="prompt tokens per step in the streaming perplexity runs")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--out", default="bench/results/streaming.json")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from kvexport import manifest as mf
    from kvexport.exporter import calibrate

    m = mf.load(Path(a.build))
    tok = AutoTokenizer.from_pretrained(Path(a.build) / m.tokenizer)
    text = calibrate.read_text(calibrate.default_text(calibrate.EVALUATION_TEXT))
    ids = tok(text, add_special_tokens=False)["input_ids"][:a.tokens]
    result: dict = {"date": datetime.date.today().isoformat(),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), onnxruntime CPU",
                    "command": "python bench/streaming.py " + " ".join(
                        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k not in ("out", "skip_ppl")),
                    "model": m.model.family, "block_size": m.kv.block_size,
                    "attention": m.kv.attention if hasattr(m.kv, "attention") else None}
    common = dict(threads=2, max_model_len=min(a.tokens + 1, m.kv.max_seq_len))
    if not a.skip_ppl:
        ppl = {}
        for name, kw in (("full cache", dict(kv_eviction="none", max_num_batched_tokens=512)),
                         (f"window {a.recent} (no sinks)", dict(kv_eviction="streaming", kv_sink_tokens=0,
                                                               kv_recent_tokens=a.recent, max_num_batched_tokens=a.chunk)),
                         (f"{a.sinks} sinks + window {a.recent}", dict(kv_eviction="streaming", kv_sink_tokens=a.sinks,
                                                                     kv_recent_tokens=a.recent,
                                                                     max_num_batched_tokens=a.chunk))):
            p, secs = perplexity(a.build, ids, **common, **kw)
            ppl[name] = {"perplexity": round(p, 3), "seconds": round(secs, 1)}
            print(name, ppl[name], flush=True)
        result["perplexity_chunk"] = a.chunk
        result["perplexity"] = {"text": f"King Lear, {len(ids)} tokens (the bench/kv_quality.py text)", **ppl}
    if a.generate:
        prompt = tok("Once upon a time, in a small village,")["input_ids"]
        result["generation"] = long_generation(a.build, prompt, a.generate, threads=2,
                                               max_model_len=a.gen_max_model_len, kv_eviction="streaming",
                                               kv_sink_tokens=a.sinks, kv_recent_tokens=a.recent)
        print(json.dumps(result["generation"], indent=1), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
