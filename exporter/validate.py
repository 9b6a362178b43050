"""Validation of exported graphs against transformers on the same weights.

The reference is transformers' own forward pass (float32, one prompt at a time, full
recompute each step: no cache code involved). The graphs run in onnxruntime (CPU) with
all prompts in one batch: prefill (the paged layout in two chunks, so cached-prefix
attention is exercised) then `steps` decode steps, fed the reference's greedy tokens
(teacher forcing) so every step's logits are comparable. Greedy tokens are identical
exactly when our argmax equals the reference's token at every step.

Plugin graphs run with the float64 reference PagedAttention (plugins/paged_attention/ort.py),
which checks the graph itself; when the native CPU op is built they are checked a second
time with it (what the runtime serves with), and the build passes only if both do.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np

from kvexport import io

# Max |Δ logits| accepted, per activation dtype (every family shares them).
# fp32: both sides compute in float32 with different summation orders and fused kernels;
# errors of ~1e-6 relative per op grow over the depth: on smollm2-135m (30 layers, logits
# of magnitude ~20) we measure ~1e-4, so 5e-3 leaves 50x headroom yet catches any real bug
# (a wrong mask or rope shows up as >1e-1).
# fp16: matmuls round to 11-bit mantissas; logits move by ~1e-2..1e-1, and near-ties may
# flip a greedy token, so fp16 checks the tolerance but only reports token agreement.
# int8 KV: every cached key/value is rounded to 1/254 of its head's calibrated range. On
# smollm2-135m (logits of magnitude ~20) the largest logit moves by 1.9 at some step while
# perplexity moves by <0.4% (bench/kv_quality.py); near-ties flip greedy tokens and a flip
# changes every later step, so int8 checks a loose logit bound plus a minimum share of
# greedy tokens agreeing. A broken quantization (wrong axis, wrong scale) scrambles the
# logits (|Δ| >> 3) and the tokens.
TOLERANCE = {"fp32": 5e-3, "fp16": 0.5, "int8_kv": 3.0}
REQUIRE_GREEDY = {"fp32": True, "fp16": False, "int8_kv": False}
MIN_AGREEMENT = {"fp32": 1.0, "fp16": 0.0, "int8_kv": 0.75}


def tolerance_key(manifest) -> str:
    return "int8_kv" if manifest.kv.dtype == "int8" else manifest.dtype

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "def fibonacci(n):",
    "Write a short poem about the sea and the wind, in the style of an old sailor's song:",
)


@dataclass(frozen=True, slots=True)
class ValidationResult:
    prompts: int
    prompt_lengths: list[int]
    steps: int
    max_abs_diff_per_step: list[float]  # step 0 = prefill
    max_abs_diff: float
    tolerance: float
    greedy_identical: bool
    token_agreement: float  # fraction of (prompt, step) argmaxes equal to the reference
    passed: bool
    # plugin graphs with the native CPU op: {max_abs_diff, greedy_identical, token_agreement, passed}
    native_op: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


def reference(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens [prompt][step] and logits [step] -> [num_prompts, vocab] from transformers."""
    import torch

    tokens, logits = [], [[] for _ in range(steps + 1)]
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            out = []
            for step in range(steps + 1):
                row = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float().numpy()
                logits[step].append(row)
                nxt = int(row.argmax())
                out.append(nxt)
                ids.append(nxt)
            tokens.append(out)
    return tokens, [np.stack(s) for s in logits]


