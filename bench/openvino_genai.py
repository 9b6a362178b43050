"""OpenVINO GenAI's `ContinuousBatchingPipeline` on kvexport's bench trace (issue 47's peer).

Two modes, two virtual environments (this file never imports kvexport in the second):

1. In kvexport's venv, write the trace's requests out, with the exact prompt token ids `kvexport bench`
   serves (runtime/serving/bench.py trace_prompts: seeded numpy over the build's vocabulary) and,
   optionally, kvexport's greedy tokens for the first N requests (for the token-equality check):

       HF_HUB_OFFLINE=1 ORT_DISABLE_TELEMETRY=1 .venv/bin/python bench/openvino_genai.py \
           --dump-trace /tmp/ov47/trace.json --build /tmp/ov47/fp32 --reference 8 --threads 2

2. In OpenVINO's venv (openvino-genai==2026.4.1.0, optimum-intel[openvino]==2.2.0; IRs from
   `optimum-cli export openvino --model HF_DIR --task text-generation-with-past --weight-format fp32|int8|int4 OUT`),
   serve the same requests (all at t=0, greedy, ignore_eos with min_new_tokens = max_new_tokens = the trace's
   output length, prefix caching off, 2 threads, 512 batched tokens, 64 sequences, a 2 GiB KV cache as
   kvexport bench's default --kv-cache-memory):

       HF_HUB_OFFLINE=1 /work/venv-openvino/bin/python bench/openvino_genai.py --trace-json /tmp/ov47/trace.json \
           --model /tmp/ov47/ov-fp32 --form f32 --threads 2 --json bench/results/ov47_openvino_f32.json

   --form f32: INFERENCE_PRECISION_HINT f32 and KV_CACHE_PRECISION f32 (the same arithmetic as kvexport fp32);
   --form default: the plugin's defaults (on CPUs with bf16 / AMX that means bf16 compute; u8 KV cache);
   int8 / int4 IRs run with the defaults too (pass the matching --model).

The figures use `kvexport bench`'s keys where they mean the same (output_tokens_per_s, wall_s, ttft_s, tpot_s,
prompt_tokens, output_tokens), plus peak_rss_mb (the process's ru_maxrss: model, KV cache and all), the load
average at the start and the CPU's flags.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path


def cpu_flags() -> str:
    """The SIMD flags that matter for int8/bf16 matmuls, as /proc/cpuinfo lists them."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return "unknown"
    keep = [f for f in flags if f in ("avx2", "fma") or f.startswith(("avx512", "avx_vnni", "amx"))]
    return " ".join(sorted(keep)) or "none of avx2/avx512/vnni/amx"


def cpu_model() -> str:
    try:
        return next(line for line in open("/proc/cpuinfo") if line.startswith("model name")).split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor()


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ---------------------------------------------------------------- mode 1: kvexport's venv

def dump_trace(out: str, build: str, trace: str, reference: int, threads: int | None) -> None:
    """The trace's requests with kvexport's prompt ids (and, for `reference` requests, kvexport's greedy tokens)."""
    from kvexport import manifest as mf
    from kvexport.runtime.serving.bench import load_trace, trace_prompts

    data, reqs = load_trace(trace)
    m = mf.load(Path(build))
    prompts = trace_prompts(data, reqs, m.model.vocab_size)
    doc = {"name": data["name"], "seed": data["seed"], "vocab_size": m.model.vocab_size,
           "requests": [{"prompt_ids": p, "output_len": r.output_len} for p, r in zip(prompts, reqs)]}
    if reference:
        from kvexport.runtime.engine import EngineConfig, LLMEngine
        from kvexport.runtime.sampling_params import SamplingParams

        engine = LLMEngine(build, EngineConfig(threads=threads, enable_prefix_caching=False))
        rids = [engine.add_request(prompts[i], SamplingParams(max_tokens=reqs[i].output_len, ignore_eos=True,
                                                               temperature=0.0))
                for i in range(min(reference, len(reqs)))]
        while engine.has_unfinished():
            engine.step()
        for i, rid in enumerate(rids):
            doc["requests"][i]["kvexport_tokens"] = list(engine.output(rid).token_ids)
        doc["reference_build"] = build
    Path(out).write_text(json.dumps(doc))
    print(f"wrote {out}: {len(reqs)} requests, {reference} with kvexport's greedy tokens")


# ---------------------------------------------------------------- mode 2: OpenVINO's venv

FORMS = {
    # form -> properties for the CPU plugin (besides the thread count)
    "f32": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"},
    "default": {},
}


