"""GPU check of the GatedDeltaRule Triton kernel (run by scripts/gpu_check.sh on a lent GPU, after
the PagedAttention and PagedMLA checks):

  1. correctness at Qwen3.5-0.8B's shape (16 q/k and 16 value heads of 128) and Qwen3-Next's (16 q/k,
     32 value heads) against the float64 torch reference on the GPU: decodes resuming from their slots
     (batch 1-64), ragged prefill chunks (fresh and resumed), fp32 / fp16 / bf16, every tile;
  2. decode time with CUDA events (median) and achieved bandwidth = bytes the call must move (each
     sequence's state read and the new state written, float32, + q/k/v/g/beta read and the output
     written) / time, against the device-to-device copy bandwidth of the same run (reported);
  3. prefill time of one 2048-token chunk (the recurrence runs token by token: reported, no goal).

Writes <out>/gpu_check_gated_delta.json and prints a summary. `--tiny` runs the same logic at toy
sizes on CPU under TRITON_INTERPRET=1 (tests/plugins/test_gpu_check_dry_run.py, through gpu_check.sh).
The command line, the correctness loop, timing and copy bandwidth are plugins/common/gpu_check.py's.
"""

from __future__ import annotations

import sys
import time

from ..common.gpu_check import check_cases, cli, copy_bandwidth, correctness_lines, median_seconds, report_header

QWEN35 = dict(num_k_heads=16, num_v_heads=16, k_head_dim=128, v_head_dim=128)  # Qwen3.5-0.8B's linear layers
QWEN3_NEXT = dict(num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128)
TINY = dict(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16)
TINY_NEXT = dict(num_k_heads=1, num_v_heads=3, k_head_dim=12, v_head_dim=20)


def check_correctness(device: str, cases: list[dict]) -> list[dict]:
    from . import configs
    from .launch import gated_delta_triton
    from .reference import gated_delta, make_case
    from .spec import TOLERANCE

    def compare(c: dict) -> tuple[float, float, bool]:
        shape, tile = c.pop("shape"), c.pop("tile", None)
        inputs, attrs = make_case(**shape, **c, device=device)
        pool = inputs["recurrent_state"].clone()
        out, new = gated_delta_triton(**inputs, attrs=attrs, tile=tile and configs.TILES[tile])
        ref_out, ref_new = gated_delta(**inputs, attrs=attrs)
        err = max((out.double() - ref_out.double()).abs().max().item(), (new - ref_new).abs().max().item())
        tol = TOLERANCE[c.get("act_dtype", "float32")] * max(1.0, ref_new.abs().max().item())
        return err, tol, bool((pool == inputs["recurrent_state"]).all())  # the pool only read

    return check_cases(device, cases, compare)


def step_bytes(inputs: dict, attrs) -> int:
    """Bytes one call must move: every sequence's state read and written (float32), q/k/v read,
    g/beta read, the output written."""
    s = inputs["state_slots"].shape[0]
    state = 2 * s * attrs.num_v_heads * attrs.k_head_dim * attrs.v_head_dim * 4
    act = inputs["query"].element_size()
    t = inputs["query"].shape[0]
    qkv = t * (2 * attrs.num_k_heads * attrs.k_head_dim + 2 * attrs.num_v_heads * attrs.v_head_dim) * act
    return state + qkv + t * attrs.num_v_heads * 8


def time_step(shape: dict, device: str, q_lens: list[int], ctx: int, act: str, warmup: int, iters: int,
              tiles) -> dict:
    """Every tile timed on one step; the best reported."""
    from .launch import gated_delta_triton
    from .reference import make_case

    inputs, attrs = make_case(**shape, q_lens=q_lens, ctx_lens=[ctx] * len(q_lens), act_dtype=act, seed=1,
                              device=device)
    nbytes = step_bytes(inputs, attrs)
    variants = []
    for tile in tiles:
        try:
            t = median_seconds(lambda: gated_delta_triton(**inputs, attrs=attrs, tile=tile), device, warmup, iters)
            variants.append(dict(tile=str(tile), seconds=t, bytes_per_s=nbytes / t))
        except Exception as e:
            variants.append(dict(tile=str(tile), error=f"{type(e).__name__}: {e}"))
    timed = [v for v in variants if "seconds" in v]
    return dict(batch=len(q_lens), q_len=q_lens[0], act_dtype=act, bytes=nbytes,
                best=min(timed, key=lambda v: v["seconds"]) if timed else None, variants=variants)


