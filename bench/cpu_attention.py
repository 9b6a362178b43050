"""Where a serving step's time goes on a CPU, and what the native PagedAttention op costs.

    .venv/bin/python bench/cpu_attention.py [--build DIR ...] [--out bench/results/cpu_attention.json]
    .venv/bin/python bench/cpu_attention.py --step-only [--seqs 1 --seqs 8] [--kv-dtype int4 ...] [--calls 20]

1. The op alone (plugins/paged_attention/cpu), one layer of smollm2-135m's shape (9 query
   heads, 3 KV heads, head_dim 64, blocks of 16), pools bound in place as the runtime does:
   - decode: 64 sequences, one new token each, contexts drawn from 16..600 (mean ~300);
   - prefill: one 480-token prompt chunk plus 32 decodes (a mixed continuous-batching step);
   - decode2k: 16 sequences at a 2048-token context, one new token each, float32 / int8 /
     int4 pools;
   float32 and int8 pools; ms per call, median of 40 after warm-up. One layer called again and
   again keeps its pools in the caches as far as they fit: the case that flatters fp32.
2. A decode step's attention at a 2k context (issue 23's int4 speed check): smollm2-135m's 30
   layers as 30 nodes of one graph, each with pools of its own, 1 and 8 sequences of 2047
   cached tokens + 1 new. A step reads every layer's pool once, so fp32's working set (8
   sequences: 30 x 2 x 8 x 2048 x 3 x 256 bytes = 755 MB) is far beyond any cache and memory
   traffic counts, as it does when serving. float32 and int4 steps alternate call by call
   (ms per step, medians; `x_float32`: the median of the per-pair ratios).
3. For each --build (a paged smollm2 build: `onnx` or `plugin` attention): the same two
   steps through the runtime's backend (ms per step), and onnxruntime's own profile of the
   step by op type (ms and share).

--step-only runs part 2 alone (for timing whole processes, one KV dtype each).
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
from onnx import helper

from kvexport import manifest as mf
from kvexport.plugins.paged_attention import native
from kvexport.plugins.paged_attention.reference import make_case
from kvexport.runtime.execution.model_input import ModelInput
from kvexport.runtime.execution.ort_backends import ort_backend

RNG_SEED = 0
SMOLLM2 = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)  # smollm2-135m's attention
SMOLLM2_LAYERS = 30


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
    case, attrs = make_case(**SMOLLM2, q_lens=q_lens, ctx_lens=ctx_lens, kv_dtype=kv_dtype, seed=RNG_SEED)
    feeds = {k: np.ascontiguousarray(v.numpy() if v is not None else np.ones(3, np.float32)) for k, v in case.items()}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(lib)
    sess = ort.InferenceSession(native.one_node_model(attrs, kv_dtype).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    b = native.in_place_binding(sess, feeds)
    return time_calls(lambda: sess.run_with_iobinding(b))


def step_model(attrs, kv_dtype: str, layers: int):
    """One decode step's attention: `layers` PagedAttention nodes (a model's layers), each with
    pools of its own (key_cache_{i}, value_cache_{i}), sharing the step's metadata and, since only
    the op's time is measured here, its query and new K/V."""
    one = native.one_node_model(attrs, kv_dtype)
    layer, node = one.graph, one.graph.node[0]
    pools = ("key_cache", "value_cache")
    ins = {v.name: v for v in layer.input}
    inputs = [v for n, v in ins.items() if n not in pools]
    nodes, outputs = [], []
    for i in range(layers):
        inputs += [helper.make_tensor_value_info(f"{n}_{i}", ins[n].type.tensor_type.elem_type, None) for n in pools]
        outs = [f"{o}_{i}" for o in node.output]
        layer_node = helper.make_node(node.op_type, [f"{n}_{i}" if n in pools else n for n in node.input], outs,
                                      domain=node.domain, name=f"layer{i}")
        layer_node.attribute.extend(node.attribute)
        nodes.append(layer_node)
        outputs += [helper.make_tensor_value_info(o, v.type.tensor_type.elem_type, None)
                    for o, v in zip(outs, layer.output)]
    return helper.make_model(helper.make_graph(nodes, "decode_step", inputs, outputs), opset_imports=one.opset_import)


