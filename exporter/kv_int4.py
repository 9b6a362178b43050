"""int4 KV rows (kvexport/io.py KV_INT4_FORMAT) written with standard ONNX ops, and the fixed
Hadamard rotation int4 graphs apply to q, k and v.

The `onnx` attention and contiguous builds quantize with `quantize_rows` and read pools back
with `dequantize_rows`; they store the same bytes as plugins/paged_attention/reference.py
quantize_int4 (tests/exporter/test_int4_kv_graphs.py). Opset 18 has no bit casts, so the
float16 bits of each scale are computed by exact arithmetic: the value is first rounded
to float16 by Cast (round to nearest even), its exponent field counted against the powers of
two 2^-14..2^15, and its mantissa is then an exact quotient by a power of two.

    x [.., D] ─ groups of 32 ─> lo, hi ─> e = hi if hi >= -lo else lo (the extreme)
      ─> scale = ∓f16(max(|e| / 8, 2^-14)) (negative for a positive extreme: e maps to -8)
      ─> code = clip(round(x / scale), -8, 7) + 8 ─> pairs ─> lo | hi << 4    [.., D/2] uint8
      scale ─> float16 bits ─> little-endian bytes                          [.., D/16] uint8
      ─> Concat ─> row [.., D/2 + D/16] uint8

The key transform (`calibrate_transform`): int4 graphs store rotate((k - μ) / s) and attend with
rotate(q * s), μ and s [kv_heads, head_dim] per layer, calibrated (the calibration text, as int8
KV's scales): μ the mean post-RoPE key, s from each channel's spread about it, the one of
CANDIDATES whose int4 round trip gives each KV head's attention output the least error.
Exact for softmax attention: (q * s)·((k - μ) / s) = q·k - q·μ, and q·μ is the same for every
key a query reads, so the softmax (and the output) is unchanged; the op and the pool bytes are
the same as without.
Why: Qwen2's k bias puts a few channels tens of times above the rest at every token, and
per-token groups spent their 16 levels on them — μ takes the constant part away, s equalizes the
channels that move (RoPE pairs sharing theirs), as KIVI's per-channel key scales do, but static
(Qwen2.5-Coder-0.5B: +91.8% perplexity with neither; docs/QUANTIZATION.md "int4 KV").
NOTE: μ is not exact with a logit soft-cap (tanh of the shifted score) or learned attention
sinks (a sink logit is not shifted with the keys): such layers get μ = 0 (s stays: it is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvexport import io

from .onnx_builder import GraphBuilder, onnx_dtype

F16_MAX = 65504.0
MIN_SCALE = 2.0 ** -14
# exponent field e -> the value of one mantissa unit, 2^(max(e, 1) - 25) (e = 31, inf/NaN: never stored)
_UNIT = np.array([2.0 ** (max(e, 1) - 25) for e in range(32)], np.float32)
_POW2 = np.array([2.0 ** k for k in range(-14, 16)], np.float32)  # a >= 2^k counts the exponent field


def hadamard(d: int) -> np.ndarray:
    """The rotation of int4 graphs: [d, d] float32, block-diagonal with normalized Sylvester
    Hadamard blocks of n = the largest power of two dividing d (64 for head_dim 64, 32 for 96).
    Orthogonal and symmetric, so q·H·(k·H)ᵀ = q·kᵀ and (p·v·H)·H = p·v.
    NOTE: one matrix for q, k and v of every layer: it spreads a channel outlier over n
    channels, so a group's scale no longer spends its 16 levels on one channel."""
    n = d & -d
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(d // n), h / np.sqrt(n)).astype(np.float32)


# the channel scales tried for each layer and KV head: s = (sd / mean sd) ** alpha (0: none; 1:
# every channel equalized, KIVI's per-channel key scale made static) and OUTLIERS, max(1, sd / (2 x
# median sd)) (only the wide channels narrowed); docs/QUANTIZATION.md "int4 KV" has the search
OUTLIERS = "outliers"
CANDIDATES: tuple[float | str, ...] = (0.0, 0.25, 0.5, 0.75, 1.0, OUTLIERS)
ERROR_QUERIES = 256  # query positions per layer the attention error is measured at (spread evenly)


@dataclass(frozen=True)
class KeyTransform:
    """A calibrated key transform and how its channel scales were chosen.
    values: [KV layers, 2 (μ, s), kv_heads, head_dim] float32, what the graphs hold (a row per layer
    that holds KV: every layer, or a hybrid's attention layers, those transformers' attention runs in).
    chosen: [KV layers][kv_heads] the CANDIDATES entry picked for s.
    errors: [KV layers, len(CANDIDATES), kv_heads] float64, each candidate's relative attention
    output error on the calibration text (`attention_error`); the pick is the minimum."""
    values: np.ndarray
    chosen: list[list[float | str]]
    errors: np.ndarray


def calibrate_transform(model, ids: list[int], exact: list[bool], rotary_dim: int,
                        chunk: int = 512) -> KeyTransform:
    """The int4 key transform calibrated on `ids`, per layer and KV head: μ the mean post-RoPE key
    (zeros for the layers where `exact[i]` is False), s the candidate channel scale whose int4
    round trip gives that head's attention output the smallest error on the calibration text.

        ids ─chunks, transformers' cache continued─> every layer's post-RoPE q, k, v (a capturing
          attention function, `_capture`) ─> μ, sd per channel (RoPE pairs sharing) ─> for each
          candidate s: softmax(rotate(q s)·int4(rotate((k - μ) / s))ᵀ)·int4(rotate(v)) vs the
          float attention at ERROR_QUERIES positions ─> per KV head, the s of least error

    NOTE: per KV head, not one exponent per model: which s is best depends on how a head's key
    channels spread (Qwen2.5's biased channels want them narrowed, smollm2's mostly even heads
    little or none), and no single exponent met +3% perplexity on both (real builds: (sd / mean
    sd)^0.5 +3.70% smollm2, +2.08% Qwen2.5; chosen per head +1.59%, +1.27%; docs/QUANTIZATION.md
    "int4 KV"). Every candidate is exact; the choice only moves rounding error."""
    import torch

    layers = _capture(model, ids, chunk)
    mus, scales, chosen, errors = [], [], [], []
    with torch.no_grad():
        for i, cap in enumerate(layers):
            k = cap["k"].double()  # [kv_heads, n, head_dim]
            mean = k.mean(1)  # [kv_heads, head_dim]
            sd = channel_spread(((k - mean[:, None]) ** 2).mean(1), rotary_dim)
            mu = mean if exact[i] else torch.zeros_like(mean)
            s, picked, err = choose_scale(cap, mu, sd)
            mus.append(mu)
            scales.append(s)
            chosen.append(picked)
            errors.append(err.numpy())
            layers[i] = None  # its tensors (and attention_error's per-layer caches) freed
    values = np.stack([np.stack([m.numpy(), s.numpy()]) for m, s in zip(mus, scales)]).astype(np.float32)
    return KeyTransform(values, chosen, np.stack(errors))


def choose_scale(cap: dict, mu, sd):
    """Per KV head, the CANDIDATES scale of least `attention_error` for one captured layer (`_capture`)
    with offset `mu` and channel spread `sd` [kv_heads, head_dim]: (s [kv_heads, head_dim], the
    CANDIDATES entry of each head, the errors [len(CANDIDATES), kv_heads])."""
    import torch

    cands = torch.stack([candidate_scale(sd, c) for c in CANDIDATES])  # [C, kv_heads, head_dim]
    err = torch.stack([attention_error(cap, mu, s) for s in cands])  # [C, kv_heads]
    best = err.argmin(0)  # [kv_heads]
    return cands[best, torch.arange(len(best))], [CANDIDATES[j] for j in best.tolist()], err


def channel_spread(var, rotary_dim: int):
    """Per channel standard deviations [.., head_dim] from variances about μ, RoPE pairs c,
    c + rotary_dim / 2 sharing their mean variance (RoPE moves a key's energy between the two
    with the position); a constant channel gets a floor (no division by 0)."""
    import torch

    half = rotary_dim // 2
    if half:
        pair = (var[..., :half] + var[..., half:rotary_dim]) / 2
        var = torch.cat([pair, pair, var[..., rotary_dim:]], -1)
    sd = var.clamp(min=0).sqrt()
    return torch.maximum(sd, 1e-3 * sd.mean(-1, keepdim=True) + 1e-30)


def candidate_scale(sd, candidate: float | str):
    """s [kv_heads, head_dim] for one CANDIDATES entry from the spread `sd` [kv_heads, head_dim]."""
    if candidate == OUTLIERS:
        return (sd / (2 * sd.median(-1, keepdim=True).values)).clamp(min=1.0)
    return (sd / sd.mean(-1, keepdim=True)) ** float(candidate)


def int4_round_trip(x):
    """x [.., head_dim] -> what a pool row of x reads back as (reference.py quantize_int4 then
    dequantize_int4: the stored bytes exactly), float32."""
    from kvexport.plugins.paged_attention.reference import dequantize_int4, quantize_int4

    return dequantize_int4(quantize_int4(x), x.shape[-1])


def attention_error(cap: dict, mu, s):
    """Relative error of one layer's attention output with int4 KV and the transform (μ, s)
    [kv_heads, head_dim], per KV head: ||o' - o||² / ||o||² summed over the KV head's query heads
    at the captured query positions. o: the float attention of the captured q, k, v; o': the int4
    graphs' computation, q' = rotate(q s), k' = int4(rotate((k - μ) / s)), v' = int4(rotate(v)),
    o' = rotate(softmax(q'·k'ᵀ)·v') (the rotation is symmetric and orthogonal). float32 (the
    graphs' precision; the errors compared are ~1e-2)."""
    import torch

    q, k, v = cap["q"], cap["k"], cap["v"]  # [H, m, D], [kvH, n, D] x2
    kvh, d = k.shape[0], k.shape[-1]
    g = q.shape[0] // kvh
    h = torch.from_numpy(hadamard(d))
    if "ref" not in cap:  # the float attention, the mask, the values' round trip: the same for every s
        cap["ref"] = _attend(cap, q, k, v)
        cap["v4"] = int4_round_trip(v @ h)
    s_q = s.float().repeat_interleave(g, 0)[:, None]  # [H, 1, D]
    k4 = int4_round_trip(((k - mu.float()[:, None]) / s.float()[:, None]) @ h)
    out = _attend(cap, (q * s_q) @ h, k4, cap["v4"]) @ h
    ref = cap["ref"]
    num = ((out - ref).double() ** 2).sum((1, 2)).view(kvh, g).sum(1)
    den = (ref.double() ** 2).sum((1, 2)).view(kvh, g).sum(1)
    return num / den


def _attend(cap: dict, q, k, v):
    """softmax attention of the captured query positions: q [H, m, D], k, v [kvH, n, D] ->
    [H, m, D], causal (and the layer's window, soft-cap, sinks as captured)."""
    import torch

    kvh, m = k.shape[0], q.shape[1]
    g = q.shape[0] // kvh
    qg = q.reshape(kvh, g * m, -1)  # a KV head's query heads side by side: no repeated k, v
    scores = cap["scale"] * qg @ k.transpose(1, 2)  # [kvH, g * m, n]
    if cap["softcap"]:
        scores = cap["softcap"] * torch.tanh(scores / cap["softcap"])
    if "mask" not in cap:  # additive: 0 where visible, -inf elsewhere
        qpos, kpos = cap["pos"][:, None], torch.arange(k.shape[1])[None, :]
        visible = kpos <= qpos
        if cap["window"]:
            visible &= (qpos - kpos) < cap["window"]
        cap["mask"] = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).repeat(g, 1)  # [g * m, n]
    scores = scores + cap["mask"]
    if cap["sinks"] is not None:  # one more logit per head, with no value
        sink = cap["sinks"].float().view(kvh, g, 1, 1).expand(-1, -1, m, 1).reshape(kvh, g * m, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return (probs @ v).reshape(kvh * g, m, -1)


PROBE = "kvexport_int4_probe"  # the attention implementation `_capture` registers


def _capture(model, ids: list[int], chunk: int) -> list[dict]:
    """Every layer's post-RoPE keys and values for `ids` ("k", "v" [kv_heads, n, head_dim] float32)
    and its queries at ERROR_QUERIES evenly spread positions ("q" [heads, m, head_dim], "pos" [m]),
    with its softmax scale, sliding window, soft-cap and sink logits. One sequence fed in chunks
    that continue transformers' cache, as exporter/calibrate.py compute_scales.
    NOTE: through transformers' AttentionInterface: a registered attention function sees exactly
    what the model's attention does (after RoPE and any q/k norm, for every family) and hands on
    to the model's own implementation, set back afterwards."""
    import sys

    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    n = len(ids)
    picks = torch.unique(torch.linspace(0, n - 1, min(ERROR_QUERIES, n)).round().long())
    layers: dict[int, dict] = {}
    state = {"start": 0}
    before = model.config._attn_implementation

    def probe(module, query, key, value, attention_mask, **kw):
        t, start = query.shape[2], state["start"]
        cap = layers.setdefault(module.layer_idx, {"q": [], "k": [], "v": [], "pos": []})
        mine = picks[(picks >= start) & (picks < start + t)]
        cap["q"].append(query[0, :, mine - start].float())
        cap["pos"].append(mine)
        cap["k"].append(key[0, :, -t:].float())  # this chunk's: the last t (a window layer keeps fewer before)
        cap["v"].append(value[0, :, -t:].float())
        cap.update(scale=kw.get("scaling") or module.scaling, window=kw.get("sliding_window") or 0,
                   softcap=kw.get("softcap") or 0.0, sinks=kw.get("s_aux"))
        inner = ALL_ATTENTION_FUNCTIONS.get(before) or sys.modules[type(module).__module__].eager_attention_forward
        return inner(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(PROBE, probe)
    AttentionMaskInterface.register(PROBE, ALL_MASK_ATTENTION_FUNCTIONS[before if before in
                                                                        ALL_MASK_ATTENTION_FUNCTIONS else "eager"])
    model.set_attn_implementation(PROBE)
    try:
        cache = None
        with torch.no_grad():
            for start in range(0, n, chunk):
                state["start"] = start
                cache = model(torch.tensor([ids[start:start + chunk]]), cache=cache, use_cache=True).cache
    finally:
        model.set_attn_implementation(before)
    out = []
    for i in sorted(layers):
        cap = layers[i]
        for name in ("q", "k", "v", "pos"):
            cap[name] = torch.cat(cap[name], 1 if name != "pos" else 0)
        out.append(cap)
    return out


def transform_entry(t: KeyTransform | np.ndarray, text: str, ids: list[int],
                    layers: list[int] | None = None) -> dict:
    """The manifest's kv.quantization["key_transform"] record (the values are the graphs'
    kvexport/io.py k_offset / k_channel_scale initializers); with a KeyTransform, also which
    channel scale each layer and KV head got and every candidate's measured error. `layers`: the
    layers the rows belong to where not every layer holds KV (a hybrid's attention layers;
    recorded as "layers"), None: row i is layer i."""
    import hashlib

    values = t.values if isinstance(t, KeyTransform) else t
    rows = list(range(values.shape[0])) if layers is None else list(layers)
    entry = {"kind": "calibrated", "applied": "post-RoPE, before the rotation: k' = (k - offset) / scale, "
                                              "q' = q * scale (q'·k' = q·k - q·offset)",
             "calibration": {"text": text, "tokens": len(ids),
                             "ids_sha256": hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()},
             "layers_without_offset": [i for r, i in enumerate(rows) if not values[r, 0].any()]}
    if layers is not None:
        entry["layers"] = rows
    if isinstance(t, KeyTransform):
        entry["scale_choice"] = {
            "candidates": [c if c == OUTLIERS else f"(sd / mean sd)^{c:g}" for c in CANDIDATES],
            "criterion": f"least relative error of the head's attention output with int4 KV at {ERROR_QUERIES} "
                         "query positions of the calibration text (exporter/kv_int4.py attention_error)",
            "chosen": [[c if c == OUTLIERS else float(c) for c in layer] for layer in t.chosen],  # [layers][kv_heads]
            "errors": np.round(t.errors, 6).tolist()}  # [layers][candidates][kv_heads]
    return {**entry, "offsets": values[:, 0].tolist(), "scales": values[:, 1].tolist()}  # [KV layers][kv_heads][head_dim]


def rotate(b: GraphBuilder, x: str, d: int) -> str:
    """x [.., d] times the Hadamard matrix (one constant per graph: constants are shared by value)."""
    return b.op("MatMul", x, b.const(hadamard(d), "float32"))


def _f16_bits(b: GraphBuilder, v: str) -> str:
    """float32 values that are exact float16 values -> their IEEE float16 bits as float32
    integers (sign of -0 kept: 1 / -0 = -inf)."""
    a = b.op("Abs", v)
    neg = b.op("Less", b.op("Div", b.const(1.0, "float32"), v), b.const(0.0, "float32"))
    e = b.op("ReduceSum", b.op("Cast", b.op("GreaterOrEqual", b.op("Unsqueeze", a, b.const([-1])),
                                            b.const(_POW2, "float32")), to=onnx_dtype("float32")),
             b.const([-1]), keepdims=0)  # exponent field 0..30
    unit = b.op("Gather", b.const(_UNIT, "float32"), b.op("Cast", e, to=onnx_dtype("int64")), axis=0)
    implicit = b.op("Mul", b.op("Min", e, b.const(1.0, "float32")), b.const(1024.0, "float32"))
    mant = b.op("Sub", b.op("Div", a, unit), implicit)  # exact: a = (implicit + mant) * unit
    bits = b.op("Add", b.op("Mul", e, b.const(1024.0, "float32")), mant)
    return b.op("Add", bits, b.op("Mul", b.op("Cast", neg, to=onnx_dtype("float32")), b.const(32768.0, "float32")))


def _f16_round(b: GraphBuilder, x: str) -> str:
    """float32 -> the nearest float16 value (ties to even, saturating at ±65504), as float32."""
    x = b.op("Clip", x, b.const(-F16_MAX, "float32"), b.const(F16_MAX, "float32"))
    return b.op("Cast", b.op("Cast", x, to=onnx_dtype("float16")), to=onnx_dtype("float32"))


def quantize_rows(b: GraphBuilder, x: str, d: int, rank: int) -> str:
    """x [.., d] float32 (`rank` dims) -> int4 rows [.., io.kv_row_width(d, "int4")] uint8."""
    g = d // io.KV_INT4_GROUP
    keep = [0] * (rank - 1)  # leading axes copied (allowzero 0)
    xg = b.op("Reshape", x, b.const(keep + [g, io.KV_INT4_GROUP]))  # [.., G, 32]
    lo = b.op("ReduceMin", xg, b.const([-1]), keepdims=1)  # [.., G, 1]
    hi = b.op("ReduceMax", xg, b.const([-1]), keepdims=1)
    neg_lo = b.op("Neg", lo)
    pos = b.op("GreaterOrEqual", hi, neg_lo)  # the extreme is the maximum (ties: the maximum)
    mag = b.op("Div", b.op("Where", pos, hi, neg_lo), b.const(8.0, "float32"))
    mag = _f16_round(b, b.op("Max", mag, b.const(MIN_SCALE, "float32")))
    scale = b.op("Where", pos, b.op("Neg", mag), mag)  # [.., G, 1]
    code = b.op("Round", b.op("Div", xg, scale))  # half to even
    code = b.op("Add", b.op("Clip", code, b.const(-8.0, "float32"), b.const(7.0, "float32")), b.const(8.0, "float32"))
    pairs = b.op("Reshape", code, b.const(keep + [d // 2, 2]))
    even, odd = b.op("Split", pairs, b.const([1, 1]), axis=-1, outputs=2)  # [.., D/2, 1]
    packed = b.op("Squeeze", b.op("Add", even, b.op("Mul", odd, b.const(16.0, "float32"))), b.const([-1]))
    bits = _f16_bits(b, scale)  # [.., G, 1]
    high = b.op("Floor", b.op("Div", bits, b.const(256.0, "float32")))
    low = b.op("Sub", bits, b.op("Mul", high, b.const(256.0, "float32")))
    sm = b.op("Reshape", b.op("Concat", low, high, axis=-1), b.const(keep + [2 * g]))  # [.., G * 2]: scale LE
    row = b.op("Concat", packed, sm, axis=-1)
    return b.op("Cast", row, to=onnx_dtype("uint8"))


def dequantize_rows(b: GraphBuilder, rows: str, d: int, rank: int) -> str:
    """int4 rows [.., row] uint8 (`rank` dims) -> [.., d] float32: (nibble - 8) * scale."""
    g = d // io.KV_INT4_GROUP
    keep = [0] * (rank - 1)
    codes = b.op("Slice", rows, b.const([0]), b.const([d // 2]), b.const([-1]))  # [.., D/2]
    sm = b.op("Slice", rows, b.const([d // 2]), b.const([d // 2 + 2 * g]), b.const([-1]))  # [.., 2G]
    low = b.op("BitwiseAnd", codes, b.const(15, "uint8"))
    high = b.op("BitShift", codes, b.const(4, "uint8"), direction="RIGHT")
    code = b.op("Concat", b.op("Unsqueeze", low, b.const([-1])), b.op("Unsqueeze", high, b.const([-1])), axis=-1)
    code = b.op("Cast", b.op("Reshape", code, b.const(keep + [g, io.KV_INT4_GROUP])), to=onnx_dtype("float32"))
    code = b.op("Sub", code, b.const(8.0, "float32"))
    sm = b.op("Cast", b.op("Reshape", sm, b.const(keep + [g, 2])), to=onnx_dtype("float32"))  # [.., G, 2]
    lb, hb = b.op("Split", sm, b.const([1, 1]), axis=-1, outputs=2)  # [.., G, 1]
    bits = b.op("Add", lb, b.op("Mul", hb, b.const(256.0, "float32")))  # [.., G, 1] float16 bits
    neg = b.op("GreaterOrEqual", bits, b.const(32768.0, "float32"))
    u = b.op("Sub", bits, b.op("Mul", b.op("Cast", neg, to=onnx_dtype("float32")), b.const(32768.0, "float32")))
    e = b.op("Floor", b.op("Div", u, b.const(1024.0, "float32")))
    mant = b.op("Sub", u, b.op("Mul", e, b.const(1024.0, "float32")))
    unit = b.op("Gather", b.const(_UNIT, "float32"), b.op("Cast", e, to=onnx_dtype("int64")), axis=0)
    val = b.op("Mul", b.op("Add", mant, b.op("Mul", b.op("Min", e, b.const(1.0, "float32")),
                                               b.const(1024.0, "float32"))), unit)
    scale = b.op("Where", neg, b.op("Neg", val), val)  # [.., G, 1]
    x = b.op("Mul", code, scale)  # [.., G, 32]; exact
    return b.op("Reshape", x, b.const(keep + [d]))
