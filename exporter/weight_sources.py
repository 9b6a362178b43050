"""Where a quantized build's matmul codes come from: read exactly from a pre-quantized source
(GGUF Q4_0 / Q8_0 / Q4_1 blocks here, MoE experts included; AWQ / GPTQ safetensors in
prequantized.py), or rounded from the float weights (round-to-nearest, or AWQ scales from
calibration text in awq.py).

NOTE (exact, checked): a block read from the source is trusted only when its dequantized value
equals, element for element, the float weight transformers loaded from the same file (which
dequantized those very blocks); otherwise the matrix is re-quantized and the manifest says so.
This also pins the row order: llama GGUFs store q/k rows permuted for llama.cpp's RoPE, which
transformers undoes; we try that permutation and the identity and keep the one that matches.
"""

from __future__ import annotations

import logging

import numpy as np

from kvexport.errors import ConfigError, UnsupportedModelError

from . import prequantized
from . import quantize as qz
from .limits import CALIBRATED_METHODS

log = logging.getLogger(__name__)

# GGUF tensor names of one layer's matmuls, in the order they are fused (graph name, parts)
GGUF_PARTS = {"attn.qkv": ("attn_q", "attn_k", "attn_v"), "attn.o": ("attn_output",),
              "mlp.up": ("ffn_gate", "ffn_up"), "mlp.down": ("ffn_down",)}
GGUF_BLOCK = 32  # elements per Q4_0 / Q4_1 / Q8_0 block
GGUF_SHARED = "_shexp"  # MoE layers (qwen2moe): the shared expert's parts are ffn_gate_shexp, ...
# a MoE layer's routed experts (exporter/moe.py expert_name "up" / "down"), stacked [experts, out, in]
GGUF_EXPERT_PARTS = {"up": ("ffn_gate_exps", "ffn_up_exps"), "down": ("ffn_down_exps",)}


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] bytes -> [rows, blocks, 32] codes 0..15 (low nibbles first, as ggml)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int8)


def read_gguf_block(kind: str, data: np.ndarray, cols: int) -> qz.QuantizedMatrix | None:
    """A GGUF matrix [rows=out, cols=in] of raw blocks -> QuantizedMatrix [K=in, N=out], or None
    for a block type that does not map exactly onto block-32 codes."""
    rows = data.shape[0]
    nb = cols // GGUF_BLOCK
    if kind == "Q8_0":  # 2-byte fp16 d, 32 int8: w = d * q
        b = data.reshape(rows, nb, 34)
        d, q, zp, off = _f16(b[..., :2]), b[..., 2:].view(np.int8), None, None
        bits = 8
    elif kind == "Q4_0":  # d, 16 bytes of nibbles: w = d * (q - 8)
        b = data.reshape(rows, nb, 18)
        d, q, zp, off = _f16(b[..., :2]), _nibbles(b[..., 2:]) - 8, None, None
        bits = 4
    elif kind == "Q4_1":  # d, m, 16 bytes of nibbles: w = d * q + m = d * ((q - 8) - (-8)) + m
        b = data.reshape(rows, nb, 20)
        d, m, q = _f16(b[..., :2]), _f16(b[..., 2:4]), _nibbles(b[..., 4:]) - 8
        zp, off, bits = np.full((nb, rows), -8, np.int8), np.ascontiguousarray(m.T), 4
    else:
        return None
    q = np.ascontiguousarray(q.reshape(rows, cols).T)  # [K, N]
    return qz.QuantizedMatrix(q, np.ascontiguousarray(d.T), bits, GGUF_BLOCK, zp, off, origin=f"gguf:{kind}")