def run_openvino(args) -> dict:
    # NOTE: this file is named like the package: drop its folder from the path, else `import openvino_genai`
    # imports this script again
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    sys.modules.pop("openvino_genai", None)
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    doc = json.loads(Path(args.trace_json).read_text())
    reqs = doc["requests"][: args.limit]
    load_start = os.getloadavg()
    sc = ov_genai.SchedulerConfig()
    sc.max_num_batched_tokens = args.max_num_batched_tokens
    sc.max_num_seqs = args.max_num_seqs
    sc.cache_size = args.cache_size_gb  # GB of KV cache (kvexport bench: --kv-cache-memory 2GiB)
    sc.enable_prefix_caching = False
    sc.dynamic_split_fuse = True  # OpenVINO's default: prompt chunks and decodes share a step (as kvexport)
    props = {"INFERENCE_NUM_THREADS": args.threads, **FORMS.get(args.form, {})}
    t_load = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(args.model, sc, "CPU", props)
    load_s = time.perf_counter() - t_load
    cfgs = []
    for r in reqs:
        g = ov_genai.GenerationConfig()
        g.max_new_tokens = r["output_len"]
        g.min_new_tokens = r["output_len"]
        g.ignore_eos = True
        g.do_sample = False  # greedy
        cfgs.append(g)
    handles, first, tokens = [], {}, {}
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        handles.append(pipe.add_request(i, ov.Tensor(np.asarray([r["prompt_ids"]], dtype=np.int64)), cfgs[i]))
        tokens[i] = []
    steps, finish = 0, {}
    while pipe.has_non_finished_requests():
        pipe.step()
        steps += 1
        now = time.perf_counter()
        for i, h in enumerate(handles):
            if i in finish:
                continue
            if h.can_read():
                for out in h.read().values():
                    tokens[i].extend(out.generated_ids)
                if tokens[i] and i not in first:
                    first[i] = now
            if h.get_status() != ov_genai.GenerationStatus.RUNNING and not h.can_read():
                finish[i] = now
    wall = time.perf_counter() - t0
    for i, h in enumerate(handles):  # anything left to read
        while h.can_read():
            for out in h.read().values():
                tokens[i].extend(out.generated_ids)
        finish.setdefault(i, t0 + wall)
    useful = sum(len(tokens[i]) for i in tokens)
    ttft = [first[i] - t0 for i in first]
    tpot = [(finish[i] - first[i]) / (len(tokens[i]) - 1) for i in first if len(tokens[i]) > 1]
    short = [i for i, r in enumerate(reqs) if len(tokens[i]) != r["output_len"]]
    parity = None
    ref = [(i, r["kvexport_tokens"]) for i, r in enumerate(reqs) if "kvexport_tokens" in r]
    if ref:
        same = [i for i, t in ref if tokens[i] == t]
        prefix = [next((k for k, (a, b) in enumerate(zip(tokens[i], t)) if a != b), min(len(tokens[i]), len(t)))
                  for i, t in ref]
        parity = {"requests_compared": len(ref), "identical": len(same),
                  "matching_prefix_tokens": prefix, "reference_build": doc.get("reference_build")}
    return {
        "system": f"openvino-genai {ov_genai.__version__.split('-')[0]} ContinuousBatchingPipeline",
        "form": args.form, "model": str(args.model),
        "trace": doc.get("name"), "requests": len(reqs), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {cpu_model()}", "cpu_flags": cpu_flags(),
        "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "config": {"properties": props, "max_num_batched_tokens": sc.max_num_batched_tokens,
                   "max_num_seqs": sc.max_num_seqs, "cache_size_gb": sc.cache_size, "prefix_caching": False,
                   "dynamic_split_fuse": True, "threads": args.threads},
        "load_s": round(load_s, 2),
        "prompt_tokens": sum(len(r["prompt_ids"]) for r in reqs), "output_tokens": useful, "wall_s": round(wall, 2),
        "output_tokens_per_s": round(useful / wall, 2),
        "total_tokens_per_s": round((useful + sum(len(r["prompt_ids"]) for r in reqs)) / wall, 2),
        "ttft_s": {"p50": round(_pct(ttft, 50), 3), "p99": round(_pct(ttft, 99), 3)},
        "tpot_s": {"p50": round(_pct(tpot, 50), 4), "p99": round(_pct(tpot, 99), 4)},
        "steps": steps, "requests_with_wrong_length": short,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "greedy_parity_vs_kvexport": parity,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump-trace", metavar="OUT", help="mode 1 (kvexport's venv): write the trace's requests here")
    p.add_argument("--build", help="mode 1: the kvexport build whose vocabulary (and greedy tokens) to use")
    p.add_argument("--trace", default="mixed-64", help="mode 1: a shipped trace name or a trace JSON file")
    p.add_argument("--reference", type=int, default=0, help="mode 1: kvexport's greedy tokens for the first N")
    p.add_argument("--trace-json", help="mode 2: the file mode 1 wrote")
    p.add_argument("--model", help="mode 2: an OpenVINO IR folder (optimum-cli export openvino)")
    p.add_argument("--form", default="default", choices=sorted(FORMS), help="mode 2: f32 or the plugin's defaults")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--cache-size-gb", type=int, default=2)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if args.dump_trace:
        if not args.build:
            p.error("--dump-trace needs --build")
        dump_trace(args.dump_trace, args.build, args.trace, args.reference, args.threads)
        return
    if not (args.trace_json and args.model):
        p.error("give --dump-trace (kvexport's venv) or --trace-json and --model (OpenVINO's venv)")
    if "kvexport" in sys.modules:
        raise SystemExit("mode 2 must not import kvexport")
    res = run_openvino(args)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
