"""MXFP4 checkpoints (config.json `quantization_config: {"quant_method": "mxfp4"}`, as
openai/gpt-oss-20b / -120b ship their experts): the packed codes dequantized exactly to float32
when the weights are read, and the float transformers model (validation's reference, and what
exporter/moe.py read_experts reads the experts from) loaded with exactly those values. No MXFP4
kernel (triton_kernels / the `kernels` package) is used, nor needed, on any machine.

On disk, per expert projection `P` of layer i (P = gate_up_proj | down_proj, under
model.layers.{i}.mlp.experts.):

    P_blocks  uint8 [E, out, in / 32, 16]   32 e2m1 codes per block, two per byte, low nibble first
    P_scales  uint8 [E, out, in / 32]       one e8m0 exponent per block: 2 ** (s - 127)
    P_bias    float [E, out]                (not quantized, read as is)

    W[e, o, 32 b + j] = FP4_VALUES[code j of block b] * 2 ** (scale[e, o, b] - 127)

and transformers' state dict stores P as [E, in, out] (the transpose): gate_up_proj [E, H, 2I]
(gate and up interleaved, read apart by moe.py), down_proj [E, I, H].

NOTE (exact): an e2m1 value (at most 2 significant bits) times a power of two is exact in float32
for every scale up to 252 (2 ** -127 .. 2 ** 125; the smallest ones are float32 subnormals, still
exact); real checkpoints' scales lie near 127. 255 is e8m0's NaN and refused. transformers' own
dequantization (transformers.integrations.mxfp4.convert_moe_packed_tensors: the same table, low
nibble first, ldexp) gives the same numbers (tests/exporter/test_mxfp4.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import numpy as np

from kvexport.errors import SourceError

log = logging.getLogger(__name__)

QUANT_METHOD = "mxfp4"  # quantization_config.quant_method read here
BLOCK = 32  # elements per scale
SCALE_BIAS = 127  # e8m0: 2 ** (s - 127)
SCALE_NAN = 255  # e8m0's NaN encoding
# e2m1 code -> value (codes 8..15: the same magnitudes, negative)
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
PACKED = ("_blocks", "_scales")  # suffixes of a packed projection's tensors


def quant_method(directory: Path) -> str | None:
    """quantization_config.quant_method of an HF folder's config.json (lower case), or None."""
    try:
        qc = json.loads((Path(directory) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # source.py reports unreadable configs by name
    return str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else None


def applies(directory: Path) -> bool:
    return quant_method(directory) == QUANT_METHOD


def dequantize(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor") -> np.ndarray:
    """uint8 blocks [..., G, 16] and scales [..., G] -> float32 [..., G * 32], in stored order
    (not transposed). SourceError naming `name` when the shapes do not pair or a scale is NaN."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[-1] != BLOCK // 2 \
            or blocks.shape[:-1] != scales.shape:
        raise SourceError(f"{name}_blocks {blocks.dtype}{list(blocks.shape)} and {name}_scales "
                          f"{scales.dtype}{list(scales.shape)} are not MXFP4 (uint8 [..., G, 16] codes with uint8 "
                          f"[..., G] scales); the checkpoint does not match its quantization_config")
    if (scales == SCALE_NAN).any():
        raise SourceError(f"{name}_scales holds the e8m0 NaN scale ({SCALE_NAN}); the checkpoint is corrupt: "
                          f"download it again")
    codes = np.stack([blocks & 0xF, blocks >> 4], axis=-1)  # [..., G, 16, 2]: low nibble first
    values = FP4_VALUES[codes].reshape(*scales.shape, BLOCK)  # [..., G, 32]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - SCALE_BIAS)
    return values.reshape(*scales.shape[:-1], -1)  # [..., G * 32]


def expert_weight(blocks: np.ndarray, scales: np.ndarray, name: str) -> np.ndarray:
    """An expert projection as transformers' state dict holds it: [E, out, in] stored -> [E, in, out]."""
    w = dequantize(blocks, scales, name)  # [E, out, in]
    return np.ascontiguousarray(w.transpose(0, 2, 1))


def read_checkpoint(directory: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(state-dict name, array) of every tensor of the folder's safetensors, float32 where floating,
    each packed projection (`P_blocks` + `P_scales`, in any shard) as its dequantized weight `P`;
    one tensor in memory at a time (beside a packed half waiting for its pair)."""
    from safetensors import safe_open

    waiting: dict[str, np.ndarray] = {}  # one half of a packed pair, until the other is read
    packed = 0
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:  # pt: bf16 tensors too
            for key in fh.keys():
                t = fh.get_tensor(key)
                a = t.float().numpy() if t.is_floating_point() else t.numpy()
                suffix = next((x for x in PACKED if key.endswith(x)), None)
                if suffix is None:
                    yield key, a
                    continue
                stem, pair_suffix = key[: -len(suffix)], PACKED[1 - PACKED.index(suffix)]
                if stem + pair_suffix not in waiting:
                    waiting[key] = a
                    continue
                pair = {suffix: a, pair_suffix: waiting.pop(stem + pair_suffix)}
                packed += 1
                yield stem, expert_weight(pair[PACKED[0]], pair[PACKED[1]], stem)
    if waiting:
        key = sorted(waiting)[0]
        stem = next(key[: -len(x)] for x in PACKED if key.endswith(x))
        lacking = stem + (PACKED[1] if key.endswith(PACKED[0]) else PACKED[0])
        raise SourceError(f"{key} has no {lacking}; the checkpoint is incomplete: download it again")
    if not packed:
        raise SourceError(f"{directory}: config.json says quant_method {QUANT_METHOD!r} but no *_blocks tensor is "
                          f"in its safetensors files; the checkpoint does not match its config")


def load_model(src):
    """The transformers model (float32, eval) whose experts hold the checkpoint's MXFP4 codes
    dequantized exactly; the quantization_config is dropped, so transformers builds plain float
    experts and no kernel is involved. Each tensor is copied into the model as it is read (peak
    memory: the float32 model and one tensor). SourceError when the tensors do not match the config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src.directory, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = model.state_dict()  # shares the parameters' storage
    loaded, unexpected = set(), []
    with torch.no_grad():
        for name, value in read_checkpoint(src.directory):
            if name not in params:
                unexpected.append(name)
                continue
            if tuple(params[name].shape) != value.shape:
                raise SourceError(f"the MXFP4 checkpoint {src.name} does not match its {config.model_type} config: "
                                  f"{name} is {list(value.shape)}, the config needs {list(params[name].shape)}")
            params[name].copy_(torch.from_numpy(value))
            loaded.add(name)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(params) - loaded - tied)
    if missing or unexpected:
        raise SourceError(f"the MXFP4 checkpoint {src.name} does not match its {config.model_type} config: "
                          f"missing {missing[:5]}, unexpected {sorted(unexpected)[:5]}")
    if tied:
        model.tie_weights()
    log.info("%s: MXFP4 expert projections dequantized exactly for the reference model", src.name)
    return model.eval()
