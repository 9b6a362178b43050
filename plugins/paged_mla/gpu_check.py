"""GPU check of the PagedMLA Triton kernels (run by scripts/gpu_check.sh on a lent GPU, after the
PagedAttention check):

  1. correctness at DeepSeek-V3 shapes (kv_lora_rank 512, qk_rope_head_dim 64, blocks of 16; 128
     query heads = one GPU holding every head, and 16 = tensor parallel 8) against the float64
     torch reference on the GPU: decode batch 1-32, contexts up to 8k, split-K on/off, fp16 /
     bf16, int8 latent, the AOT kernel (what TensorRT engines launch), a ragged prefill; pools
     bit-exact;
  2. decode time with CUDA events (median) and achieved bandwidth = bytes the call must move
     (the sequences' rows + query read + output written + block tables) / time, against the
     device-to-device copy bandwidth of the same run (reported; no goal is set for MLA: decode
     with 128 heads per row is compute-bound on the scores, FlashMLA's regime);
  3. int8 latent vs fp16 at long context (reported);
  4. the attention_scores pass (importance eviction, launch.attention_scores_triton): `scores`, its
     correctness against reference.attention_scores after a prompt step (fp16 all heads, bf16 int8
     tensor-parallel heads), and `scores_cost`, a prompt step with and without scoring its last 32 tokens.

Writes <out>/gpu_check_mla.json and prints a summary. `--tiny` runs the same logic at toy sizes on
CPU under TRITON_INTERPRET=1 (tests/plugins/test_gpu_check_dry_run.py, through gpu_check.sh). The
command line, the correctness loop, timing and copy bandwidth are plugins/common/gpu_check.py's.
"""

from __future__ import annotations

import sys
import time

from ..common.gpu_check import check_cases, cli, copy_bandwidth, correctness_lines, median_seconds, ragged, report_header

V3 = dict(num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, block_size=16, scale=192 ** -0.5)
V3_TP8 = dict(V3, num_heads=16)
TINY = dict(num_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, block_size=4)
TINY_TP = dict(TINY, num_heads=20)  # more heads than one program's rows: head chunks


def _case(shape: dict, batch: int, ctx: int, q_len: int, device: str, **kw):
    from .reference import make_case

    return make_case(**shape, **ragged(shape["block_size"], batch, ctx, q_len), device=device, **kw)


def check_correctness(device: str, cases: list[dict]) -> list[dict]:
    import torch

    from .launch import paged_mla_triton
    from .reference import paged_mla
    from .spec import TOLERANCE

    def compare(c: dict) -> tuple[float, float, bool]:
        splits, shape = c.pop("num_splits", None), c.pop("shape")
        # aot: decode inputs through mla_kernel without split-K, the one kernel TensorRT engines launch
        if c.pop("aot", False):
            splits = 1
        inputs, attrs = _case(shape, device=device, **c)
        ref_in = {k: v.clone() for k, v in inputs.items()}
        out = paged_mla_triton(**inputs, attrs=attrs, num_splits=splits)
        ref = paged_mla(**ref_in, attrs=attrs)
        err = (out.double() - ref.double()).abs().max().item()
        mag = ref.double().abs().max().item()
        tol = TOLERANCE[c.get("act_dtype", "float32")] * max(1.0, mag)  # the output's scale
        return err, tol, torch.equal(inputs["latent_cache"], ref_in["latent_cache"])

    return check_cases(device, cases, compare)


def check_scores(device: str, cases: list[dict]) -> list[dict]:
    """Each case: a step through the attention kernels, then the scores kernel over each sequence's
    last `obs` tokens, against reference.attention_scores (float64) on the pool the kernels wrote.
    Tolerance: spec.SCORE_TOLERANCE per summed probability row (observation tokens × heads).
    "pools_bit_exact" here: each observed row's probabilities sum to 1 per head."""
    import torch

    from .launch import attention_scores_triton, paged_mla_triton
    from .reference import attention_scores
    from .spec import SCORE_TOLERANCE

    def compare(c: dict) -> tuple[float, float, bool]:
        obs, shape = c.pop("obs"), c.pop("shape")
        inputs, attrs = _case(shape, device=device, **c)
        paged_mla_triton(**inputs, attrs=attrs)
        q_lens = (inputs["query_start_loc"][1:] - inputs["query_start_loc"][:-1]).cpu()
        o = torch.full_like(q_lens, obs).to(inputs["query"].device)
        args = (inputs["query"], inputs["latent_cache"], inputs["block_tables"], inputs["seq_lens"],
                inputs["query_start_loc"], o, inputs["kv_scale"])
        got, want = attention_scores_triton(*args, attrs=attrs), attention_scores(*args, attrs=attrs)
        mass = torch.clamp(q_lens, max=obs).double() * attrs.num_heads  # [S]
        sums = torch.allclose(got.double().sum((1, 2)).cpu(), mass, rtol=1e-3)
        return (got.double() - want).abs().max().item(), SCORE_TOLERANCE * float(mass.max()), bool(sums)

    return check_cases(device, cases, compare)