def run(tiny: bool) -> dict:
    from . import configs

    device = "cpu" if tiny else "cuda"
    report = report_header(tiny)
    big, nxt = (TINY, TINY_NEXT) if tiny else (QWEN35, QWEN3_NEXT)
    report["shapes"] = dict(qwen35=big, qwen3_next=nxt)
    b, q, warm, iters, copy_mb = (2, 7, 0, 1, 8) if tiny else (64, 512, 3, 20, 1024)
    t0 = time.perf_counter()
    cases = [
        dict(name=f"decode b{b} fp16 resumed", shape=big, q_lens=[1] * b, ctx_lens=[100] * b, act_dtype="float16"),
        dict(name="decode b1 bf16 resumed", shape=big, q_lens=[1], ctx_lens=[7], act_dtype="bfloat16"),
        dict(name="decode b8 fp32 (fresh and resumed)", shape=big, q_lens=[1] * 8, ctx_lens=[0, 5] * 4),
        dict(name=f"prefill b2 q{q} fp16 fresh + resumed", shape=big, q_lens=[q, q], ctx_lens=[0, 300],
             act_dtype="float16"),
        dict(name=f"prefill q{q} fp32 resumed", shape=big, q_lens=[q], ctx_lens=[64]),
        dict(name="qwen3-next decode b8 bf16 tile 2", shape=nxt, q_lens=[1] * 8, ctx_lens=[9] * 8,
             act_dtype="bfloat16", tile=1),
        dict(name="qwen3-next prefill ragged fp16 tile 3", shape=nxt, q_lens=[q, 3, 1], ctx_lens=[0, 40, 2],
             act_dtype="float16", tile=2),
    ]
    report["correctness"] = check_correctness(device, cases)
    report["seconds_correctness"] = round(time.perf_counter() - t0, 1)
    bw = copy_bandwidth(device, copy_mb << 20, warm, iters)
    report["copy_bytes_per_s"] = bw
    tiles = (configs.INTERPRET_TILE,) if tiny else configs.TILES
    report["decode_fp16"] = time_step(big, device, [1] * b, 2048, "float16", warm, iters, tiles)
    report["decode_b1_fp16"] = time_step(big, device, [1], 2048, "float16", warm, iters, tiles)
    report["prefill_fp16"] = time_step(big, device, [8 if tiny else 2048], 0, "float16", warm,
                                       iters if tiny else 3, tiles)
    best = report["decode_fp16"]["best"]
    report["bandwidth_fraction"] = best["bytes_per_s"] / bw if best else 0.0
    report["goals"] = dict(correctness=all(c["ok"] for c in report["correctness"]))
    report["seconds_total"] = round(time.perf_counter() - t0, 1)
    return report


def summary(r: dict) -> str:
    lines = correctness_lines(r, "GatedDeltaRule")
    lines.append(f"  copy bandwidth {r['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    for key in ("decode_fp16", "decode_b1_fp16", "prefill_fp16"):
        d, v = r[key], r[key]["best"]
        lines.append(f"  {key} (batch {d['batch']}, q_len {d['q_len']}): {v['seconds'] * 1e6:.0f} us, "
                     f"{v['bytes_per_s'] / 1e9:.1f} GB/s (tile {v['tile']})" if v else
                     f"  {key}: no timing ({[x.get('error') for x in d['variants']][:2]})")
    lines.append(f"  bandwidth fraction {r['bandwidth_fraction']:.2f}; goals {r['goals']}; {r['seconds_total']} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    return cli(argv, __doc__.splitlines()[0], "gpu_check_gated_delta.json", run, summary)


if __name__ == "__main__":
    sys.exit(main())
