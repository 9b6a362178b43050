"""GPU check of the PagedAttention Triton kernels (run by scripts/gpu_check.sh on a lent GPU):

  1. correctness at Llama-3-8B shapes (32 query heads, 8 KV heads, head_dim 128, blocks of
     16) against the float64 torch reference on the GPU: decode batch 1-64, contexts up to
     8k, split-K on/off, fp16/bf16, int8 and int4 KV, sliding window, a ragged prefill; pools bit-exact;
  2. decode time with CUDA events (median), achieved bandwidth = bytes the call must move
     (K/V read, int4 scales included, + q read + out written + block tables) / time, against the device-to-device
     copy bandwidth measured in the same run: goal >= 70% at batch 64 × context 4096 fp16;
  3. int8 KV vs fp16 at long context: goal >= 1.6× faster; int4 KV (5/16 of fp16's bytes) the same goal.

GPT-OSS-20B attention (64 query heads over 8 KV heads, head_dim 64, window 128, learned attention
sinks) is in the correctness cases too: split-K decode (sinks in the reduce kernel), unsplit
decode with int8 KV, the AOT kernel and a prefill, all windowed.

The attention_scores pass (importance eviction, launch.attention_scores_triton) is checked too:
`scores` (its correctness against reference.attention_scores after a prefill: fp16, bf16 + int8 +
window, int4, soft-cap, GPT-OSS sinks) and `scores_cost` (a prompt step with and without scoring its
last 32 tokens).

Writes <out>/gpu_check.json and prints a summary. `--tiny` runs the same logic at toy sizes
on CPU under TRITON_INTERPRET=1 (tests/plugins/test_gpu_check_dry_run.py). The command line,
the correctness loop, timing and copy bandwidth are plugins/common/gpu_check.py's.
"""

from __future__ import annotations

import sys
import time

from ..common.gpu_check import check_cases, cli, copy_bandwidth, correctness_lines, median_seconds, ragged, report_header

LLAMA = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
TINY = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
TINY_INT4 = dict(TINY, head_dim=32)  # int4 KV groups 32 channels
GPT_OSS = dict(num_heads=64, num_kv_heads=8, head_dim=64, block_size=16)  # gpt-oss-20b / 120b attention
QWEN35 = dict(num_heads=8, num_kv_heads=2, head_dim=256, block_size=16)  # Qwen3.5-0.8B / Gemma-style wide heads


def _clone(inputs: dict) -> dict:
    return {k: (v.clone() if v is not None else None) for k, v in inputs.items()}


def _case(shape: dict, batch: int, ctx: int, q_len: int, device: str, **kw):
    from .reference import make_case

    if kw.pop("sinks", False):  # learned attention sinks (GPT-OSS): one logit per query head, ~N(0, 2²)
        import torch

        gen = torch.Generator().manual_seed(7)
        kw["attention_sinks"] = (torch.randn(shape["num_heads"], generator=gen) * 2).tolist()
    return make_case(**shape, **ragged(shape["block_size"], batch, ctx, q_len), device=device, **kw)


def check_correctness(shape: dict, device: str, cases: list[dict]) -> list[dict]:
    import torch

    from .launch import paged_attention_triton
    from .reference import paged_attention
    from .spec import TOLERANCE

    def compare(c: dict) -> tuple[float, float, bool]:
        splits, case_shape = c.pop("num_splits", None), c.pop("shape", shape)
        # aot: run decode inputs through prefill_kernel, the one kernel TensorRT engines launch
        # (a max_q_len above the real one only selects it; its grid does not depend on it)
        force = dict(max_q_len=2) if c.pop("aot", False) else {}
        inputs, attrs = _case(case_shape, device=device, **c)
        ref_in = _clone(inputs)
        out = paged_attention_triton(**inputs, attrs=attrs, num_splits=splits, **force)
        ref = paged_attention(**ref_in, attrs=attrs)
        err = (out.double() - ref.double()).abs().max().item()
        pools = torch.equal(inputs["key_cache"], ref_in["key_cache"]) and \
            torch.equal(inputs["value_cache"], ref_in["value_cache"])
        return err, TOLERANCE[c.get("act_dtype", "float32")], pools

    return check_cases(device, cases, compare)


