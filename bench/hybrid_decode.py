"""Decode step time of a gated DeltaNet hybrid vs an all-attention model of the same shape, by context
length, on onnxruntime's CPU (paged builds, fp32, random weights), in each graph form asked for: `onnx`
(standard ops: the chunked rule in an ONNX Loop, masked paged attention) and/or `plugin` (one
kvexport::GatedDeltaRule node per linear layer and PagedAttention nodes, the native CPU ops).

    .venv/bin/python bench/hybrid_decode.py [--layers 4] [--seqs 1] [--contexts 2048,8192,32768]
        [--repeats 5] [--threads 2] [--vocab 8192] [--forms onnx] [--prefill 0] [--no-attention]
        [--out bench/results/hybrid_decode.json]

--prefill N also times one N-token prefill chunk ending at each context (chunked prefill as served: the
linear layers resume from their state slot, the attention layer reads context - N earlier tokens).
--no-attention skips the all-attention model. --op-delta only measures the native GatedDeltaRule op against
its float64 reference at Qwen3.5-0.8B's head shape (a 512-token prefill chunk resuming from its slot, a fresh
300-token prompt and 8 decodes; fp32): max |Δ| of outputs and new states, and the op's time.

Both models are qwen3_5_text with Qwen3.5-0.8B-like layer shapes (hidden 1024, MLP 3584, attention 8 heads
/ 2 KV heads x 256 with partial RoPE 0.25 and the output gate; linear attention 16 key and value heads x 128,
conv kernel 4): the hybrid's layer_types are 3 linear : 1 full attention, the other's all full attention.
--layers of them (default 4: one 3 : 1 group; the step time per group is what a 24-layer model repeats),
vocab cut to --vocab (the LM head is the same for both). The KV pools hold `context` tokens per sequence
(zeros: the step's arithmetic does not depend on the values); each step decodes one token per sequence at
position context - 1. Reported: the median of --repeats steps after one warm-up, ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, max_position_embeddings=262144, tie_word_embeddings=True,
             rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_one(kind: str, layers: int, vocab: int, max_len: int, root: Path, form: str = "onnx") -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from kvexport import io
    from kvexport.exporter.build import BuildOptions, build

    types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4) if kind == "hybrid" \
        else ["full_attention"] * layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(vocab_size=vocab, num_hidden_layers=layers,
                                                               layer_types=types, **SHAPE))
    src = root / f"hf-{kind}"
    if not src.exists():
        model.save_pretrained(src, safe_serialization=True)
    out, _ = build(str(src), root / f"{kind}-{form}", BuildOptions(layout=io.KVLayout.PAGED,
                                                                 attention=io.Attention(form), block_size=16,
                                                                 max_seq_len=max_len, validate=False))
    return out


def step_ms(out: Path, seqs: int, context: int, repeats: int, threads: int, new_tokens: int = 1) -> float:
    """Median ms of a step of `new_tokens` per sequence ending at `context` (1: a decode step)."""
    from kvexport import manifest as mf
    from kvexport.runtime.execution.model_runner import ModelRunner, chunk
    from kvexport.runtime.execution.ort_backends import ort_backend

    m = mf.load(out)
    per_seq = -(-context // 16)
    backend = ort_backend(out, m, 1 + seqs * per_seq, threads=threads, providers=["CPUExecutionProvider"])
    runner = ModelRunner(backend, 16)
    tables = [[1 + s * per_seq + j for j in range(per_seq)] for s in range(seqs)]
    chunks = [chunk(str(s), [5] * new_tokens, context - new_tokens, tables[s], 16) for s in range(seqs)]
    runner.logits(chunks)  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        runner.logits(chunks)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def op_delta(threads: int) -> dict:
    """The native op vs the float64 reference, fp32, Qwen3.5-0.8B's linear-layer heads."""
    import numpy as np

    from kvexport.plugins.gated_delta import native
    from kvexport.plugins.gated_delta.reference import gated_delta, make_case
    from kvexport.plugins.gated_delta.spec import INPUTS

    inputs, attrs = make_case(num_k_heads=16, num_v_heads=16, k_head_dim=128, v_head_dim=128,
                              q_lens=[512, 300] + [1] * 8, ctx_lens=[2048, 0] + [2047] * 8, seed=0)
    ref_out, ref_new = gated_delta(**inputs, attrs=attrs)
    sess = native.session(attrs, threads)
    feeds = {n: inputs[n].numpy() for n in INPUTS}
    out, new = sess.run(None, feeds)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - t) * 1e3)
    return dict(max_abs_out=float(np.abs(out - ref_out.numpy()).max()),
                max_abs_state=float(np.abs(new - ref_new.numpy()).max()),
                max_state=float(np.abs(ref_new.numpy()).max()), op_ms=round(statistics.median(times), 2),
                tokens=int(feeds["query"].shape[0]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--forms", default="onnx", help="graph forms, comma-separated: onnx, plugin")
    ap.add_argument("--prefill", type=int, default=0, help="also time an N-token prefill chunk (0: no)")
    ap.add_argument("--no-attention", action="store_true", help="the hybrid only")
    ap.add_argument("--op-delta", action="store_true", help="only the native op vs its reference (see above)")
    ap.add_argument("--out", default="bench/results/hybrid_decode.json")
    a = ap.parse_args()
    if a.op_delta:
        print(json.dumps({"load_avg": os.getloadavg(), **op_delta(a.threads)}))
        return
    contexts = [int(c) for c in a.contexts.split(",")]
    forms = a.forms.split(",")
    kinds = ("hybrid",) if a.no_attention else ("hybrid", "attention")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        builds = {f"{k}_{f}" if len(forms) > 1 else k: build_one(k, a.layers, a.vocab, max(contexts), Path(tmp), f)
                  for k in kinds for f in forms}
        for ctx in contexts:
            row = {"context": ctx, **{f"{k}_ms": round(step_ms(b, a.seqs, ctx, a.repeats, a.threads), 2)
                                      for k, b in builds.items()}}
            if a.prefill:
                row.update({f"{k}_prefill{a.prefill}_ms": round(step_ms(b, a.seqs, ctx, a.repeats, a.threads,
                                                                        a.prefill), 1) for k, b in builds.items()})
            rows.append(row)
            print(row, flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_avg": os.getloadavg(), "args": vars(a), "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
