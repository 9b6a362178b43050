"""Validation of exported graphs against transformers on the same weights.

The reference is transformers' own forward pass (float32, one prompt at a time, full
recompute each step: no cache code involved). The graphs run in onnxruntime (CPU) with
all prompts in one batch: prefill (the paged layout in two chunks, so cached-prefix
attention is exercised) then `steps` decode steps, fed the reference's greedy tokens
(teacher forcing) so every step's logits are comparable. Greedy tokens are identical
exactly when our argmax equals the reference's token at every step.

Paged graphs run through the runtime's own backend and model runner (the packing the
engine serves with). Plugin graphs run with the native CPU PagedAttention op when it is
built (what the runtime serves them with), and then on a cut-down check (the first
CROSS_CHECK_PROMPTS prompts, CROSS_CHECK_STEPS steps) with the float64 reference op
(plugins/paged_attention/ort.py), which pins the graph itself independent of the native op;
the build passes only if both do. Without the native op the reference op runs the full check.

    transformers (reference logits, greedy tokens)
        ├─ main check:  onnx attention | native op | reference op (no native op)   all prompts, all steps
        └─ cross-check: reference op (plugin graphs whose main check ran the native op)   cut down
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Callable

import numpy as np

from kvexport import io
from kvexport.manifest import OpCheck, ValidationEntry

# Max |Δ logits| accepted, per activation dtype (every family shares them).
# fp32: both sides compute in float32 with different summation orders and fused kernels;
# errors of ~1e-6 relative per op grow over the depth. Measured: smollm2-135m (30 layers, logits
# of magnitude ~20) 7e-5; the families' tiny random configs 1e-6..1e-4 — Gemma 4's up to 2e-4,
# where transformers' own float32 is as far from its float64 (attention scale 1 on random norm
# weights; tests/exporter/test_gemma4.py). 1e-3 leaves 5x over the worst of those and 14x over
# smollm2 (the bound was 5e-3 until issue 48: gaps of 1e-3..3e-3, ten times any rounding measured,
# passed). A wrong mask or rope shows up as >1e-1 (the tiny Gemma 4 with a sliding window one key
# too wide or too narrow: 1.5..3).
# fp16: matmuls round to 11-bit mantissas; logits move by ~1e-2..1e-1, and near-ties may
# flip a greedy token, so fp16 checks the tolerance but only reports token agreement.
# int8 KV: every cached key/value is rounded to 1/254 of its calibrated range (keys per RoPE
# channel pair, so outlier key channels, as in Qwen2, no longer coarsen the others; values per
# head: exporter/calibrate.py). The error is the quantization's, not a bug's: a few units of
# logit at most on logits of magnitude ~20-30 (smollm2-135m 2.2; Qwen2.5-Coder-0.5B 0.57 — 3.1
# with per-head scales, the failure that motivated per-channel keys). Near-ties flip greedy
# tokens and a flip changes every later step, so int8 checks a logit bound plus a minimum share
# of agreeing greedy tokens. A broken quantization (wrong axis, wrong scale) scrambles the
# logits (|Δ| of the logits' own magnitude) and the tokens. NOTE: an absolute bound, set at
# ~10% of the logits' magnitude on the models above; one relative to each model's logit range
# would carry over to models with larger logits.
# int8 / int4 weights (exporter/quantize.py; the bound covers int8 KV with them too): the graphs
# compute with rounded weights while transformers keeps the float ones, so they differ by the
# quantization itself, not by a bug; onnxruntime also rounds the activations to int8 inside
# MatMulNBits (accuracy level 4). Every matmul's error adds up over the depth, and int4 steps
# are 16x coarser than int8's. A wrong axis, block size or nibble order scrambles every logit
# (|Δ| of the logits' own magnitude, ~20-30 on smollm2, and near-zero agreement), so the bounds
# sit at a few units of logit plus a share of agreeing greedy tokens; identical tokens are not
# required (a near-tie flip changes every later step). Perplexity is the quality measure
# (bench/kv_quality.py): int8 moves it by <1%, int4 by a few %.
# int4 KV (dynamic, per token and KV head, groups of 32 channels, q4_0's 16 levels, q/k/v
# Hadamard-rotated: kvexport/io.py KV_INT4_FORMAT): every cached key/value is rounded to 1/16 of
# its group's extreme, ~8x coarser than int8 KV's 1/254 of a calibrated range, on every token and
# layer, so the logits move by a few units more than int8 KV's (the quantization's error, not a
# bug's): the bound is int4 weights' (the same 16-level rounding), still well under the logits' own
# magnitude (~20-30) that a wrong nibble order, group, scale sign or a missing rotation produces on
# every row. Near-ties flip more greedy tokens than with int8, hence a lower minimum share.
# Perplexity is the quality measure (docs/QUANTIZATION.md "int4 KV": +2.9% on smollm2-135m).
# Measured: `kvexport build smollm2-135m --kv-dtype int4`, native op, 4 prompts x 16 steps: max |Δ|
# 8.2 at 89.7% greedy agreement (the first bound, 6 = twice int8 KV's, was set before any real
# build and failed it; the reference op's 2 x 2 check: 3.6).
TOLERANCE = {"fp32": 1e-3, "fp16": 0.5, "int8_kv": 3.0, "int4_kv": 10.0, "int8_weights": 4.0, "int4_weights": 10.0}
REQUIRE_GREEDY = {"fp32": True, "fp16": False, "int8_kv": False, "int4_kv": False, "int8_weights": False,
                  "int4_weights": False}
MIN_AGREEMENT = {"fp32": 1.0, "fp16": 0.0, "int8_kv": 0.75, "int4_kv": 0.5, "int8_weights": 0.7, "int4_weights": 0.4}


# The reference op's cut-down check of plugin graphs that the native op validated: prefill in
# two chunks (cached-prefix attention) and decode steps through the decode graph, on a batch
# of two prompts of different lengths. The float64 op copies the pools on every call, so the
# full check with it took 70-190 s of a smollm2 build; this one takes ~10 s, and a graph
# wired wrongly (inputs, KV writes, block tables) is off by far more than any tolerance at once.
# It must meet the main check's bounds except the share of agreeing greedy tokens (int8 KV):
# over 2 prompts x 3 steps a single near-tie flip would be 17% of them.
CROSS_CHECK_PROMPTS = 2  # the first prompts of the main check's
CROSS_CHECK_STEPS = 2  # decode steps after the prefill

OP_NAMES = {"onnx": "onnx attention", "native": "native CPU op", "reference": "reference op"}  # VALIDATION_OPS
_KEY_NAMES = {"fp32": "fp32", "fp16": "fp16", "int8_kv": "int8 KV", "int4_kv": "int4 KV", "int8_weights": "int8 weights",
              "int4_weights": "int4 weights"}

Progress = Callable[[str], contextlib.AbstractContextManager]


def tolerance_key(manifest) -> str:
    precision = manifest.weights.precision
    if precision == "int4":  # the loosest bound; it covers int8 / int4 KV with these weights too
        return "int4_weights"
    if manifest.kv.dtype == "int4":  # looser than int8 weights' bound, so it covers them
        return "int4_kv"
    if precision == "int8":
        return "int8_weights"
    return "int8_kv" if manifest.kv.dtype == "int8" else manifest.dtype


def tolerance(manifest) -> float:
    """The |Δ logits| bound a build is validated against here: TOLERANCE of its key, doubled for
    quantized weights that the runtime serves as int8 x int8 (per-channel int8, or weight_matmul_
    accuracy "int8") on a CPU where those activations get 7 bits (u8 x s8 saturates there:
    runtime/execution/ort_quant.py ACT_QMAX), whose rounding is twice as coarse. The manifest
    records the bound used (validation.tolerance). Measured: smollm2 `--weights int8`
    (smoothquant) on an AVX2-only AMD EPYC, max |Δ| 6 at 94% greedy agreement (8-bit activations
    on a VNNI Xeon: within 4); a broken quantization is off by the logits' own magnitude (~20-30)."""
    t = TOLERANCE[tolerance_key(manifest)]
    q = manifest.weights.quantization
    if q is None or manifest.kv.layout != io.KVLayout.PAGED.value:  # contiguous: the stored graphs as they are
        return t
    from kvexport.runtime.execution.ort_quant import ACT_QMAX
    from kvexport.runtime.execution.session_plan import plan_sessions, resolve_accuracy

    plans = plan_sessions(q, manifest.dtype, resolve_accuracy(q, None))
    return 2 * t if ACT_QMAX < 127 and any(p.form in ("int8-dynamic", "int8") for p in plans) else t


