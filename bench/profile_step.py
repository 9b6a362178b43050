"""Where a kvexport step's time goes on onnxruntime's CPU (issue 47, step 1 "profile first").

Two measurements per build, both with the repo's own runtime objects:

A. Operators (onnxruntime's profiler, SessionOptions.enable_profiling via the backend's `profile_prefix`):
   the build's backend (runtime/execution/ort_backends.py ort_backend: the native PagedAttention op, the
   session plan's derived int8 forms) driven by its ModelRunner (runtime/execution/model_runner.py
   ModelRunner.logits -> pack -> Backend.execute) on synthetic steps: decode at 1, 16 and 64 sequences
   (each with --context tokens already in the pool) and one 512-token prompt chunk. The KV pool holds
   zeros: attention reads as many blocks as it would, the values do not matter for time. Each step's
   kernel times are summed by op type (MatMul/Gemm, MatMulIntegerToFloat, MatMulNBits,
   DynamicQuantizeLinear & co, PagedAttention, layout ops, norms, the rest) and set against the
   session's model_run; "dispatch" is model_run less the kernels (onnxruntime between the nodes).

B. Outside onnxruntime (no profiler): an LLMEngine (runtime/engine.py) with the bench's settings serving
   B requests of --engine-context-token prompts; once every request decodes, each engine.step() is timed and
   split into scheduler.schedule, the runner's pack / backend.execute (session.run_with_iobinding inside it) /
   sample, and the rest of the step (update_from_output, the output processor). The share of a step
   outside session.run_with_iobinding is the runtime's own overhead.

    HF_HUB_OFFLINE=1 ORT_DISABLE_TELEMETRY=1 .venv/bin/python bench/profile_step.py /tmp/ov47/fp32 /tmp/ov47/int8 \
        /tmp/ov47/int4 --threads 2 --json bench/results/ov47_profile_step.json

The shares (percent of a step) travel better than the milliseconds: on a shared machine both move with load.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from kvexport import manifest as mf
from kvexport.runtime.engine import EngineConfig, LLMEngine
from kvexport.runtime.execution import model_runner as mr
from kvexport.runtime.execution.model_runner import ModelRunner, chunk
from kvexport.runtime.execution.ort_backends import ort_backend
from kvexport.runtime.sampling_params import SamplingParams

from openvino_genai import cpu_flags  # bench/ (the script's folder): the same flags beside every figure

LAYOUT = "layout (Split/Transpose/Concat/Reshape/Slice/Gather...)"
ELEMENTWISE = "elementwise (Mul/Add/Sigmoid/QuickGelu/...)"
INT8_GEMM = "MatMulIntegerToFloat (int8xint8)"
NORMS = "norms (RMSNorm, fused or not)"
FLOAT_GEMM = "MatMul/Gemm (float)"
# op type -> the breakdown's bucket
BUCKETS = {
    "MatMul": FLOAT_GEMM, "Gemm": FLOAT_GEMM, "FusedMatMul": FLOAT_GEMM,
    "MatMulIntegerToFloat": INT8_GEMM, "DynamicQuantizeMatMul": INT8_GEMM,
    "MatMulInteger": INT8_GEMM,
    "MatMulNBits": "MatMulNBits",
    "DynamicQuantizeLinear": "DynamicQuantize*", "DynamicQuantizeLSTM": "DynamicQuantize*",
    "QuantizeLinear": "Quantize/DequantizeLinear", "DequantizeLinear": "Quantize/DequantizeLinear",
    "PagedAttention": "PagedAttention (custom op)",
    "Split": LAYOUT,
    "Transpose": LAYOUT,
    "Concat": LAYOUT,
    "Reshape": LAYOUT,
    "Slice": LAYOUT,
    "Gather": LAYOUT,
    "GatherElements": LAYOUT,
    "Unsqueeze": LAYOUT,
    "Squeeze": LAYOUT,
    "Expand": LAYOUT,
    "Cast": LAYOUT,
    "Shape": LAYOUT,
    "SimplifiedLayerNormalization": NORMS,
    "SkipSimplifiedLayerNormalization": NORMS,
    "LayerNormalization": NORMS,
    "Mul": ELEMENTWISE, "Add": ELEMENTWISE,
    "Sigmoid": ELEMENTWISE, "Sub": ELEMENTWISE,
    "Div": ELEMENTWISE, "Neg": ELEMENTWISE,
    "Pow": ELEMENTWISE, "Sqrt": ELEMENTWISE,
    "ReduceMean": ELEMENTWISE, "Reciprocal": ELEMENTWISE,
    "QuickGelu": ELEMENTWISE, "Silu": ELEMENTWISE,
    "RotaryEmbedding": "rotary", "Sin": "rotary", "Cos": "rotary",
}


def wait_for_quiet(limit: float, max_wait_s: float) -> list[float]:
    """The load average, after waiting (up to max_wait_s) for its 1-minute figure to drop to `limit`."""
    t = time.time()
    while os.getloadavg()[0] > limit and time.time() - t < max_wait_s:
        time.sleep(10)
    return [round(x, 2) for x in os.getloadavg()]


class Others:
    """The share of the machine's CPU time that other processes used between start() and share()
    (/proc/stat busy jiffies less this process's user + sys): a run with a large one was disturbed."""

    def start(self):
        self.t0, self.own0 = self._machine(), self._own()
        return self

    @staticmethod
    def _own() -> float:
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    @staticmethod
    def _machine() -> tuple[float, float]:
        v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        return (sum(v) - v[3] - v[4]) / hz, sum(v) / hz

    def share(self) -> float:
        (b1, t1), own = self._machine(), self._own()
        total = t1 - self.t0[1]
        return round(max(0.0, (b1 - self.t0[0]) - (own - self.own0)) / total, 3) if total > 0 else 0.0


class Timer:
    """Adds up the seconds of the calls it wraps, per name."""

    def __init__(self):
        self.s: dict[str, float] = collections.defaultdict(float)
        self.on = True

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if self.on:
                    self.s[name] += time.perf_counter() - t
        return timed


# ---------------------------------------------------------------- A: operators

def scenarios(context: int, block_size: int):
    """(label, chunks) of the synthetic steps: decode at 1/16/64 sequences, a 512-token prompt chunk."""
    out = []
    per_seq = -(-(context + 1) // block_size)
    for b in (1, 16, 64):
        chunks = []
        for r in range(b):
            table = list(range(1 + r * per_seq, 1 + (r + 1) * per_seq))  # block 0: the pad block
            chunks.append(chunk(f"d{r}", [100 + r], context, table, block_size))
        out.append((f"decode b={b}", chunks))
    per_p = -(-512 // block_size)
    out.append(("prefill 512", [chunk("p0", list(range(1000, 1512)), 0, list(range(1, 1 + per_p)), block_size)]))
    return out, 64 * per_seq + 2


def op_breakdown(build: str, threads: int, context: int, reps: dict[str, int], tmp: str) -> dict:
    m = mf.load(Path(build))
    steps, num_blocks = scenarios(context, m.kv.block_size)
    be = ort_backend(build, m, num_blocks, threads=threads, profile_prefix=os.path.join(tmp, Path(build).name))
    runner = ModelRunner(be, m.kv.block_size, m.model.eos_token_ids)
    log: list[tuple[int, str]] = []  # (session id, label) per run, in order
    sessions = be._all_sessions()
    current = {"label": ""}
    for sess in sessions:
        inner = sess.run_with_iobinding

        def run(binding, *a, _inner=inner, _id=id(sess), **kw):
            log.append((_id, current["label"]))
            return _inner(binding, *a, **kw)
        sess.run_with_iobinding = run
    wall: dict[str, list[float]] = collections.defaultdict(list)
    others: dict[str, float] = {}
    for label, chunks in steps:
        o = Others().start()
        for i in range(2 + reps[label]):  # 2 warm-up runs, not counted
            current["label"] = label if i >= 2 else "warmup"
            t = time.perf_counter()
            runner.logits(chunks)
            if i >= 2:
                wall[label].append(time.perf_counter() - t)
        others[label] = o.share()
    files = {id(s): s.end_profiling() for s in sessions}
    per = {label: {"runs": 0, "model_run_us": 0.0, "run_list": [], "kernels": collections.Counter(), "ops": collections.Counter(),
                   "nodes": 0} for label, _ in steps}
    for sid, path in files.items():
        events = json.loads(Path(path).read_text())
        runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                      key=lambda e: e["ts"])
        labels = [lab for s, lab in log if s == sid]
        assert len(runs) == len(labels), (path, len(runs), len(labels))
        windows = [(e["ts"], e["ts"] + e["dur"], lab) for e, lab in zip(runs, labels)]
        nodes = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
                       key=lambda e: e["ts"])
        w = 0
        for e in nodes:
            while w < len(windows) and e["ts"] > windows[w][1]:
                w += 1
            if w == len(windows) or e["ts"] < windows[w][0]:
                continue
            lab = windows[w][2]
            if lab == "warmup":
                continue
            op = e["args"].get("op_name", "?")
            per[lab]["kernels"][BUCKETS.get(op, "other")] += e["dur"]
            per[lab]["ops"][op] += e["dur"]
            per[lab]["nodes"] += 1
        for s, e, lab in windows:
            if lab != "warmup":
                per[lab]["runs"] += 1
                per[lab]["model_run_us"] += e - s
                per[lab]["run_list"].append(e - s)
        os.unlink(path)
    res = {}
    for label, p in per.items():
        n = max(p["runs"], 1)
        run_us = p["model_run_us"] / n
        kern = {k: v / n for k, v in p["kernels"].items()}
        dispatch = max(run_us - sum(kern.values()), 0.0)
        step_ms = float(np.median(wall[label])) * 1e3
        shares = {k: round(100 * v / run_us, 1) for k, v in sorted(kern.items(), key=lambda kv: -kv[1])}
        shares["dispatch (model_run less kernels)"] = round(100 * dispatch / run_us, 1)
        res[label] = {"others_cpu_share": others[label], "runs": p["runs"], "model_run_ms_mean": round(run_us / 1e3, 2),
                      "model_run_ms_median": round(float(np.median(p["run_list"])) / 1e3, 2),
                      "model_run_ms_min": round(min(p["run_list"]) / 1e3, 2),
                      "runner_logits_ms_median": round(step_ms, 2),
                      "nodes_per_run": round(p["nodes"] / n), "share_of_model_run_pct": shares,
                      "top_ops_ms": {k: round(v / n / 1e3, 2) for k, v in p["ops"].most_common(8)},
                      "session_plan": sorted({be.plans[i].form for i, sset in enumerate(be.session_sets)
                                              for s, lab in log if lab == label and s in map(id, sset.values())})}
    del runner, be
    return res


# ---------------------------------------------------------------- B: outside onnxruntime

def engine_overhead(build: str, threads: int, context: int, batch: int, measure_steps: int, rows: bool = False) -> dict:
    cfg = EngineConfig(threads=threads, enable_prefix_caching=False, max_num_seqs=64, max_num_batched_tokens=512)
    engine = LLMEngine(build, cfg)
    timer = Timer()
    be = engine.runner.backend
    for sess in be._all_sessions():
        sess.run_with_iobinding = timer.wrap("ort run_with_iobinding", sess.run_with_iobinding)
    be.execute = timer.wrap("backend.execute", be.execute)
    engine.scheduler.schedule = timer.wrap("scheduler.schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = timer.wrap("scheduler.update_from_output",
                                                     engine.scheduler.update_from_output)
    engine.outputs.process = timer.wrap("outputs.process", engine.outputs.process)
    engine.runner.execute = timer.wrap("runner.execute", engine.runner.execute)
    orig_pack, orig_sample, orig_greedy, orig_plain = mr.pack, mr.sample, mr.sample_greedy, mr.plain_greedy
    mr.pack = timer.wrap("runner pack", orig_pack)
    mr.sample = timer.wrap("runner sample", orig_sample)
    mr.sample_greedy = timer.wrap("runner sample", orig_greedy)  # the step's greedy rows at once (issue 47)
    if rows:  # the sampler as before issue 47's batched argmax: every row through sample()
        mr.plain_greedy = lambda state, num_generated: False
    rng = np.random.default_rng(47)
    vocab = engine.manifest.model.vocab_size
    try:
        for _ in range(batch):
            engine.add_request(rng.integers(3, vocab, size=context).tolist(),
                               SamplingParams(max_tokens=measure_steps + 8, ignore_eos=True))
        timer.on = False
        # prefill: until every request decodes (its prompt computed and a token out)
        while any(r.num_computed_tokens < context for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        engine.step()
        timer.on = True
        timer.s.clear()
        o = Others().start()
        steps = []
        for _ in range(measure_steps):
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
    finally:
        mr.pack, mr.sample, mr.sample_greedy, mr.plain_greedy = orig_pack, orig_sample, orig_greedy, orig_plain
    total = sum(steps)
    s = dict(timer.s)
    ort = s.get("ort run_with_iobinding", 0.0)
    parts = {
        "ort run_with_iobinding (onnxruntime)": ort,
        "backend.execute less the ORT run (bind inputs, select rows)": s.get("backend.execute", 0) - ort,
        "runner pack (block tables, slot mapping, positions)": s.get("runner pack", 0),
        "runner sample (greedy)": s.get("runner sample", 0),
        "runner.execute rest": s.get("runner.execute", 0) - s.get("backend.execute", 0) - s.get("runner pack", 0)
        - s.get("runner sample", 0),
        "scheduler.schedule": s.get("scheduler.schedule", 0),
        "scheduler.update_from_output": s.get("scheduler.update_from_output", 0),
        "outputs.process (detokenize, RequestOutput)": s.get("outputs.process", 0),
    }
    parts["engine.step rest"] = total - sum(parts.values())
    return {"batch": batch, "context": context, "steps": measure_steps, "others_cpu_share": o.share(),
            "step_ms_median": round(1e3 * float(np.median(steps)), 2), "step_ms_mean": round(1e3 * total / len(steps), 2),
            "outside_ort_share_pct": round(100 * (1 - ort / total), 1),
            "share_pct": {k: round(100 * v / total, 1) for k, v in parts.items()},
            "ms_per_step": {k: round(1e3 * v / len(steps), 2) for k, v in parts.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("builds", nargs="+")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=256, help="tokens each decoding sequence holds already")
    p.add_argument("--engine-context", type=int, default=128,
                   help="B: prompt tokens of each request (every one is prefilled first: kept short)")
    p.add_argument("--engine-batches", default="1,16,64", help="B: decode batches to time engine.step() at")
    p.add_argument("--engine-steps", type=int, default=20)
    p.add_argument("--max-load", type=float, default=2.5, help="wait for the 1-min load average to drop to this")
    p.add_argument("--skip-ops", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--sampling", choices=("batched", "rows", "both"), default="batched",
                   help="B: greedy rows sampled at once (sampling.sample_greedy), row by row (as before issue 47), or "
                        "both in turns")
    p.add_argument("--json")
    args = p.parse_args()
    reps = {"decode b=1": 20, "decode b=16": 10, "decode b=64": 8, "prefill 512": 5}
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "cpu_flags": cpu_flags(), "threads": args.threads, "context": args.context,
           "engine_context": args.engine_context, "builds": {}}
    import onnxruntime

    out["onnxruntime"] = onnxruntime.__version__
    for build in args.builds:
        r = out["builds"][build] = {}
        if not args.skip_ops:
            r["loadavg_ops"] = wait_for_quiet(args.max_load, 120)
            with tempfile.TemporaryDirectory() as tmp:
                r["ops"] = op_breakdown(build, args.threads, args.context, reps, tmp)
            r["loadavg_ops_end"] = [round(x, 2) for x in os.getloadavg()]
        if not args.skip_engine:
            r["engine"] = []
            modes = ("batched", "rows") if args.sampling == "both" else (args.sampling,)
            for b in (int(x) for x in args.engine_batches.split(",")):
                for mode in modes:
                    la = wait_for_quiet(args.max_load, 120)
                    e = engine_overhead(build, args.threads, args.engine_context, b, args.engine_steps, mode == "rows")
                    e["loadavg_start"], e["sampling"] = la, mode
                    r["engine"].append(e)
                    print(build, json.dumps(e), flush=True)
        if "ops" in r:
            for label, v in r["ops"].items():
                print(build, label, json.dumps(v), flush=True)
    text = json.dumps(out, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print("loadavg now", os.getloadavg())


if __name__ == "__main__":
    main()