def step_session(lib: str, seqs: int, kv_dtype: str, layers: int, threads: int):
    """(a session of step_model, its IOBinding with every pool bound in place) for `seqs` sequences
    at a 2k context; every layer's pools hold the same random rows in buffers of their own."""
    case, attrs = make_case(**SMOLLM2, q_lens=[1] * seqs, ctx_lens=[2047] * seqs, num_blocks=seqs * 128 + 1,
                            kv_dtype=kv_dtype, seed=RNG_SEED)
    feeds = {k: np.ascontiguousarray(v.numpy() if v is not None else np.ones(3, np.float32)) for k, v in case.items()}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(lib)
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(step_model(attrs, kv_dtype, layers).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    b = sess.io_binding()
    for n, arr in feeds.items():
        if n in ("key_cache", "value_cache"):
            for i in range(layers):
                pool = ort.OrtValue.ortvalue_from_numpy(arr.copy())
                b.bind_ortvalue_input(f"{n}_{i}", pool)
                b.bind_ortvalue_output(f"{n}_out_{i}", pool)
        else:
            b.bind_cpu_input(n, arr)
    for i in range(layers):
        b.bind_output(f"output_{i}")
    pool_bytes = 2 * layers * feeds["key_cache"].nbytes
    return sess, b, pool_bytes


def decode_step(lib: str, seqs: int, kv_dtypes: list[str], calls: int, threads: int,
                layers: int = SMOLLM2_LAYERS) -> dict:
    """ms per decode step (all layers' attention) for each KV dtype, the dtypes' calls in turn:
    wall ms and this process's CPU ms (all threads; the figure that a loaded machine disturbs less)."""
    runs = {kv: step_session(lib, seqs, kv, layers, threads) for kv in kv_dtypes}
    wall: dict[str, list[float]] = {kv: [] for kv in kv_dtypes}
    cpu: dict[str, list[float]] = {kv: [] for kv in kv_dtypes}
    for i in range(calls + 2):  # two warm-up rounds
        for kv, (sess, b, _) in runs.items():
            t, c = time.perf_counter(), time.process_time()
            sess.run_with_iobinding(b)
            if i >= 2:
                wall[kv].append((time.perf_counter() - t) * 1000)
                cpu[kv].append((time.process_time() - c) * 1000)
    out = {}
    for kv in kv_dtypes:
        out[kv] = {"pool_mb": round(runs[kv][2] / 2 ** 20, 1), "step_ms": round(statistics.median(wall[kv]), 2),
                   "min_ms": round(min(wall[kv]), 2), "max_ms": round(max(wall[kv]), 2),
                   "cpu_ms": round(statistics.median(cpu[kv]), 2)}
        if kv != "float32" and "float32" in wall:
            out[kv]["x_float32"] = round(statistics.median([x / f for x, f in zip(wall[kv], wall["float32"])]), 3)
            out[kv]["cpu_x_float32"] = round(statistics.median([x / f for x, f in zip(cpu[kv], cpu["float32"])]), 3)
    return {"sequences": seqs, "context": 2048, "layers": layers, "threads": threads, "calls": calls, **out}


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
    p.add_argument("--step-only", action="store_true", help="only the 30-layer decode steps (part 2)")
    p.add_argument("--seqs", action="append", type=int, default=None, help="decode-step sequences (default 1 and 8)")
    p.add_argument("--kv-dtype", action="append", default=None, choices=("float32", "int8", "int4"),
                   help="decode-step KV dtypes (default float32 and int4)")
    p.add_argument("--calls", type=int, default=20, help="decode-step calls per KV dtype, after two warm-ups")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="decode-step intra-op threads")
    args = p.parse_args()
    lib = native.library()
    if lib is None:
        sys.exit("the native CPU op is not built: run scripts/build_cpu_ops.sh")
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "command": " ".join([Path(sys.executable).name] + sys.argv), "onnxruntime": ort.__version__,
           "library": str(lib), "load": os.getloadavg()[0]}
    if not args.step_only:
        res["op_ms_per_layer_call"] = {f"{kind}/{kv}": round(op_alone(str(lib), kind, kv), 3)
                                       for kind in ("decode", "prefill") for kv in ("float32", "int8")}
        res["op_ms_per_layer_call_2k"] = {f"decode2k/{kv}": round(op_alone(str(lib), "decode2k", kv), 3)
                                          for kv in ("float32", "int8", "int4")}
    res["decode_step_2k"] = [decode_step(str(lib), n, args.kv_dtype or ["float32", "int4"], args.calls,
                                         args.threads)
                             for n in args.seqs or [1, 8]]
    if not args.step_only:
        res["builds"] = [model_steps(b) for b in args.build]
    res["load_after"] = os.getloadavg()[0]
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