def _permuted(m: qz.QuantizedMatrix, n_head: int) -> qz.QuantizedMatrix:
    """Columns (output rows) reordered as transformers' reverse_permute_weights does."""
    n = m.q.shape[1]
    perm = np.arange(n).reshape(n_head, n // n_head // 2, 2).swapaxes(2, 1).reshape(n)
    take = lambda a: None if a is None else np.ascontiguousarray(a[:, perm])  # noqa: E731
    return qz.QuantizedMatrix(take(m.q), take(m.scale), m.bits, m.block_size, take(m.zero_point),
                              take(m.offset), m.origin)


def _matches(m: qz.QuantizedMatrix, w: np.ndarray) -> bool:
    return m.q.shape == w.shape and np.array_equal(m.dequantize(), w.astype(np.float32))


def _exact(parts: list[tuple[str, object]], ref: np.ndarray, heads: dict[str, int], where: str
           ) -> qz.QuantizedMatrix | None:
    """One fused matmul from its GGUF parts [(part name, (type name, raw blocks [rows, ...], cols))],
    columns in order, when every part maps exactly onto `ref` [K, N] (q/k rows un-permuted where
    that is what matches); else None (a warning when the blocks map but the values differ)."""
    mats, col = [], 0
    for part, (kind, data, cols) in parts:
        m = read_gguf_block(kind, data, cols)
        if m is None:
            return None
        r = ref[:, col:col + m.q.shape[1]]
        col += m.q.shape[1]
        candidates = [m] + ([_permuted(m, heads[part])] if part in heads else [])
        m = next((c for c in candidates if _matches(c, r)), None)
        if m is None:
            log.warning("GGUF %s does not match the loaded weights exactly; re-quantizing it", where)
            return None
        mats.append(m)
    if len({(m.bits, m.zero_point is None, m.offset is None) for m in mats}) != 1:
        return None
    return qz.concat_columns(mats)


def gguf_presets(path: str, weights, spec) -> tuple[dict[str, qz.QuantizedMatrix], dict[str, int]]:
    """name -> exactly mapped codes for every fused matmul whose GGUF parts all map exactly and
    agree with the float weights (MoE layers: the shared expert's and each routed expert's, one
    expert's slice of the stacked ffn_*_exps); and the count of source tensors per GGUF type."""
    import gguf

    from .moe import expert_name

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    kinds: dict[str, int] = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    floats = qz.float_linears(weights)
    heads = {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads}

    def raw(t, expert: int | None = None):  # (type name, [rows, bytes or cols], cols)
        data = np.asarray(t.data)
        return t.tensor_type.name, (data if expert is None else data[expert]), int(t.shape[0])

    out = {}
    for i in range(spec.num_layers):
        sparse = spec.moe is not None and spec.moe.is_sparse(i)
        for graph_name, parts in GGUF_PARTS.items():
            if sparse and graph_name.startswith("mlp."):  # a sparse layer's dense MLP is its shared expert
                parts = tuple(p + GGUF_SHARED for p in parts)
            name = f"model.layers.{i}.{graph_name}.weight"
            found = [tensors.get(f"blk.{i}.{p}.weight") for p in parts]
            if name in floats and all(t is not None for t in found):
                m = _exact([(p, raw(t)) for p, t in zip(parts, found)], floats[name], heads, f"{parts} of layer {i}")
                if m is not None:
                    out[name] = m
        for which, parts in (GGUF_EXPERT_PARTS.items() if sparse else ()):
            found = [tensors.get(f"blk.{i}.{p}.weight") for p in parts]
            if any(t is None for t in found):
                continue
            for e in range(spec.moe.num_experts):
                name = expert_name(i, e, which)
                m = _exact([(p, raw(t, e)) for p, t in zip(parts, found)], floats[name], {},
                           f"expert {e} {which} of layer {i}")
                if m is not None:
                    out[name] = m
    return out, kinds


def quantized_weights(src, model, spec, weights, wq: qz.WeightQuantization, tokenizer,
                      calibration_text: str | None, calibration_tokens: int, head_block: int | None = None):
    """(ModelWeights the graphs use, name -> QuantizedMatrix, manifest record) of a build with
    int8/int4 weights. AWQ re-rounds every matrix from its float values (a pre-quantized
    source's blocks would not carry its scales), and may change the norms it folds into.
    head_block: the int8 LM head's block size (None: the build's, or HEAD_CHANNEL_BUILDS_BLOCK
    for per-channel builds; qz.CHANNEL for TensorRT)."""
    presets, kinds, method_info = {}, {}, {}
    pq = prequantized.config_of(src.directory) if src.kind == "hf" else None
    if spec.moe is not None:  # experts are rounded to nearest (exporter/moe.py expert_linears)
        if wq.method in CALIBRATED_METHODS:
            raise ConfigError(f"--quant-method {wq.method} searches scales for dense MLPs and does not cover the "
                              f"experts of a mixture-of-experts model ({spec.family}); use --quant-method rtn "
                              f"(e.g. --weights {wq.precision} --quant-method rtn)")
        if pq is not None:
            raise UnsupportedModelError(f"pre-quantized ({pq.origin}) checkpoints of mixture-of-experts models "
                                        f"({spec.family}) are not supported: build from the float checkpoint with "
                                        f"--weights int8|int4 --quant-method rtn")
    if pq is not None:  # AWQ / GPTQ safetensors: their codes exactly (refuses another bits / block size)
        presets = prequantized.presets(src, spec, pq, wq)
        floats = qz.float_linears(weights)  # the reference model was loaded from the same codes
        assert all(_matches(m, floats[n]) for n, m in presets.items()), "prequantized codes != loaded weights"
        method_info = {"method": f"{pq.origin} (pre-quantized codes, mapped exactly)",
                       "source": pq.to_json() | {"exact_matrices": len(presets)}}
    elif src.gguf_file and wq.method == "rtn":
        presets, kinds = gguf_presets(str(src.directory / src.gguf_file), weights, spec)
    elif src.gguf_file:
        kinds = _gguf_kinds(str(src.directory / src.gguf_file))
    scales = {}
    if wq.method in CALIBRATED_METHODS:
        from pathlib import Path

        from . import awq, calibrate

        text = Path(calibration_text) if calibration_text else (calibrate.default_text() if tokenizer else None)
        ids = calibrate.calibration_ids(tokenizer, spec.vocab_size, text, calibration_tokens)
        weights, scales, alphas = awq.search(model, weights, spec, wq, ids)
        method_info = {"calibration": {"text": text.name if text else "random-ids", "tokens": len(ids)},
                       "alpha_grid": [round(a, 2) for a in awq.ALPHAS], "scaled_matrices": len(scales),
                       "search": awq.SEARCH[wq.method],
                       "mean_alpha": round(float(np.mean(list(alphas.values()))), 3) if alphas else 0.0}
    q = qz.quantize_model(weights, wq, presets, scales)
    if head_block is None:
        head_block = qz.HEAD_CHANNEL_BUILDS_BLOCK if wq.block_size == qz.CHANNEL else wq.block_size
    q[qz.QUANTIZED_HEAD] = head = _int8_table(src, weights.lm_head, ("output.weight", "token_embd.weight"), head_block)
    method_info = method_info | {"lm_head": {"bits": head.bits, "block_size": head.block_size or "channel",
                                             "origin": head.origin}}
    exact = sum(1 for m in q.values() if m.origin.startswith("gguf:"))
    if not spec.tie_embeddings:  # the table in int8 too, in the head's blocks (quantize.py QUANTIZED_EMBED)
        q[qz.QUANTIZED_EMBED] = _int8_table(src, weights.embed, ("token_embd.weight",), head_block)
    requantized = None
    if kinds:
        requantized = (f"GGUF tensor types {kinds}: {exact} of {len(q) - (qz.QUANTIZED_EMBED in q)} fused matrices "
                       f"mapped exactly from "
                       f"their blocks; the rest dequantized by transformers and re-quantized ({wq.method})")
    return weights, q, requantized, method_info


def _gguf_kinds(path: str) -> dict[str, int]:
    import gguf

    kinds: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    return kinds


def _int8_table(src, table: np.ndarray, gguf_names: tuple[str, ...], block: int) -> qz.QuantizedMatrix:
    """A [vocab, hidden] table (the LM head, or untied embeddings) as int8 (HEAD_BITS) codes
    [hidden, vocab] whatever the build's bits, in blocks of `block` along hidden: exact from the
    first of `gguf_names` the GGUF holds when it is Q8_0 and blocks are 32, else round-to-nearest."""
    head = np.ascontiguousarray(table.T)  # [hidden, vocab]
    if src.gguf_file and block == GGUF_BLOCK:
        import gguf

        tensors = {t.name: t for t in gguf.GGUFReader(str(src.directory / src.gguf_file)).tensors}
        t = next((tensors[n] for n in gguf_names if n in tensors), None)
        m = read_gguf_block(t.tensor_type.name, np.asarray(t.data), int(t.shape[0])) if t is not None else None
        if m is not None and m.bits == qz.HEAD_BITS and _matches(m, head):
            return m
    return qz.quantize_rtn(head, qz.HEAD_BITS, block)
