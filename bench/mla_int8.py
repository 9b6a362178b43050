"""Whether an int8 latent pool holds MLA's accuracy, and what the native CPU PagedMLA op costs.

    .venv/bin/python bench/mla_int8.py [--out bench/results/mla_int8.json] [--no-speed]

1. Accuracy (the float64 reference, plugins/paged_mla/reference.py): DeepSeek-V3's row (kv_lora_rank
   512 + qk_rope_head_dim 64), 16 heads (one GPU's share at tensor parallel 8), 8 sequences decoding
   at contexts ~1k plus one 64-token prompt chunk, rows shaped like DeepSeek's
   (`reference.realistic_rows`: RMS-normalised latents times per-channel gains with a few ~8x
   channels; rotated RoPE keys with per-pair magnitudes and a few ~10x pairs). Static int8 scales
   are calibrated as `kvexport calibrate` would (absmax / 127 per channel) on 4096 *other* rows of
   the same profile. Reported: max |Δ| and relative RMS error of the attended latent (the op's
   output; the graph's W_UV and o_proj are linear after it), against the float32 pool, for
   per-channel scales (the op's) and one scale for the whole row (what per-channel buys), and with
   the evaluation rows 1.25x larger than calibration saw (saturation).
2. Speed of the native CPU op (kvexport op library), pools bound in place as the runtime does: the
   same decode step (8 × ~1k context, 16 heads) with float32, bfloat16 and int8 pools, ms per call,
   median of 20 after warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from kvexport.plugins.paged_mla import native, reference

SHAPE = dict(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, block_size=16, scale=192 ** -0.5)
Q_LENS = [1] * 8 + [64]
CTX_LENS = [1024 - 37 * i for i in range(8)] + [512]


def _errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (out.double() - ref.double())
    return dict(max_abs=d.abs().max().item(), rel_rms=(d.norm() / ref.double().norm()).item(),
                ref_max_abs=ref.double().abs().max().item())


def accuracy() -> dict:
    inputs, attrs = reference.make_case(**SHAPE, q_lens=Q_LENS, ctx_lens=CTX_LENS, realistic=True, seed=11)
    float_attrs = attrs
    want = reference.paged_mla(**{k: v.clone() for k, v in inputs.items()}, attrs=float_attrs)
    rows_f = inputs["latent_cache"]  # float32 realistic rows
    gen = torch.Generator().manual_seed(99)
    calib = reference.realistic_rows(4096, attrs, gen)  # other tokens of the same "model"
    int8_attrs = replace(attrs, kv_dtype="int8")
    out = {}
    scales = {"per_channel": reference.scales_from_absmax(calib.abs().amax(0)),
              "per_row_one_scale": reference.scales_from_absmax(calib.abs().amax().expand(attrs.row_width))}
    for name, s in scales.items():
        case = dict(inputs, latent_cache=reference.quantize(rows_f, s), kv_scale=s)
        got = reference.paged_mla(**{k: v.clone() for k, v in case.items()}, attrs=int8_attrs)
        out[name] = _errors(got, want)
    # rows 1.25x larger than the calibration saw: the extreme channels saturate
    big = dict(inputs, latent_cache=rows_f * 1.25, latent=inputs["latent"] * 1.25)
    want_big = reference.paged_mla(**{k: v.clone() for k, v in big.items()}, attrs=float_attrs)
    s = scales["per_channel"]
    case = dict(big, latent_cache=reference.quantize(big["latent_cache"], s), kv_scale=s)
    out["per_channel_rows_1.25x_calibration"] = _errors(
        reference.paged_mla(**{k: v.clone() for k, v in case.items()}, attrs=int8_attrs), want_big)
    # fp16 / bf16 pools, for scale
    for kv in ("float16", "bfloat16"):
        a = replace(attrs, kv_dtype=kv)
        case = dict(inputs, latent_cache=rows_f.to(reference.torch_dtype(kv)))
        out[kv] = _errors(reference.paged_mla(**{k: v.clone() for k, v in case.items()}, attrs=a), want)
    return out


def speed(repeats: int = 20) -> dict:
    import onnxruntime as ort

    lib = native.library()
    if lib is None or not native.has_mla(lib):
        return dict(error="the native op library with PagedMLA is not built (scripts/build_cpu_ops.sh)")
    res = {}
    for kv in ("float32", "bfloat16", "int8"):
        inputs, attrs = reference.make_case(**SHAPE, q_lens=[1] * 8, ctx_lens=CTX_LENS[:8], kv_dtype=kv,
                                            realistic=True, seed=12)
        so = ort.SessionOptions()
        so.register_custom_ops_library(str(lib))
        so.intra_op_num_threads = 2
        sess = ort.InferenceSession(native.one_node_model(attrs).SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
        bits = {k: (v.view(torch.int16).numpy().view(np.uint16) if v.dtype == torch.bfloat16 else v.numpy())
                for k, v in inputs.items()}
        feeds = {k: np.ascontiguousarray(v) for k, v in bits.items()}
        b = native.in_place_binding(sess, feeds, kv)
        for _ in range(3):
            sess.run_with_iobinding(b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sess.run_with_iobinding(b)
            times.append(time.perf_counter() - t0)
        rows = int(inputs["seq_lens"].sum())
        res[kv] = dict(ms=statistics.median(times) * 1e3, rows=rows,
                       pool_bytes_read=rows * attrs.row_width * inputs["latent_cache"].element_size())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/mla_int8.json")
    ap.add_argument("--no-speed", action="store_true")
    args = ap.parse_args()
    report = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), machine=platform.processor() or
                  platform.machine(), shape=SHAPE, q_lens=Q_LENS, ctx_lens=CTX_LENS, accuracy=accuracy())
    if not args.no_speed:
        report["speed"] = speed()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