def check_scores(shape: dict, device: str, cases: list[dict]) -> list[dict]:
    """Each case: a step through the attention kernels, then the scores kernel over each sequence's
    last `obs` tokens, against reference.attention_scores (float64) on the pools the kernels wrote.
    Tolerance: spec.SCORE_TOLERANCE per summed probability row (observation tokens × group heads).
    "pools_bit_exact" here: every observed row's probabilities sum to 1 per query head (no sinks)."""
    import torch

    from .launch import attention_scores_triton, paged_attention_triton
    from .reference import attention_scores
    from .spec import SCORE_TOLERANCE

    def compare(c: dict) -> tuple[float, float, bool]:
        obs, case_shape = c.pop("obs"), c.pop("shape", shape)
        inputs, attrs = _case(case_shape, device=device, **c)
        paged_attention_triton(**inputs, attrs=attrs)
        q_lens = (inputs["query_start_loc"][1:] - inputs["query_start_loc"][:-1]).cpu()
        o = torch.tensor([obs] * len(q_lens), dtype=torch.int64, device=inputs["query"].device)
        args = (inputs["query"], inputs["key_cache"], inputs["block_tables"], inputs["seq_lens"],
                inputs["query_start_loc"], o, inputs["k_scale"])
        got = attention_scores_triton(*args, attrs=attrs)
        want = attention_scores(*args, attrs=attrs)
        rows = int(torch.clamp(q_lens, max=obs).max()) * attrs.group_size
        mass = torch.clamp(q_lens, max=obs).double() * attrs.group_size  # [S]
        sums = attrs.attention_sinks or torch.allclose(got.double().sum(-1).cpu(), mass[:, None].expand(
            -1, attrs.num_kv_heads), rtol=1e-3)
        return (got.double() - want).abs().max().item(), SCORE_TOLERANCE * max(1, rows), bool(sums)

    return check_cases(device, cases, compare)


def time_scores(shape: dict, device: str, batch: int, ctx: int, q_len: int, obs: int, warmup: int,
                iters: int) -> dict:
    """A prompt step (fp16) without and with scoring each sequence's last `obs` tokens (the
    attention launch, then the scores launch): what importance eviction adds to the step that
    completes a prompt. Other steps run the attention alone (the scores kernel is not launched)."""
    import torch

    from .launch import attention_scores_triton, paged_attention_triton

    inputs, attrs = _case(shape, batch, ctx, q_len, device, act_dtype="float16", kv_dtype="float16", seed=2)
    o = torch.full((batch,), obs, dtype=torch.int64, device=inputs["query"].device)
    mq, ms = q_len, int(inputs["seq_lens"].max())
    plain = lambda: paged_attention_triton(**inputs, attrs=attrs, max_q_len=mq, max_seq_len=ms)  # noqa: E731

    def scored():
        plain()
        attention_scores_triton(inputs["query"], inputs["key_cache"], inputs["block_tables"], inputs["seq_lens"],
                                inputs["query_start_loc"], o, attrs=attrs)

    t_plain = median_seconds(plain, device, warmup, iters)
    t_scored = median_seconds(scored, device, warmup, iters)
    return dict(batch=batch, context=ctx, q_len=q_len, observed=obs, plain_seconds=t_plain,
                scored_seconds=t_scored, ratio=t_scored / t_plain)


def decode_bytes(inputs: dict, attrs) -> int:
    """Bytes one decode call must move: every sequence's K and V (seq_len tokens × kv heads ×
    head_dim), q read, out written, block tables, the new K/V read and stored."""
    seq = int(inputs["seq_lens"].sum())
    row = inputs["key_cache"].shape[-1] * inputs["key_cache"].element_size()  # bytes per token and head (int4: + scales)
    act = inputs["query"].element_size()
    t = inputs["query"].shape[0]
    kv = 2 * seq * attrs.num_kv_heads * row
    qo = 2 * t * attrs.num_heads * attrs.head_dim * act
    new = 2 * t * attrs.num_kv_heads * (attrs.head_dim * act + row)
    return kv + qo + new + inputs["block_tables"].numel() * 8