def bound(key: str, cross_check: bool = False, tol: float | None = None) -> str:
    """What a check must meet, in words: "int8 KV bound: |Δ| ≤ 3, agreement ≥ 75%" (`tol`: the
    |Δ| bound, when not TOLERANCE[key]: `tolerance`)."""
    terms = [f"|Δ| ≤ {TOLERANCE[key] if tol is None else tol:g}"]
    if REQUIRE_GREEDY[key]:
        terms.append("greedy identical")
    elif MIN_AGREEMENT[key] > 0 and not cross_check:
        terms.append(f"agreement ≥ {MIN_AGREEMENT[key]:.0%}")
    return f"{_KEY_NAMES[key]} bound: {', '.join(terms)}"


def _verdict(op: str, prompts: int, steps: int, key: str, passed: bool, max_abs_diff: float,
             agreement: float, cross_check: bool = False, tol: float | None = None) -> str:
    return (f"validation ({OP_NAMES[op]}, {_count(prompts, 'prompt')}, {_count(steps, 'step')}): "
            f"{'PASS' if passed else 'FAIL'} "
            f"({bound(key, cross_check, tol)}): max |Δ| {max_abs_diff:.2g}, {100 * agreement:.1f}% greedy agreement")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def verdicts(manifest) -> list[str]:
    """One line per check of the manifest's validation (none when it was not validated), e.g.
    "validation (native CPU op, 4 prompts, 16 steps): PASS (fp32 bound: |Δ| ≤ 0.001, greedy
    identical): max |Δ| 6.5e-05, 100.0% greedy agreement"."""
    v = manifest.validation
    if v is None:
        return []
    key = tolerance_key(manifest)
    plugin = manifest.kv.attention == io.Attention.PLUGIN.value
    op = v.op or ("reference" if plugin else "onnx")  # builds before `op`: plugin graphs ran the reference op
    tol = v.tolerance  # the bound the build was validated against (`tolerance`)
    passed = _passes(v.max_abs_diff, v.greedy_identical, v.token_agreement, key, tol=tol)
    lines = [_verdict(op, v.prompts, v.steps, key, passed, v.max_abs_diff, v.token_agreement, tol=tol)]
    if (c := v.cross_check) is not None:
        lines.append(_verdict(c.op, c.prompts, c.steps, key, c.passed, c.max_abs_diff, c.token_agreement, True, tol))
    if (n := v.native_op) is not None:  # builds before `op`: the native op ran the full check too
        lines.append(_verdict("native", v.prompts, v.steps, key, n.passed, n.max_abs_diff, n.token_agreement,
                              tol=tol))
    return lines