def time_scores(shape: dict, device: str, batch: int, ctx: int, q_len: int, obs: int, warmup: int,
                iters: int) -> dict:
    """A prompt step (fp16) without and with scoring each sequence's last `obs` tokens: what importance
    eviction adds to the step that completes a prompt (other steps do not launch the scores kernel)."""
    import torch

    from .launch import attention_scores_triton, paged_mla_triton

    inputs, attrs = _case(shape, batch, ctx, q_len, device, act_dtype="float16", kv_dtype="float16", seed=2)
    o = torch.full((batch,), obs, dtype=torch.int64, device=inputs["query"].device)
    mq, ms = q_len, int(inputs["seq_lens"].max())
    plain = lambda: paged_mla_triton(**inputs, attrs=attrs, max_q_len=mq, max_seq_len=ms)  # noqa: E731

    def scored():
        plain()
        attention_scores_triton(inputs["query"], inputs["latent_cache"], inputs["block_tables"], inputs["seq_lens"],
                                inputs["query_start_loc"], o, attrs=attrs)

    t_plain = median_seconds(plain, device, warmup, iters)
    t_scored = median_seconds(scored, device, warmup, iters)
    return dict(batch=batch, context=ctx, q_len=q_len, observed=obs, plain_seconds=t_plain,
                scored_seconds=t_scored, ratio=t_scored / t_plain)


def decode_bytes(inputs: dict, attrs) -> int:
    """Bytes one decode call must move: every sequence's rows, q read, out written, the new rows
    read and stored, block tables."""
    cache = inputs["latent_cache"]
    row = cache.shape[-1] * cache.element_size()
    act = inputs["query"].element_size()
    t = inputs["query"].shape[0]
    rows = int(inputs["seq_lens"].sum()) * row
    qo = t * attrs.num_heads * (attrs.row_width + attrs.kv_lora_rank) * act
    return rows + qo + t * (attrs.row_width * act + row) + inputs["block_tables"].numel() * 8


def time_decode(shape: dict, device: str, batch: int, ctx: int, kv_dtype: str, act: str, warmup: int, iters: int,
                splits_options, tiles) -> dict:
    """Best time over the split / tile options (each one reported); splits 1 is the AOT kernel."""
    from .launch import paged_mla_triton, plan

    inputs, attrs = _case(shape, batch, ctx, 1, device, kv_dtype=kv_dtype, act_dtype=act, seed=1)
    max_len = int(inputs["seq_lens"].max())
    nbytes = decode_bytes(inputs, attrs)
    variants = []
    for tile in tiles:
        for splits in splits_options:
            p = plan(attrs, batch, batch, 1, max_len, inputs["query"].device, num_splits=splits, tile=tile)
            fn = lambda: paged_mla_triton(**inputs, attrs=attrs, max_q_len=1, max_seq_len=max_len,  # noqa: E731
                                          num_splits=p.num_splits, tile=tile)
            try:
                t = median_seconds(fn, device, warmup, iters)
                variants.append(dict(tile=str(tile), num_splits=p.num_splits, seconds=t, bytes_per_s=nbytes / t))
            except Exception as e:
                variants.append(dict(tile=str(tile), num_splits=p.num_splits, error=f"{type(e).__name__}: {e}"))
    timed = [v for v in variants if "seconds" in v]
    aot = [v for v in timed if v["num_splits"] == 1]
    return dict(batch=batch, context=ctx, kv_dtype=kv_dtype, act_dtype=act, bytes=nbytes,
                best=min(timed, key=lambda v: v["seconds"]) if timed else None,
                aot_best=min(aot, key=lambda v: v["seconds"]) if aot else None, variants=variants)