def time_decode(shape: dict, device: str, batch: int, ctx: int, kv_dtype: str, act: str, warmup: int, iters: int,
                splits_options=(None,), tiles=None, aot_tiles=None) -> dict:
    """Best time over the split / tile options (each one also reported), and of the AOT
    kernel (prefill_kernel, what TensorRT engines run) over its tiles."""
    from . import configs
    from .launch import paged_attention_triton, plan

    inputs, attrs = _case(shape, batch, ctx, 1, device, kv_dtype=kv_dtype, act_dtype=act, seed=1)
    max_len = int(inputs["seq_lens"].max())
    nbytes = decode_bytes(inputs, attrs)
    variants = []
    for tile in tiles or configs.DECODE_TILES:
        for splits in splits_options:
            p = plan(attrs, batch, 1, max_len, inputs["query"].device, num_splits=splits, tile=tile)
            fn = lambda: paged_attention_triton(**inputs, attrs=attrs, max_q_len=1, max_seq_len=max_len,  # noqa: E731
                                                num_splits=p.num_splits, tile=tile)
            try:
                t = median_seconds(fn, device, warmup, iters)
                variants.append(dict(tile=str(tile), num_splits=p.num_splits, seconds=t, bytes_per_s=nbytes / t))
            except Exception as e:
                variants.append(dict(tile=str(tile), num_splits=p.num_splits, error=f"{type(e).__name__}: {e}"))
    timed = [v for v in variants if "seconds" in v]
    best = min(timed, key=lambda v: v["seconds"]) if timed else None
    # the AOT path: TensorRT engines run every step (decode too) through prefill_kernel
    aot = []
    for tile in aot_tiles if aot_tiles is not None else configs.PREFILL_TILES:
        fn = lambda: paged_attention_triton(**inputs, attrs=attrs, max_q_len=2, max_seq_len=max_len,  # noqa: E731
                                            tile=tile)
        try:
            t = median_seconds(fn, device, warmup, iters)
            aot.append(dict(tile=str(tile), seconds=t, bytes_per_s=nbytes / t))
        except Exception as e:
            aot.append(dict(tile=str(tile), error=f"{type(e).__name__}: {e}"))
    aot_timed = [v for v in aot if "seconds" in v]
    return dict(batch=batch, context=ctx, kv_dtype=kv_dtype, act_dtype=act, bytes=nbytes, best=best,
                variants=variants, aot_best=min(aot_timed, key=lambda v: v["seconds"]) if aot_timed else None,
                aot_variants=aot)