def session(path: Path, threads: int | None = None, custom_ops: Path | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    if custom_ops is not None:
        so.register_custom_ops_library(str(custom_ops))
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


class ContiguousDriver:
    """Static batch, left padding, optimum-style past/present tensors."""

    def __init__(self, build_dir: Path, manifest):
        self.prefill = session(build_dir / manifest.graphs["prefill"].file)
        self.decode = session(build_dir / manifest.graphs["decode"].file)
        self.layers = manifest.kv.num_layers

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
            for i in range(self.layers):
                feeds[io.past_key(i)], feeds[io.past_value(i)] = past[2 * i], past[2 * i + 1]
            outs = self.decode.run(None, feeds)
            logits.append(outs[0][:, -1])
            past = outs[1:]
        return logits


class PagedDriver:
    """Packed tokens, a block pool per layer, sequences on consecutive blocks (block 0 is
    the pad block). Prompts are prefilled in two chunks."""

    def __init__(self, build_dir: Path, manifest, native_op: Path | None = None):
        self.plugin = manifest.kv.attention == io.Attention.PLUGIN.value
        open_ = partial(session, custom_ops=native_op)  # native_op: PagedAttention as the native CPU op
        if self.plugin and native_op is None:  # PagedAttention nodes run as the reference custom op
            from kvexport.plugins.paged_attention.ort import plugin_session as open_
        self.prefill = open_(build_dir / manifest.graphs["prefill"].file)
        self.decode = open_(build_dir / manifest.graphs["decode"].file)
        self.kv = manifest.kv
        self.dtype = np.dtype(io.DType(manifest.kv.dtype).numpy_name)
        self.all_logits = manifest.all_logits

    def run(self, prompts: list[list[int]], forced: list[list[int]], steps: int) -> list[np.ndarray]:
        kv, n = self.kv, len(prompts)
        per_seq = math.ceil((max(len(p) for p in prompts) + steps) / kv.block_size)
        tables = np.array([[1 + s * per_seq + j for j in range(per_seq)] for s in range(n)], np.int64)
        shape = io.paged_pool_shape(1 + n * per_seq, kv.num_kv_heads, kv.block_size, kv.head_dim)
        pools = [np.zeros(shape, self.dtype) for _ in range(2 * kv.num_layers)]
        seqs = [list(p) for p in prompts]
        done = [0] * n  # tokens already in the pool

        def step(sess, chunks: list[list[int]]) -> np.ndarray:
            ids, pos, slots, qsl = [], [], [], [0]
            for s, chunk in enumerate(chunks):
                for k, t in enumerate(chunk):
                    p = done[s] + k
                    ids.append(t)
                    pos.append(p)
                    slots.append(tables[s, p // kv.block_size] * kv.block_size + p % kv.block_size)
                qsl.append(qsl[-1] + len(chunk))
            lens = [done[s] + len(c) for s, c in enumerate(chunks)]
            # the onnx attention reads only blocks holding earlier steps' KV (none at first);
            # the plugin stores this step's K/V itself and needs every block up to seq_lens
            used = math.ceil((max(lens) if self.plugin else max(done)) / kv.block_size)
            feeds = {io.INPUT_IDS: np.array(ids, np.int64), io.POSITIONS: np.array(pos, np.int64),
                     io.QUERY_START_LOC: np.array(qsl, np.int64), io.SEQ_LENS: np.array(lens, np.int64),
                     io.BLOCK_TABLES: np.ascontiguousarray(tables[:, :used]),
                     io.SLOT_MAPPING: np.array(slots, np.int64)}
            for i in range(kv.num_layers):
                feeds[io.key_cache(i)], feeds[io.value_cache(i)] = pools[2 * i], pools[2 * i + 1]
            outs = sess.run(None, feeds)
            slot = np.array(slots)
            for j, pool in enumerate(pools):
                if self.plugin:  # key_cache_out / value_cache_out: the updated pools
                    pools[j] = outs[1 + j]
                else:  # the runtime's job: store this step's K/V
                    io.store_paged_kv(pool, slot, outs[1 + j])
            for s, c in enumerate(chunks):
                done[s] += len(c)
            logits = outs[0]
            if self.all_logits and sess is self.prefill:
                logits = logits[np.array(qsl[1:]) - 1]
            return logits

        if all(len(p) >= 2 for p in seqs):  # two chunks: the second attends to cached blocks
            step(self.prefill, [p[:len(p) // 2] for p in seqs])
            logits = [step(self.prefill, [p[len(p) // 2:] for p in seqs])]
        else:
            logits = [step(self.prefill, seqs)]
        for t in range(steps):
            logits.append(step(self.decode, [[f[t]] for f in forced]))
        return logits


def prompt_ids(tokenizer, vocab_size: int, count: int = 4, seed: int = 0) -> list[list[int]]:
    """Token ids of the default prompts (different lengths), or seeded random ids when the
    model has no tokenizer (tiny test models)."""
    if tokenizer is not None:
        return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in DEFAULT_PROMPTS[:count]]
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in (5, 17, 9, 30)[:count]]


def _compare(ours: list[np.ndarray], ref_logits: list[np.ndarray], forced: list[list[int]],
             manifest) -> tuple[list[float], float, bool, float, bool]:
    """(max |Δ| per step, tolerance, greedy identical, token agreement, passed)."""
    diffs, agree = [], 0
    for step, (a, r) in enumerate(zip(ours, ref_logits)):
        diffs.append(float(np.abs(a.astype(np.float32) - r).max()))
        agree += sum(int(a[s].argmax() == forced[s][step]) for s in range(len(forced)))
    total = len(forced) * len(ours)
    key = tolerance_key(manifest)
    tol = TOLERANCE[key]
    identical = agree == total
    passed = (max(diffs) <= tol and (identical or not REQUIRE_GREEDY[key])
              and agree / total >= MIN_AGREEMENT[key])
    return diffs, tol, identical, agree / total, passed


def validate(build_dir: Path, manifest, model, prompts: list[list[int]], steps: int = 16) -> ValidationResult:
    forced, ref_logits = reference(model, prompts, steps)
    driver = PagedDriver if manifest.kv.layout == io.KVLayout.PAGED.value else ContiguousDriver
    ours = driver(build_dir, manifest).run(prompts, forced, steps)
    diffs, tol, identical, agreement, passed = _compare(ours, ref_logits, forced, manifest)
    native = None
    lib = None
    if manifest.kv.layout == io.KVLayout.PAGED.value:
        from kvexport.plugins.paged_attention.native import library_for

        lib, _ = library_for(manifest)
    if lib is not None:
        n_diffs, _, n_identical, n_agreement, n_passed = _compare(
            PagedDriver(build_dir, manifest, native_op=lib).run(prompts, forced, steps), ref_logits, forced, manifest)
        native = {"max_abs_diff": max(n_diffs), "greedy_identical": n_identical, "token_agreement": n_agreement,
                  "passed": n_passed}
        passed = passed and n_passed
    return ValidationResult(len(prompts), [len(p) for p in prompts], steps, diffs, max(diffs), tol,
                            identical, agreement, passed, native)
