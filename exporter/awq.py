"""Activation-aware weight quantization (AWQ-style scale search, Lin et al. 2023) on calibration
text: per input channel k of a matmul, W[k, :] is multiplied by s[k] before rounding and the
activation x[:, k] divided by it, so the channels that see large activations are rounded more
finely. The division is folded into the op that produces x, which keeps the float model equal:

    input norm weight  /= s   for the fused q|k|v matmul   (its input is the norm's output)
    post norm weight   /= s   for the fused gate|up matmul
    up columns (+bias) /= s   for down                     (x = act(gate) * up, gated MLPs)

s = mean|x|^alpha (normalized), alpha from a grid, chosen per matmul to minimize
||x W - (x / s) Q(W s)||^2 on the calibration activations (weights-only search, no training).

`--quant-method smoothquant` (Xiao et al. 2023; per-channel int8 weights, or int4 blocks): the
runtime also rounds the activations to int8, one scale per token (runtime/execution/ort_quant.py),
and their outlier channels are what costs accuracy. The same search then scores
||x W - R(x / s) Q(W s)||^2 with R that per-token rounding, over AWQ's candidates and SmoothQuant's
s = max|x|^a / max|W[k, :]|^(1-a), which moves the activations' outliers into the weights' rows.
int4 blocks run so in the large steps under weight_matmul_accuracy "int8",
where the runtime re-rounds them to per-channel int8 codes (ort_quant.blocks_to_int8_channel):
Q is then that re-rounding of the int4 blocks, as served. NOTE: R rounds to 8 bits (127 steps
a side) whatever CPU serves the build; where u8 x s8 saturates the runtime rounds to 7
(ort_quant.ACT_QMAX). Measured (smollm2, King Lear, AMD EPYC with AVX2 only, so 7 bits): int4
smoothquant under "int8" 66.78 against fp32 54.62 (rtn int4 under "int8": 61.79) — an option,
not a default (exporter/limits.py DEFAULT_WEIGHT_FORM).

NOTE: the activations are captured with forward pre-hooks on transformers' llama-style modules
(q_proj, gate_proj, down_proj); other module layouts are refused by name (ConfigError).
"""

from __future__ import annotations

import copy
import logging

import numpy as np

from kvexport.errors import ConfigError

from . import quantize as qz

log = logging.getLogger(__name__)

ALPHAS = tuple(np.linspace(0.0, 1.0, 11))  # alpha grid; 0 is plain round-to-nearest
SEARCH = {"awq": "s = mean|x|^alpha, weight rounding error",
          "smoothquant": "s = mean|x|^alpha or max|x|^alpha / max|W|^(1 - alpha), weight and per-token int8 "
                         "activation rounding error"}
MAX_ROWS = 512  # calibration activation rows kept per matmul (memory/time bound)
HOOKS = {"attn.qkv": "self_attn.q_proj", "mlp.up": "mlp.gate_proj", "mlp.down": "mlp.down_proj"}


def _capture(model, ids: list[int], chunk: int = 512) -> dict[str, np.ndarray]:
    """graph name -> calibration inputs [rows, K] (every `stride`-th token, at most MAX_ROWS)."""
    import torch

    layers = model.model.layers
    acts: dict[str, list] = {}
    handles = []
    for i, layer in enumerate(layers):
        for short, path in HOOKS.items():
            mod = layer
            for part in path.split("."):
                mod = getattr(mod, part, None)
                if mod is None:
                    raise ConfigError(f"--quant-method awq needs llama-style modules ({', '.join(HOOKS.values())}); "
                                      f"{type(layer).__name__} has no {path}: use --quant-method rtn")
            name = f"model.layers.{i}.{short}.weight"
            acts[name] = []
            handles.append(mod.register_forward_pre_hook(
                lambda _m, args, name=name: acts[name].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())))
    try:
        with torch.no_grad():
            cache = None
            for start in range(0, len(ids), chunk):
                cache = model(torch.tensor([ids[start:start + chunk]]), cache=cache, use_cache=True).cache
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, xs in acts.items():
        x = torch.cat(xs).numpy()
        stride = max(1, len(x) // MAX_ROWS)
        out[name] = np.ascontiguousarray(x[::stride][:MAX_ROWS])
    return out


def int8_rows(x: np.ndarray) -> np.ndarray:
    """x rounded as the runtime's dynamic int8 matmul rounds it: symmetric, one scale per row."""
    step = np.maximum(np.abs(x).max(axis=1, keepdims=True) / 127, 1e-12)
    return np.round(x / step) * step


def best_scale(x: np.ndarray, w: np.ndarray, bits: int, block: int,
               int8_activations: bool = False) -> tuple[np.ndarray, float, float]:
    """(s [K], alpha, relative output error) minimizing ||x w - R(x / s) Q(w s)||^2, R the
    identity, or with `int8_activations` the per-token int8 rounding (SmoothQuant's candidates too;
    block-wise Q then also re-rounds per channel, as those steps are served)."""
    from kvexport.runtime.execution.ort_quant import int8_channel

    mean = np.abs(x).mean(axis=0) + 1e-8  # [K]
    candidates = [(mean ** a, a) for a in ALPHAS]
    if int8_activations:
        amax, wmax = np.abs(x).max(axis=0) + 1e-8, np.abs(w).max(axis=1) + 1e-8
        candidates += [(amax ** a / wmax ** (1 - a), a) for a in ALPHAS[1:]]
    ref = x @ w
    norm = float((ref ** 2).sum()) + 1e-30
    best = (np.ones(w.shape[0], np.float32), 0.0, np.inf)
    for s, alpha in candidates:
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        deq = qz.quantize_rtn(w * s[:, None], bits, block).dequantize()
        if int8_activations and block != qz.CHANNEL:  # as served: re-rounded per channel (module docstring)
            q, step, z = int8_channel(deq)
            deq = (q - z) * step
        xs = x / s
        err = float((((int8_rows(xs) if int8_activations else xs) @ deq - ref) ** 2).sum()) / norm
        if err < best[2]:
            best = (s, float(alpha), err)
    return best


def search(model, weights, spec, wq: qz.WeightQuantization, ids: list[int]):
    """(ModelWeights with the inverse scales folded in, name -> s [K], alpha per matmul)."""
    acts = _capture(model, ids)
    w = copy.copy(weights)
    w.layers = [copy.copy(lw) for lw in weights.layers]
    scales, alphas = {}, {}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        for short, attr in (("attn.qkv", "qkv_w"), ("mlp.up", "up_w"), ("mlp.down", "down_w")):
            if short == "mlp.down" and not spec.gated_mlp:
                continue  # the activation function sits between up and down: nothing to fold into
            s, alpha, _ = best_scale(acts[p + short + ".weight"], getattr(lw, attr), wq.bits, wq.block_size,
                                     int8_activations=wq.method == "smoothquant")
            if np.all(s == 1):
                continue
            scales[p + short + ".weight"], alphas[p + short + ".weight"] = s, alpha
            if short == "attn.qkv":
                lw.ln1_w = lw.ln1_w / s
                lw.ln1_b = None if lw.ln1_b is None else lw.ln1_b / s
            elif short == "mlp.up":
                lw.ln2_w = lw.ln2_w / s
                lw.ln2_b = None if lw.ln2_b is None else lw.ln2_b / s
            else:  # down: divide the up half of gate|up (its output columns) by s
                inter = spec.intermediate_size
                lw.up_w = lw.up_w.copy()
                lw.up_w[:, inter:] /= s
                if lw.up_b is not None:
                    lw.up_b = lw.up_b.copy()
                    lw.up_b[inter:] /= s
    return w, scales, alphas