DEFAULT_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "def fibonacci(n):",
    "Write a short poem about the sea and the wind, in the style of an old sailor's song:",
)


# What validate() returns is the manifest's `validation` entry itself (kvexport/manifest.py).
ValidationResult = ValidationEntry


def reference(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens [prompt][step] and logits [step] -> [num_prompts, vocab] from transformers, decoding as its
    generate() does: the prompt once, then one token per step over its own KV cache, the last position's logits
    only. NOTE: before, every step ran the whole sequence again without a cache (16 s of the default
    model's build validation here; now ~6 s)."""
    import inspect

    import torch

    accepts = inspect.signature(model.forward).parameters
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
    cache_arg = "cache" if "cache" in accepts else "past_key_values"  # NOTE: transformers 5.25 renames it
    tokens, logits = [], [[] for _ in range(steps + 1)]
    with torch.no_grad():
        for p in prompts:
            ids, past, out = list(p), None, []
            for step in range(steps + 1):
                o = model(torch.tensor([ids]), **{cache_arg: past}, use_cache=True, **last_only)
                row = o.logits[0, -1].float().numpy()
                past = o["cache"] if "cache" in o else o.past_key_values
                logits[step].append(row)
                nxt = int(row.argmax())
                out.append(nxt)
                ids = [nxt]
            tokens.append(out)
    return tokens, [np.stack(s) for s in logits]


def session(path: Path, threads: int | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


class ContiguousDriver:
    """Static batch, left padding, optimum-style past/present tensors."""

    def __init__(self, build_dir: Path, manifest):
        self.prefill = session(build_dir / manifest.graphs["prefill"].file)
        self.decode = session(build_dir / manifest.graphs["decode"].file)
        # past_key_values.{i}.* per present.{i}.* output, in order (layers sharing KV have none: io.py "Shared KV")
        self.past = [o.name.replace("present.", "past_key_values.", 1) for o in self.decode.get_outputs()[1:]]

    def run(self, prompts: list[list[int]], forced: list[list[int]], steps: int) -> list[np.ndarray]:
        n, longest = len(prompts), max(len(p) for p in prompts)
        ids = np.zeros((n, longest), np.int64)
        mask = np.zeros((n, longest), np.int64)
        for r, p in enumerate(prompts):
            ids[r, longest - len(p):] = p
            mask[r, longest - len(p):] = 1
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        outs = self.prefill.run(None, {io.INPUT_IDS: ids, io.ATTENTION_MASK: mask, io.POSITION_IDS: pos})
        logits = [outs[0][:, -1]]
        past = outs[1:]
        for step in range(steps):
            tok = np.array([[f[step]] for f in forced], np.int64)
            mask = np.concatenate([mask, np.ones((n, 1), np.int64)], axis=1)
            pos = pos[:, -1:] + 1
            feeds = {io.INPUT_IDS: tok, io.ATTENTION_MASK: mask, io.POSITION_IDS: pos}
            feeds.update(zip(self.past, past))
            outs = self.decode.run(None, feeds)
            logits.append(outs[0][:, -1])
            past = outs[1:]
        return logits


class PagedDriver:
    """The runtime's own backend and model runner (runtime/execution/ort_backends.py, model_runner.py)
    on a pool where each sequence holds consecutive blocks (block 0 is the pad block).
    Prompts are prefilled in two chunks, so the second attends to cached blocks.

    `kind` picks the onnxruntime backend: "auto" (as served), "onnx", "reference" (plugin
    graphs with the float64 reference op) or "native" (the native CPU op)."""

    def __init__(self, build_dir: Path, manifest, kind: str = "auto"):
        self.build_dir, self.manifest, self.kind = build_dir, manifest, kind

    def run(self, prompts: list[list[int]], forced: list[list[int]], steps: int) -> list[np.ndarray]:
        from kvexport.runtime.execution.model_runner import ModelRunner, chunk
        from kvexport.runtime.execution.ort_backends import ort_backend

        bs, n = self.manifest.kv.block_size, len(prompts)
        per_seq = math.ceil((max(len(p) for p in prompts) + steps) / bs)
        # both_graphs: decode steps run the decode graph (serving runs them through the prefill graph)
        backend = ort_backend(self.build_dir, self.manifest, 1 + n * per_seq, kind=self.kind, both_graphs=True,
                              providers=["CPUExecutionProvider"])  # the tolerances are CPU's
        runner = ModelRunner(backend, bs)
        tables = [[1 + s * per_seq + j for j in range(per_seq)] for s in range(n)]
        done = [0] * n  # tokens already in the pool

        def step(chunks: list[list[int]]) -> np.ndarray:
            logits = runner.logits([chunk(str(s), c, done[s], tables[s], bs) for s, c in enumerate(chunks)])
            for s, c in enumerate(chunks):
                done[s] += len(c)
            return logits

        if all(len(p) >= 2 for p in prompts):  # two chunks: the second attends to cached blocks
            step([p[:len(p) // 2] for p in prompts])
            logits = [step([p[len(p) // 2:] for p in prompts])]
        else:
            logits = [step([list(p) for p in prompts])]
        for t in range(steps):
            logits.append(step([[f[t]] for f in forced]))
        return logits


def prompt_ids(tokenizer, vocab_size: int, count: int = 4, seed: int = 0) -> list[list[int]]:
    """Token ids of the default prompts (different lengths), or seeded random ids when the
    model has no tokenizer (tiny test models)."""
    if tokenizer is not None:
        return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in DEFAULT_PROMPTS[:count]]
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in (5, 17, 9, 30)[:count]]


def fit_prompts(prompts: list[list[int]], max_len: int, steps: int) -> tuple[list[list[int]], int]:
    """The prompts and decode steps cut to a `max_len`-token context (a build may serve less
    than the default prompts need): each prompt keeps room for at least one step."""
    prompts = [p[:max_len - 1] for p in prompts]
    return prompts, max(1, min(steps, max_len - max(len(p) for p in prompts)))


def _passes(max_abs_diff: float, identical: bool, agreement: float, key: str, cross_check: bool = False,
            tol: float | None = None) -> bool:
    return (max_abs_diff <= (TOLERANCE[key] if tol is None else tol) and (identical or not REQUIRE_GREEDY[key])
            and (cross_check or agreement >= MIN_AGREEMENT[key]))


def _compare(ours: list[np.ndarray], ref_logits: list[np.ndarray], forced: list[list[int]],
             manifest, cross_check: bool = False) -> tuple[list[float], float, bool, float, bool]:
    """(max |Δ| per step, tolerance, greedy identical, token agreement, passed). `ours` may
    cover the first prompts and steps of the reference only (the cross-check)."""
    diffs, agree = [], 0
    n = len(ours[0])  # prompts run
    for step, (a, r) in enumerate(zip(ours, ref_logits)):
        diffs.append(float(np.abs(a.astype(np.float32) - r[:n]).max()))
        agree += sum(int(a[s].argmax() == forced[s][step]) for s in range(n))
    total = n * len(ours)
    key, tol = tolerance_key(manifest), tolerance(manifest)
    identical = agree == total
    return (diffs, tol, identical, agree / total, _passes(max(diffs), identical, agree / total, key, cross_check, tol))


@contextlib.contextmanager
def _no_progress(name: str):
    yield


def validate(build_dir: Path, manifest, model, prompts: list[list[int]], steps: int = 16,
             progress: Progress = _no_progress) -> ValidationResult:
    """Run the checks (module docstring) and return the manifest's validation entry; `progress`
    wraps each stage (a context manager per stage name, as build()'s)."""
    with progress(f"validation: transformers' reference ({_count(len(prompts), 'prompt')}, {_count(steps, 'step')})"):
        forced, ref_logits = reference(model, prompts, steps)
    paged = manifest.kv.layout == io.KVLayout.PAGED.value
    op, cross = "onnx", None
    if paged and manifest.kv.attention == io.Attention.PLUGIN.value:
        from kvexport.runtime.execution.ort_backends import native_library_for as library_for  # MLA: PagedMLA's

        lib, _ = library_for(manifest)
        op, cross = ("native", "reference") if lib is not None else ("reference", None)
    with progress(f"validation: graphs with the {OP_NAMES[op]}"):
        driver = PagedDriver(build_dir, manifest, op) if paged else ContiguousDriver(build_dir, manifest)
        diffs, tol, identical, agreement, passed = _compare(driver.run(prompts, forced, steps), ref_logits, forced,
                                                            manifest)
    check = None
    if cross is not None:
        k, k_steps = min(CROSS_CHECK_PROMPTS, len(prompts)), min(CROSS_CHECK_STEPS, steps)
        with progress(f"validation: graphs with the {OP_NAMES[cross]} ({_count(k, 'prompt')}, "
                      f"{_count(k_steps, 'step')})"):
            c_diffs, _, c_identical, c_agreement, c_passed = _compare(
                PagedDriver(build_dir, manifest, cross).run(prompts[:k], forced[:k], k_steps), ref_logits, forced,
                manifest, cross_check=True)
        check = OpCheck(cross, k, k_steps, max(c_diffs), c_identical, c_agreement, c_passed)
        passed = passed and c_passed
    return ValidationResult(len(prompts), tuple(len(p) for p in prompts), steps, tuple(diffs), max(diffs), tol,
                            identical, agreement, passed, op, check)