def run(tiny: bool) -> dict:
    from . import configs

    device = "cpu" if tiny else "cuda"
    report = report_header(tiny)
    big, tp = (TINY, TINY_TP) if tiny else (V3, V3_TP8)
    report["shapes"] = dict(all_heads=big, tp8=tp)
    if tiny:
        ctx_long, ctxs, warm, iters, copy_mb, batch = 40, (20, 40), 0, 1, 8, 2
    else:
        ctx_long, ctxs, warm, iters, copy_mb, batch = 8192, (4096, 8192), 3, 20, 1024, 32
    t0 = time.perf_counter()
    f16 = dict(act_dtype="float16", kv_dtype="float16")
    cases = [
        dict(name="decode b1 ctx8k fp16 split-auto", shape=big, batch=1, ctx=ctxs[1], q_len=1, **f16),
        dict(name="decode b1 ctx8k fp16 via mla_kernel (AOT path)", shape=big, batch=1, ctx=ctxs[1], q_len=1,
             aot=True, **f16),
        dict(name=f"decode b{batch} ctx4k fp16", shape=big, batch=batch, ctx=ctxs[0], q_len=1, **f16),
        dict(name="decode b8 ctx4k bf16 split-4", shape=big, batch=8, ctx=ctxs[0], q_len=1, act_dtype="bfloat16",
             kv_dtype="bfloat16", num_splits=4),
        dict(name="decode b16 ctx8k int8 (fp16 act, realistic rows)", shape=big, batch=16, ctx=ctxs[1], q_len=1,
             act_dtype="float16", kv_dtype="int8", realistic=True),
        dict(name="decode b16 ctx8k int8 via mla_kernel (AOT path)", shape=big, batch=16, ctx=ctxs[1], q_len=1,
             act_dtype="float16", kv_dtype="int8", aot=True, realistic=True),
        dict(name="tp8 decode b32 ctx4k fp16", shape=tp, batch=batch, ctx=ctxs[0], q_len=1, **f16),
        dict(name="tp8 decode b32 ctx4k bf16 int8 AOT path", shape=tp, batch=batch, ctx=ctxs[0], q_len=1,
             act_dtype="bfloat16", kv_dtype="int8", aot=True),
        dict(name="prefill b2 q256 over ctx1k fp16", shape=big, batch=2, ctx=1024 + 256 if not tiny else 20,
             q_len=256 if not tiny else 7, **f16),
        dict(name="tp8 prefill b4 q300 bf16 int8", shape=tp, batch=4, ctx=800 if not tiny else 20,
             q_len=300 if not tiny else 7, act_dtype="bfloat16", kv_dtype="int8"),
    ]
    if tiny:  # the same cases at interpreter speed: at most 2 sequences each
        cases = [dict(c, batch=min(c["batch"], 2)) for c in cases]
    report["correctness"] = check_correctness(device, cases)
    pq, pctx, obs = (7, 20, 4) if tiny else (256, 1024 + 256, 32)
    report["scores"] = check_scores(device, [
        dict(name=f"scores prefill b2 q{pq} fp16 obs{obs}", shape=big, batch=2, ctx=pctx, q_len=pq, obs=obs, **f16),
        dict(name=f"tp8 scores prefill b2 q{pq} bf16 int8 obs{obs}", shape=tp, batch=2, ctx=pctx, q_len=pq, obs=obs,
             act_dtype="bfloat16", kv_dtype="int8", realistic=True)])
    report["seconds_correctness"] = round(time.perf_counter() - t0, 1)
    bw = copy_bandwidth(device, copy_mb << 20, warm, iters)
    report["copy_bytes_per_s"] = bw
    tiles = (configs.INTERPRET_TILE,) if tiny else configs.TILES
    splits = (1, 2) if tiny else (1, None, 4)
    long_batch = 2 if tiny else 16
    timing = (warm, iters, splits, tiles)
    report["decode_long_fp16"] = time_decode(big, device, long_batch, ctx_long, "float16", "float16", *timing)
    report["decode_long_int8"] = time_decode(big, device, long_batch, ctx_long, "int8", "float16", *timing)
    report["decode_tp8_fp16"] = time_decode(tp, device, batch, ctxs[0], "float16", "float16", warm, iters, splits,
                                            tiles)
    a, b = report["decode_long_fp16"]["best"], report["decode_long_int8"]["best"]
    report["int8_speedup"] = a["seconds"] / b["seconds"] if a and b else 0.0
    best = report["decode_long_fp16"]["best"]
    report["bandwidth_fraction"] = best["bytes_per_s"] / bw if best else 0.0
    report["scores_cost"] = time_scores(big, device, 2, pctx, pq, obs, warm, max(1, iters // 2))
    report["goals"] = dict(correctness=all(c["ok"] for c in report["correctness"] + report["scores"]))
    report["seconds_total"] = round(time.perf_counter() - t0, 1)
    return report


def summary(r: dict) -> str:
    lines = correctness_lines(r, "PagedMLA")
    lines.append(f"  copy bandwidth {r['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    for key in ("decode_long_fp16", "decode_long_int8", "decode_tp8_fp16"):
        d = r[key]
        for label, v in (("best", d["best"]), ("AOT mla_kernel (TensorRT's)", d["aot_best"])):
            lines.append(f"  {key} {label}: {v['seconds'] * 1e6:.0f} us, {v['bytes_per_s'] / 1e9:.0f} GB/s "
                         f"(tile {v['tile']}, splits {v['num_splits']})" if v else
                         f"  {key} {label}: no timing ({[x.get('error') for x in d['variants']][:2]})")
    lines += [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: " + (
        f"max err {c['max_err']:.2e} (tol {c['tolerance']:.1e}), rows sum to 1 {c['pools_bit_exact']}"
        if "max_err" in c else c.get("error", "")) for c in r["scores"]]
    sc = r["scores_cost"]
    lines.append(f"  scoring step: {sc['plain_seconds'] * 1e6:.0f} us plain, {sc['scored_seconds'] * 1e6:.0f} us with "
                 f"scores of the last {sc['observed']} tokens ({sc['ratio']:.2f}x; b{sc['batch']} q{sc['q_len']})")
    lines.append(f"  bandwidth fraction {r['bandwidth_fraction']:.2f}; int8 speedup {r['int8_speedup']:.2f}x; "
                 f"goals {r['goals']}; {r['seconds_total']} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    return cli(argv, __doc__.splitlines()[0], "gpu_check_mla.json", run, summary)


if __name__ == "__main__":
    sys.exit(main())
