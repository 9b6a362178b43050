"""Where a serving step's time goes on a CPU, and what the native PagedAttention op costs.

    .venv/bin/python bench/cpu_attention.py [--build DIR ...] [--out bench/results/cpu_attention.json]

1. The op alone (plugins/paged_attention/cpu), one layer of smollm2-135m's shape (9 query
   heads, 3 KV heads, head_dim 64, blocks of 16), pools bound in place as the runtime does:
   - decode: 64 sequences, one new token each, contexts drawn from 16..600 (mean ~300);
   - prefill: one 480-token prompt chunk plus 32 decodes (a mixed continuous-batching step);
   - decode2k: 16 sequences at a 2048-token context, one new token each (issue 23's int4 speed
     check), float32 / int8 / int4 pools;
   float32 and int8 pools; ms per call, median of 40 after warm-up.
2. For each --build (a paged smollm2 build: `onnx` or `plugin` attention): the same two
   steps through the runtime's backend (ms per step), and onnxruntime's own profile of the
   step by op type (ms and share).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kvexport import manifest as mf
from kvexport.plugins.paged_attention import native
from kvexport.plugins.paged_attention.reference import make_case
from kvexport.runtime.execution.model_input import ModelInput
from kvexport.runtime.execution.ort_backends import ort_backend

RNG_SEED = 0


def step_shapes(kind: str) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(RNG_SEED)
    if kind == "decode":
        return [1] * 64, rng.integers(16, 600, 64).tolist()
    if kind == "decode2k":  # issue 23: decode at a 2k context (16 sequences)
        return [1] * 16, [2047] * 16
    return [480] + [1] * 32, [0] + rng.integers(16, 600, 32).tolist()


def time_calls(fn, n: int = 40, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def op_alone(lib: str, kind: str, kv_dtype: str) -> float:
    q_lens, ctx_lens = step_shapes(kind)
    case, attrs = make_case(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, q_lens=q_lens,
                            ctx_lens=ctx_lens, kv_dtype=kv_dtype, seed=RNG_SEED)
    feeds = {k: np.ascontiguousarray(v.numpy() if v is not None else np.ones(3, np.float32)) for k, v in case.items()}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(lib)
    sess = ort.InferenceSession(native.one_node_model(attrs, kv_dtype).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    b = native.in_place_binding(sess, feeds)
    return time_calls(lambda: sess.run_with_iobinding(b))


def model_input(kind: str, block_size: int) -> tuple[ModelInput, int, np.ndarray]:
    q, ctx = (np.array(x, np.int64) for x in step_shapes(kind))
    total = ctx + q
    nb = -(-total // block_size)
    tables = np.zeros((len(q), nb.max()), np.int64)
    nxt = 1
    for s in range(len(q)):
        tables[s, :nb[s]] = np.arange(nxt, nxt + nb[s])
        nxt += nb[s]
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int64)
    pos = np.concatenate([np.arange(c, t) for c, t in zip(ctx, total)]).astype(np.int64)
    slots = np.concatenate([[tables[s, p // block_size] * block_size + p % block_size for p in range(ctx[s], total[s])]
                            for s in range(len(q))]).astype(np.int64)
    inp = ModelInput(np.full(len(pos), 100, np.int64), pos, qsl, total, tables, slots)
    return inp, nxt, ctx


def subset(inp: ModelInput, seqs: list[int]) -> ModelInput:
    """The step restricted to some of its sequences."""
    q = inp.query_start_loc
    tok = np.concatenate([np.arange(q[s], q[s + 1]) for s in seqs])
    lens = np.array([q[s + 1] - q[s] for s in seqs], np.int64)
    return ModelInput(inp.token_ids[tok], inp.positions[tok], np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                      inp.seq_lens[seqs], inp.block_tables[seqs], inp.slot_mapping[tok])


def model_steps(build: Path) -> dict:
    m = mf.load(build)
    out = {"build": str(build), "attention": m.kv.attention, "kv_dtype": m.kv.dtype}
    for kind in ("decode", "prefill"):
        inp, num_blocks, ctx = model_input(kind, m.kv.block_size)
        be = ort_backend(build, m, num_blocks)
        if not be.full_block_tables:  # `onnx` attention: tables cover the pool part only
            inp = ModelInput(inp.token_ids, inp.positions, inp.query_start_loc, inp.seq_lens,
                             inp.block_tables[:, :max(1, int(-(-ctx.max() // m.kv.block_size)))], inp.slot_mapping)
        calls = [inp]
        if be.pads_queries and not inp.is_decode:  # as the model runner runs it: prompt chunk and decodes apart
            q_len = np.diff(inp.query_start_loc)
            calls = [subset(inp, np.flatnonzero(q_len > 1).tolist()), subset(inp, np.flatnonzero(q_len == 1).tolist())]
        ms = time_calls(lambda: [be.execute(c) for c in calls], n=5, warmup=2)
        out[kind] = {"tokens": int(len(inp.token_ids)), "sequences": int(len(inp.seq_lens)), "graph_calls": len(calls),
                     "mean_context": float(ctx.mean()), "step_ms": round(ms, 1),
                     "ops": profile(build, m, num_blocks, calls)}
    return out


def profile(build: Path, m, num_blocks: int, calls: list[ModelInput]) -> dict:
    """onnxruntime's per-node profile of the step, summed by op type (ms, share)."""
    agg: collections.Counter = collections.Counter()
    runs = 3
    be = ort_backend(build, m, num_blocks, profile_prefix=os.path.join(tempfile.mkdtemp(), "prof"))
    for _ in range(runs):
        for inp in calls:
            be.execute(inp)
    for path in be.end_profiling():
        for e in json.load(open(path)):
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                agg[e["args"]["op_name"]] += e["dur"]
        os.unlink(path)
    total = sum(agg.values())
    return {k: {"ms": round(v / runs / 1000, 2), "share": round(v / total, 3)} for k, v in agg.most_common(8)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", action="append", default=[], type=Path, help="a paged smollm2 build (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    lib = native.library()
    if lib is None:
        sys.exit("the native CPU op is not built: run scripts/build_cpu_ops.sh")
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "command": " ".join([Path(sys.executable).name] + sys.argv), "onnxruntime": ort.__version__,
           "op_ms_per_layer_call": {f"{kind}/{kv}": round(op_alone(str(lib), kind, kv), 3)
                                    for kind in ("decode", "prefill") for kv in ("float32", "int8")},
           "op_ms_per_layer_call_2k": {f"decode2k/{kv}": round(op_alone(str(lib), "decode2k", kv), 3)
                                       for kv in ("float32", "int8", "int4")},
           "builds": [model_steps(b) for b in args.build]}
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