def run(tiny: bool) -> dict:
    device = "cpu" if tiny else "cuda"
    shape = TINY if tiny else LLAMA
    report = dict(report_header(tiny), shape=shape)
    t0 = time.perf_counter()
    int4_shape = TINY_INT4 if tiny else LLAMA
    if tiny:
        ctx_long, big_batch, ctxs, warm, iters, copy_mb = 40, 4, (36, 40), 1, 2, 8
    else:
        ctx_long, big_batch, ctxs, warm, iters, copy_mb = 8192, 64, (4096, 8192), 5, 30, 1024
    cases = [
        dict(name="decode b1 ctx8k fp16 split-auto", batch=1, ctx=ctxs[1], q_len=1, act_dtype="float16",
             kv_dtype="float16"),
        dict(name="decode b1 ctx8k fp16 no-split", batch=1, ctx=ctxs[1], q_len=1, act_dtype="float16",
             kv_dtype="float16", num_splits=1),
        dict(name=f"decode b{big_batch} ctx4k fp16", batch=big_batch, ctx=ctxs[0], q_len=1, act_dtype="float16",
             kv_dtype="float16"),
        dict(name="decode b8 ctx4k bf16 split-4", batch=8, ctx=ctxs[0], q_len=1, act_dtype="bfloat16",
             kv_dtype="bfloat16", num_splits=4),
        dict(name="decode b16 ctx8k int8 (fp16 act)", batch=16, ctx=ctxs[1], q_len=1, act_dtype="float16",
             kv_dtype="int8"),
        dict(name="decode b4 ctx8k fp16 window 4096", batch=4, ctx=ctxs[1], q_len=1, act_dtype="float16",
             kv_dtype="float16", sliding_window=ctxs[0]),
        dict(name=f"decode b{big_batch} ctx4k fp16 via prefill_kernel (AOT path)", batch=big_batch, ctx=ctxs[0],
             q_len=1, act_dtype="float16", kv_dtype="float16", aot=True),
        dict(name="decode b16 ctx8k int8 via prefill_kernel (AOT path)", batch=16, ctx=ctxs[1], q_len=1,
             act_dtype="float16", kv_dtype="int8", aot=True),
        dict(name="prefill b4 q512 over ctx1k fp16", batch=4, ctx=ctxs[0] // 4 + 512 if not tiny else 20,
             q_len=512 if not tiny else 7, act_dtype="float16", kv_dtype="float16"),
        dict(name="prefill b2 q300 int8 bf16 window 256", batch=2, ctx=800 if not tiny else 20,
             q_len=300 if not tiny else 7, act_dtype="bfloat16", kv_dtype="int8",
             sliding_window=256 if not tiny else 5),
        dict(name="decode b16 ctx8k int4 (fp16 act)", batch=16, ctx=ctxs[1], q_len=1, act_dtype="float16",
             kv_dtype="int4", shape=int4_shape),
        dict(name="decode b16 ctx8k int4 via prefill_kernel (AOT path)", batch=16, ctx=ctxs[1], q_len=1,
             act_dtype="float16", kv_dtype="int4", aot=True, shape=int4_shape),
        dict(name="prefill b2 q300 int4 bf16", batch=2, ctx=800 if not tiny else 20,
             q_len=300 if not tiny else 7, act_dtype="bfloat16", kv_dtype="int4", shape=int4_shape),
    ]
    oss, oss_window = (TINY, 5) if tiny else (GPT_OSS, 128)
    sinks = dict(shape=oss, sinks=True, sliding_window=oss_window)
    cases += [  # GPT-OSS: attention sinks (+ its window)
        dict(name="gpt-oss decode b16 ctx4k fp16 sinks split-4 window", batch=16, ctx=ctxs[0], q_len=1,
             act_dtype="float16", kv_dtype="float16", num_splits=4, **sinks),
        dict(name="gpt-oss decode b16 ctx4k int8 sinks no-split window", batch=16, ctx=ctxs[0], q_len=1,
             act_dtype="float16", kv_dtype="int8", num_splits=1, **sinks),
        dict(name="gpt-oss decode b16 ctx4k bf16 sinks via prefill_kernel (AOT path)", batch=16, ctx=ctxs[0],
             q_len=1, act_dtype="bfloat16", kv_dtype="bfloat16", aot=True, **sinks),
        dict(name="gpt-oss prefill b2 q300 fp16 sinks window", batch=2, ctx=800 if not tiny else 20,
             q_len=300 if not tiny else 7, act_dtype="float16", kv_dtype="float16", **sinks),
    ]
    wide = TINY_INT4 if tiny else QWEN35
    cases += [  # head_dim 256 (Qwen3.5 / Qwen3-Next attention layers, Gemma 2/3): the hybrids' default plugin form
        dict(name="qwen3.5 decode b8 ctx8k bf16 head_dim 256", batch=8, ctx=ctxs[1], q_len=1, act_dtype="bfloat16",
             kv_dtype="bfloat16", shape=wide),
        dict(name="qwen3.5 prefill b2 q300 fp16 head_dim 256", batch=2, ctx=800 if not tiny else 20,
             q_len=300 if not tiny else 7, act_dtype="float16", kv_dtype="float16", shape=wide),
    ]
    report["correctness"] = check_correctness(shape, device, cases)
    # the attention_scores pass (importance eviction): prompts whose last `obs` tokens observe
    pq, pctx, obs = (7, 20, 4) if tiny else (512, 1536, 32)
    score_cases = [
        dict(name=f"scores prefill b4 q{pq} fp16 obs{obs}", batch=4, ctx=pctx, q_len=pq, act_dtype="float16",
             kv_dtype="float16", obs=obs),
        dict(name=f"scores prefill b2 q{pq} bf16 int8 window obs{obs}", batch=2, ctx=pctx, q_len=pq,
             act_dtype="bfloat16", kv_dtype="int8", sliding_window=5 if tiny else 256, obs=obs),
        dict(name=f"scores prefill b2 q{pq} fp16 int4 obs{obs}", batch=2, ctx=pctx, q_len=pq, act_dtype="float16",
             kv_dtype="int4", shape=int4_shape, obs=obs),
        dict(name=f"scores prefill b2 q{pq} fp16 softcap 50 obs{obs}", batch=2, ctx=pctx, q_len=pq,
             act_dtype="float16", kv_dtype="float16", logit_softcap=50.0, obs=obs),
        dict(name=f"gpt-oss scores prefill b2 q{pq} fp16 sinks window obs{obs}", batch=2, ctx=pctx, q_len=pq,
             act_dtype="float16", kv_dtype="float16", obs=obs, **sinks),
    ]
    report["scores"] = check_scores(shape, device, score_cases)
    report["seconds_correctness"] = round(time.perf_counter() - t0, 1)
    bw = copy_bandwidth(device, copy_mb << 20, warm, iters)
    report["copy_bytes_per_s"] = bw
    from . import configs

    splits = (1, None, 2, 4) if not tiny else (1, 2)
    tiles = (configs.INTERPRET_TILE,) if tiny else None
    aot_tiles = (configs.INTERPRET_TILE,) if tiny else None
    fp16 = time_decode(shape, device, big_batch, ctxs[0], "float16", "float16", warm, iters, splits, tiles, aot_tiles)
    report["decode_b64_ctx4k_fp16"] = fp16
    frac = fp16["best"]["bytes_per_s"] / bw if fp16["best"] else 0.0
    report["bandwidth_fraction"] = frac
    report["bandwidth_fraction_aot_kernel"] = fp16["aot_best"]["bytes_per_s"] / bw if fp16["aot_best"] else 0.0
    long_fp16 = time_decode(shape, device, 16, ctx_long, "float16", "float16", warm, iters, splits, tiles, aot_tiles)
    long_int8 = time_decode(shape, device, 16, ctx_long, "int8", "float16", warm, iters, splits, tiles, aot_tiles)
    report["decode_b16_long_fp16"], report["decode_b16_long_int8"] = long_fp16, long_int8
    speedup = (long_fp16["best"]["seconds"] / long_int8["best"]["seconds"]
               if long_fp16["best"] and long_int8["best"] else 0.0)
    report["int8_speedup"] = speedup
    long_int4 = time_decode(int4_shape, device, 16, ctx_long, "int4", "float16", warm, iters, splits, tiles,
                            aot_tiles)
    long_fp16_4 = long_fp16 if int4_shape is shape else time_decode(
        int4_shape, device, 16, ctx_long, "float16", "float16", warm, iters, splits, tiles, aot_tiles)
    report["decode_b16_long_int4"] = long_int4
    speedup4 = (long_fp16_4["best"]["seconds"] / long_int4["best"]["seconds"]
                if long_fp16_4["best"] and long_int4["best"] else 0.0)
    report["int4_speedup"] = speedup4
    report["scores_cost"] = time_scores(shape, device, 2 if tiny else 4, pctx, pq, obs, 0 if tiny else warm,
                                        1 if tiny else iters)
    report["goals"] = dict(correctness=all(c["ok"] for c in report["correctness"] + report["scores"]),
                           bandwidth_70pct=frac >= 0.70, int8_1p6x=speedup >= 1.6, int4_1p6x=speedup4 >= 1.6)
    report["seconds_total"] = round(time.perf_counter() - t0, 1)
    return report


