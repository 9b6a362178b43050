"""Perplexity of onnxruntime-genai's own CPU build of smollm2-135m (`python -m
onnxruntime_genai.models.builder -p int4|fp32 -e cpu`) on the text and windows kvexport's
reports use (bench/kv_quality.py, bench/weight_quality.py), for the peer comparison of quantized
builds.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/ortgenai_quality.py [--precision int4] [--tokens 2048]
        [--window 512] [--out bench/results/ortgenai_quality.json]

NOTE: the builder's model.onnx is run by onnxruntime directly (one prefill of each window, empty
past), not through onnxruntime-genai's Generator, which exposes only the last token's logits per
step; the graph, its MatMulNBits accuracy level and onnxruntime are the same, so are the numbers.
Windows: consecutive, `--window` tokens, every next token scored (= perplexity.nll_paged; its
chunking does not change the sums with full attention).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import onnx

from compare_ortgenai import ROOT, build_onnx, offline_env, prepare_hf  # bench/ sibling


def nll(model_dir: Path, ids: list[int], window: int, threads: int) -> tuple[float, int]:
    import onnxruntime as ort

    dec = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    heads, dim = dec["num_key_value_heads"], dec["head_size"]

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = threads, 3
    sess = ort.InferenceSession(str(model_dir / "model.onnx"), so, providers=["CPUExecutionProvider"])
    total, count = 0.0, 0
    for w0 in range(0, len(ids) - 1, window):
        win = ids[w0:w0 + window]
        if len(win) < 2:
            break
        n = len(win)
        feeds = {}
        for i in sess.get_inputs():
            if i.name == "input_ids":
                feeds[i.name] = np.array([win], np.int64)
            elif i.name == "attention_mask":
                feeds[i.name] = np.ones((1, n), np.int64)
            elif i.name == "position_ids":
                feeds[i.name] = np.arange(n, dtype=np.int64)[None]
            elif i.name.startswith("past_key_values."):
                feeds[i.name] = np.zeros((1, heads, 0, dim), np.float32)  # [batch, kv heads, past, head dim]
            else:
                raise SystemExit(f"unexpected input {i.name} {i.shape}")
        logits = sess.run(["logits"], feeds)[0][0, :-1].astype(np.float64)  # [n - 1, vocab]
        lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
        total += float((lse - logits[np.arange(n - 1), win[1:]]).sum())
        count += n - 1
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", default="int4", choices=["fp32", "int4"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--cache", default=str(ROOT / "bench/.cache"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/ortgenai_quality.json"))
    a = ap.parse_args()
    offline_env()
    from kvexport.exporter import calibrate, source

    cache = Path(a.cache)
    hf = prepare_hf(cache / "smollm2-hf")
    model_dir, _ = build_onnx(hf, cache / f"smollm2-ortgenai-{a.precision}-cpu", cache / "builder-cache", a.precision)
    tok = source.load_tokenizer(source.resolve("smollm2-135m"))
    ids = tok(calibrate.read_text(calibrate.default_text(calibrate.EVALUATION_TEXT)),
              add_special_tokens=False)["input_ids"][:a.tokens]
    s, n = nll(model_dir, ids, a.window, a.threads)
    levels = sorted({next((x.i for x in node.attribute if x.name == "accuracy_level"), None)
                     for node in onnx.load(str(model_dir / "model.onnx"), load_external_data=False).graph.node
                     if node.op_type == "MatMulNBits"} - {None})
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "precision": a.precision, "perplexity": round(math.exp(s / n), 4),
              "tokens_scored": n, "matmulnbits_accuracy_levels": levels,
              "evaluation_text": f"King Lear, {len(ids)} tokens, windows of {a.window}",
              "weights_bytes": sum(f.stat().st_size for f in model_dir.glob("model.onnx*")),
              "command": f"python bench/ortgenai_quality.py --precision {a.precision} --tokens {a.tokens} "
                         f"--window {a.window}"}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
