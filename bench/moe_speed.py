"""Mixture-of-experts graph forms on onnxruntime's CPU: grouped (each expert on its own tokens,
exporter/moe.py, the default) vs dense (every expert on every token) vs onnxruntime's own
com.microsoft.MoE contrib op, on a tiny-but-wide qwen3_moe-shaped config (hidden 256, 32 experts,
top-4, expert width 256, norm_topk_prob; random weights).

    .venv/bin/python bench/moe_speed.py [--threads 2] [--repeats 30] [--out bench/results/moe_speed.json]

1. The MoE block alone (router + experts), x [N, 256] -> [N, 256]: N = 16 (a decode step of 16
   sequences) and N = 256 (a 256-token prefill step); ms per call, median of --repeats after warm-up.
   The contrib op takes the same weights (gate/up interleaved, [E, 2I, H]; softmax top-k renormalized)
   and is checked to give the same output.
2. A whole 4-layer model (4 heads, 2 KV heads), contiguous graphs built by exporter/graph.py in each
   MoE form: one decode step (16 sequences, 256 cached tokens each) and one 256-token prefill step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, EXPERTS, TOP_K, INTER, LAYERS = 256, 32, 4, 256, 4


def _blocks():
    spec = importlib.util.spec_from_file_location("moe_blocks", ROOT / "tests/exporter/moe_blocks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 3)


def contrib_session(spec, ew, threads: int):
    """com.microsoft.MoE on the same weights: fc1 [E, 2I, H] gate/up interleaved (swiglu_fusion=1)."""
    e, i, h = spec.moe.num_experts, spec.moe.expert_intermediate_size, spec.hidden_size
    gate, up = ew.up_w[..., :i], ew.up_w[..., i:]
    fc1 = np.stack([gate, up], -1).reshape(e, h, 2 * i).transpose(0, 2, 1)
    inits = [numpy_helper.from_array(ew.router_w, "router"),
             numpy_helper.from_array(np.ascontiguousarray(fc1), "fc1"),
             numpy_helper.from_array(np.ascontiguousarray(ew.down_w.transpose(0, 2, 1)), "fc2")]
    nodes = [helper.make_node("MatMul", ["x", "router"], ["logits"]),
             helper.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft",
                              k=spec.moe.top_k, normalize_routing_weights=int(spec.moe.norm_topk_prob),
                              activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0)]
    g = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", h])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", h])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 9
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def block_figures(mb, threads: int, repeats: int) -> dict:
    module, config, f = mb.hf_block("qwen3_moe", hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                    moe_intermediate_size=INTER)
    spec = mb.spec_of(config, f, hidden=HIDDEN)
    lw = mb.layer_weights(module, spec, f)
    sessions = {form: mb.block_session(spec, lw, form, threads=threads)[0] for form in ("grouped", "dense")}
    sessions["com.microsoft.MoE"] = contrib_session(spec, lw.moe, threads)
    out = {}
    rng = np.random.default_rng(0)
    for n, what in ((16, "decode (16 tokens)"), (256, "prefill (256 tokens)")):
        x = rng.standard_normal((n, HIDDEN)).astype(np.float32)
        with torch.no_grad():
            want = module(torch.from_numpy(x)[None])[0].numpy()
        row = {}
        for name, s in sessions.items():
            got = s.run(None, {"x": x})[0]
            assert np.abs(got - want).max() < 1e-3, (name, np.abs(got - want).max())
            row[name] = median_ms(lambda s=s: s.run(None, {"x": x}), repeats)
        out[what] = row
    return out


def model_figures(threads: int, repeats: int) -> dict:
    """Whole-model steps, contiguous graphs of a tiny-but-wide qwen3_moe in each MoE form."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_hf_folder

    from kvexport import io
    from kvexport.exporter import source
    from kvexport.exporter.families import FAMILIES, read_spec
    from kvexport.exporter.graph import DecoderGraph, GraphOptions, model_rope_tables
    from kvexport.exporter.onnx_builder import WeightStore

    tmp = Path(tempfile.mkdtemp(prefix="moe-speed-"))
    src = make_hf_folder("qwen3_moe", tmp / "hf", vocab_size=512, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, moe_intermediate_size=INTER, norm_topk_prob=True)
    s = source.resolve(str(src))
    spec = read_spec(source.load_config(s))
    model = source.load_model(s)
    weights = FAMILIES[spec.family].weights(model.state_dict(), spec)
    rope = model_rope_tables(spec, model.model.rotary_emb, 512)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    out: dict = {}
    rng = np.random.default_rng(0)
    past, seqs, prompt = 256, 16, 256
    feeds = {
        "decode (16 sequences x 256 cached)": {
            "input_ids": rng.integers(3, 512, (seqs, 1)), "attention_mask": np.ones((seqs, past + 1), np.int64),
            "position_ids": np.full((seqs, 1), past, np.int64),
            **{f"past_key_values.{i}.{kv}": rng.standard_normal((seqs, 2, past, 64)).astype(np.float32)
               for i in range(LAYERS) for kv in ("key", "value")}},
        "prefill (256 tokens)": {"input_ids": rng.integers(3, 512, (1, prompt)),
                                 "attention_mask": np.ones((1, prompt), np.int64),
                                 "position_ids": np.arange(prompt, dtype=np.int64)[None]}}
    for form in ("grouped", "dense"):
        store = WeightStore()
        graphs = {}
        for phase in (io.Phase.PREFILL, io.Phase.DECODE):
            opts = GraphOptions(io.KVLayout.CONTIGUOUS, phase, io.DType.FP32, io.DType.FP32, 16, 512, False,
                                moe_form=form)
            graphs[phase] = DecoderGraph(spec, weights, rope, opts, store).build()
        d = tmp / form
        d.mkdir()
        store.write(str(d / "weights.data"))
        for phase, b in graphs.items():
            (d / f"{phase.value}.onnx").write_bytes(b.to_model("weights.data").SerializeToString())
        for what, phase in (("decode (16 sequences x 256 cached)", io.Phase.DECODE),
                            ("prefill (256 tokens)", io.Phase.PREFILL)):
            sess = ort.InferenceSession(str(d / f"{phase.value}.onnx"), so, providers=["CPUExecutionProvider"])
            feed = {k: v for k, v in feeds[what].items() if k in {i.name for i in sess.get_inputs()}}
            out.setdefault(what, {})[form] = median_ms(lambda sess=sess, feed=feed: sess.run(None, feed), repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench/results/moe_speed.json"))
    a = ap.parse_args()
    mb = _blocks()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine()) if Path("/proc/cpuinfo").exists() else platform.machine()
    result = {"date": time.strftime("%Y-%m-%d"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": f"{os.cpu_count()} cores, {cpu}; load average at start {os.getloadavg()[0]:.1f}",
              "config": dict(hidden=HIDDEN, experts=EXPERTS, top_k=TOP_K, expert_intermediate=INTER, layers=LAYERS),
              "threads": a.threads, "onnxruntime": ort.__version__,
              "block_ms": block_figures(mb, a.threads, a.repeats), "model_step_ms": model_figures(a.threads, a.repeats)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