def summary(r: dict) -> str:
    lines = correctness_lines(r, "PagedAttention")
    lines.append(f"  copy bandwidth {r['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    for key in ("decode_b64_ctx4k_fp16", "decode_b16_long_fp16", "decode_b16_long_int8", "decode_b16_long_int4"):
        d = r[key]
        b = d["best"]
        if b:
            lines.append(f"  {key}: {b['seconds'] * 1e6:.0f} us, {b['bytes_per_s'] / 1e9:.0f} GB/s "
                         f"(tile {b['tile']}, splits {b['num_splits']})")
        else:
            lines.append(f"  {key}: no timing ({[v.get('error') for v in d['variants']][:2]})")
        a = d.get("aot_best")
        lines.append(f"    AOT prefill_kernel (TensorRT's): {a['seconds'] * 1e6:.0f} us, {a['bytes_per_s'] / 1e9:.0f} GB/s "
                     f"(tile {a['tile']})" if a else f"    AOT prefill_kernel: no timing "
                     f"({[v.get('error') for v in d.get('aot_variants', [])][:2]})")
    lines += [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: " + (
        f"max err {c['max_err']:.2e} (tol {c['tolerance']:.1e}), rows sum to 1 {c['pools_bit_exact']}"
        if "max_err" in c else c.get("error", "")) for c in r["scores"]]
    sc = r["scores_cost"]
    lines.append(f"  scoring step: {sc['plain_seconds'] * 1e6:.0f} us plain, {sc['scored_seconds'] * 1e6:.0f} us with "
                 f"scores of the last {sc['observed']} tokens ({sc['ratio']:.2f}x; b{sc['batch']} q{sc['q_len']})")
    lines.append(f"  bandwidth fraction {r['bandwidth_fraction']:.2f} (AOT kernel "
                 f"{r['bandwidth_fraction_aot_kernel']:.2f}; goal >= 0.70); int8 speedup "
                 f"{r['int8_speedup']:.2f}x, int4 speedup {r['int4_speedup']:.2f}x (goals >= 1.6); goals "
                 f"{r['goals']}; {r['seconds_total']} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    return cli(argv, __doc__.splitlines()[0], "gpu_check.json", run, summary)


if __name__ == "__main__":
    sys.exit(main())
