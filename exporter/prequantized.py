"""Pre-quantized Hugging Face checkpoints (config.json `quantization_config` of AWQ or GPTQ):
their packed integer codes read straight from the safetensors files and mapped exactly onto the
build's block-wise codes (exporter/quantize.py QuantizedMatrix), with no float round trip; and the
float model transformers validates against, loaded with exactly those codes dequantized (the
autoawq / gptqmodel kernels transformers would need are not used, nor needed).

On disk, per quantized nn.Linear [out=N, in=K] (`prefix.qweight`, `.qzeros`, `.scales`, `.g_idx`):

    AWQ (autoawq, format "gemm"):  qweight int32 [K, N/8]   8 codes of 4 bits along N, nibble i of
                                                            word c holding column 8c + AWQ_ORDER[i]
                                   qzeros  int32 [K/G, N/8] the same packing
                                   scales  fp16  [K/G, N]
                                   W[k, n] = (q - z) * s                       (z: 0..15)
    GPTQ (auto-gptq / gptqmodel):  qweight int32 [K*b/32, N] 32/b codes of b bits along K, low first
                                   qzeros  int32 [K/G, N*b/32] 32/b codes along N, low first
                                   scales  fp16  [K/G, N];  g_idx int32 [K] (group of each k)
                                   W[k, n] = (q - z) * s[g_idx[k]]             format "gptq" (v1)
                                   stores z - 1; "gptq_v2" stores z

and ours is (q' - zp') * s with q' = q - 2^(b-1), zp' = z - 2^(b-1) (signed int4/int8), which is
the same integer difference, so every weight is bit-identical (the product of a code difference
and an fp16 scale is exact in float32). A checkpoint whose zero points all equal 2^(b-1) (GPTQ
sym=True) becomes symmetric codes without zero points.

group_size -1 (one scale per output column) maps onto per-channel codes (quantize.py CHANNEL).

Refused, with what to do (ConfigError): bits other than 4 (AWQ) / 4, 8 (GPTQ); group sizes that
are not a build block size (exporter/limits.py WEIGHT_BLOCK_SIZES); AWQ formats other than gemm
(gemv / gemv_fast / llm-awq pack differently) or without zero points; GPTQ act-order (desc_act)
whose g_idx is not the plain k // G (its groups are not blocks of consecutive k); a v1 zero point
of 2^b (v1 cannot store zero 0; its kernels read 16, which no 4-bit zero point holds).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvexport.errors import ConfigError, SourceError

from . import quantize as qz
from .limits import WEIGHT_BLOCK_SIZES

log = logging.getLogger(__name__)

METHODS = ("awq", "gptq")  # quantization_config.quant_method values read here (mxfp4: exporter/mxfp4.py)
# every quant_method kvexport reads, and the model types each applies to (None: any); others are refused
# (check_method): transformers' kernels for them (bitsandbytes, fp8, compressed-tensors...) would leave
# packed tensors, not the float weights the graphs are built from
READ_METHODS = {"awq": None, "gptq": None, "mxfp4": ("gpt_oss",)}
AWQ_FORMATS = ("gemm",)
GPTQ_FORMATS = ("gptq", "gptq_v2")
BITS = {"awq": (4,), "gptq": (4, 8)}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
# graph matmul name -> alternatives of the checkpoint's module suffixes fused into it (in order)
HF_PARTS = {"attn.qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.qkv_proj",)),
            "attn.o": (("self_attn.o_proj",),),
            "mlp.up": (("mlp.gate_proj", "mlp.up_proj"), ("mlp.gate_up_proj",)),
            "mlp.down": (("mlp.down_proj",),)}


@dataclass(frozen=True, slots=True)
class Prequantized:
    """A checkpoint's quantization_config, checked (ConfigError names the field otherwise)."""

    method: str  # "awq" | "gptq"
    bits: int  # 4 (AWQ); 4 | 8 (GPTQ)
    group_size: int  # consecutive input features (K) per scale/zero point: the build's block size (0: all K)
    format: str  # "gemm" (AWQ) | "gptq" (v1: zero points stored minus 1) | "gptq_v2"
    desc_act: bool = False  # GPTQ act-order: accepted only with a plain g_idx (checked per matrix)

    @property
    def origin(self) -> str:
        """QuantizedMatrix.origin of matrices read from such a checkpoint."""
        return f"{self.method}:{self.format}"

    @property
    def flags(self) -> str:
        return f"--weights int{self.bits} --weight-block-size {self.group_size or 'channel'}"

    def to_json(self) -> dict:
        return {"method": self.method, "format": self.format, "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.desc_act}


def parse(qc: dict, where: str = "config.json") -> Prequantized | None:
    """A `quantization_config` dict -> Prequantized; None for methods not read here."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        return None
    field = f"{where} quantization_config"
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits not in BITS[method]:
        raise ConfigError(f"{field}.bits is {bits!r}; kvexport maps {method.upper()} checkpoints of "
                          f"{' or '.join(map(str, BITS[method]))} bits exactly: use one of those, or a float "
                          f"checkpoint")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if isinstance(group, bool) or group not in (-1,) + tuple(b for b in WEIGHT_BLOCK_SIZES if b):
        raise ConfigError(f"{field}.group_size is {group!r}; the build's blocks are -1 (per channel) or one of "
                          f"{', '.join(str(b) for b in WEIGHT_BLOCK_SIZES if b)} input features: use a checkpoint "
                          f"quantized with one of those, or a float checkpoint")
    group = qz.CHANNEL if group == -1 else group  # -1: one scale per output column, over all of K
    if method == "awq":
        fmt = str(qc.get("version", qc.get("format", "gemm"))).lower()
        if str(qc.get("backend", "")).lower() == "llm-awq":
            fmt = "llm-awq"
        if fmt not in AWQ_FORMATS:
            raise ConfigError(f"{field}.version (format) is {fmt!r}; only AWQ {', '.join(AWQ_FORMATS)} packing "
                              f"is read (gemv, gemv_fast and llm-awq order codes differently): re-export the "
                              f"checkpoint with AutoAWQ version 'gemm'")
        if qc.get("zero_point", True) is not True:
            raise ConfigError(f"{field}.zero_point is {qc.get('zero_point')!r}; only AWQ with zero points "
                              f"(zero_point: true, AutoAWQ's gemm default) is read")
        return Prequantized("awq", bits, group, fmt)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in GPTQ_FORMATS:
        raise ConfigError(f"{field}.checkpoint_format is {fmt!r}; GPTQ {', '.join(GPTQ_FORMATS)} are read "
                          f"(marlin, bitblas... repack the codes): save the checkpoint in gptq format")
    return Prequantized("gptq", bits, group, fmt, bool(qc.get("desc_act", False)))


def check_method(cfg: dict, where: str = "config.json") -> None:
    """ConfigError, before any weight is read, for a `quantization_config` kvexport cannot read:
    its quant_method not one of READ_METHODS (or not for this model_type), named with the values
    that are read and what to do."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else None
    supported = ", ".join(m + (f" ({'/'.join(t)} models)" if t else "") for m, t in READ_METHODS.items())
    if method not in READ_METHODS:
        raise ConfigError(f"{where} field 'quantization_config.quant_method' is "
                          f"{(qc.get('quant_method') if isinstance(qc, dict) else qc)!r}, which kvexport does not "
                          f"read; supported values: {supported}. Build from the float checkpoint (and pass "
                          f"--weights int8|int4 to quantize it)")
    types = READ_METHODS[method]
    if types is not None and cfg.get("model_type") not in types:
        raise ConfigError(f"{where} field 'quantization_config.quant_method' is {method!r}, which kvexport reads "
                          f"only for {', '.join(types)} models, not {cfg.get('model_type')!r}; supported values: "
                          f"{supported}. Build from the float checkpoint")


def config_of(directory: Path) -> Prequantized | None:
    """The Prequantized of an HF folder's config.json, or None (no config, or not AWQ/GPTQ)."""
    p = Path(directory) / "config.json"
    try:
        qc = json.loads(p.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # source.py reports unreadable configs by name
    return parse(qc) if isinstance(qc, dict) else None


# ---- unpacking ----------------------------------------------------------------------------
def _words(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).astype(np.int32, copy=False).view(np.uint32)


def unpack_along_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [R, N], 32/b codes per word along rows, low bits first -> uint8 [R * 32/b, N]."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    codes = (_words(packed)[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)  # [R, per, N]
    return codes.reshape(-1, packed.shape[1]).astype(np.uint8)


def unpack_along_cols(packed: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """int32 [R, C], 32/b codes per word along columns -> uint8 [R, C * 32/b]; `order[i]` is the
    column (of the word's 32/b) that its i-th code holds (None: i)."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    codes = (_words(packed)[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)  # [R, C, per]
    if order is not None:
        codes = codes[:, :, np.argsort(order)]  # column j of a word is its code argsort(order)[j]
    return codes.reshape(packed.shape[0], -1).astype(np.uint8)


def read_matrix(pq: Prequantized, t: dict[str, np.ndarray], name: str) -> qz.QuantizedMatrix:
    """One quantized linear's tensors (`qweight`, `qzeros`, `scales`, `g_idx`) -> QuantizedMatrix
    [K, N]; ConfigError for what does not map exactly (the message names the tensor)."""
    b = pq.bits
    scales = np.asarray(t["scales"]).astype(np.float32)  # [K/G, N], from fp16/bf16/fp32: exact
    if pq.method == "awq":
        q = unpack_along_cols(t["qweight"], b, AWQ_ORDER)  # [K, N]
        z = unpack_along_cols(t["qzeros"], b, AWQ_ORDER).astype(np.int16)  # [K/G, N]
        g = pq.group_size or q.shape[0]
    else:
        q = unpack_along_rows(t["qweight"], b)  # [K, N]
        g = pq.group_size or q.shape[0]
        z = unpack_along_cols(t["qzeros"], b).astype(np.int16)  # [K/G, N]
        if pq.format == "gptq":  # v1 stores z - 1
            z = z + 1
            if (z >= 1 << b).any():
                raise ConfigError(f"{name}.qzeros holds a GPTQ v1 zero point of {1 << b} (stored {(1 << b) - 1}), "
                                  f"which no {b}-bit zero point holds; re-save the checkpoint with "
                                  f"checkpoint_format gptq_v2")
        g_idx = t.get("g_idx")
        k = q.shape[0]
        if g_idx is not None and not np.array_equal(np.asarray(g_idx).astype(np.int64), np.arange(k) // g):
            raise ConfigError(f"{name}.g_idx is not k // group_size (GPTQ desc_act / act-order reorders input "
                              f"features, so its groups are not blocks of consecutive ones): re-quantize with "
                              f"desc_act false, or build from the float checkpoint with --weights int{b}")
    k, n = q.shape
    if scales.shape != (k // g, n) or z.shape != scales.shape or k % g:
        raise SourceError(f"{name}: qweight {tuple(t['qweight'].shape)}, qzeros {tuple(t['qzeros'].shape)} and "
                          f"scales {tuple(scales.shape)} do not fit {pq.method.upper()} {b}-bit packing with "
                          f"group_size {pq.group_size or -1}; the checkpoint does not match its quantization_config")
    mid = 1 << (b - 1)
    codes = (q.astype(np.int16) - mid).astype(np.int8)  # signed, same differences
    zp = None if (z == mid).all() else (z - mid).astype(np.int8)
    return qz.QuantizedMatrix(codes, scales, b, pq.group_size, zp, origin=pq.origin)


# ---- the checkpoint -----------------------------------------------------------------------
QUANT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")  # per quantized linear, `prefix.<name>`


def _tensors(directory: Path, quantized_only: bool = False) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:  # pt: bf16 tensors too
            for key in fh.keys():
                if quantized_only and key.rsplit(".", 1)[-1] not in QUANT_TENSORS:
                    continue
                t = fh.get_tensor(key)
                out[key] = t.float().numpy() if t.is_floating_point() else t.numpy()
    return out


def read_checkpoint(directory: Path, pq: Prequantized, quantized_only: bool = False
                    ) -> tuple[dict[str, qz.QuantizedMatrix], dict[str, np.ndarray]]:
    """(module prefix -> QuantizedMatrix [K, N] of every quantized linear, every other tensor
    in float32 by its state-dict name; none with quantized_only)."""
    tensors = _tensors(directory, quantized_only)
    prefixes = sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))
    if not prefixes:
        raise SourceError(f"{directory}: config.json says {pq.method.upper()} but no *.qweight tensor is in its "
                          f"safetensors files; the checkpoint does not match its config")
    mats = {}
    for p in prefixes:
        parts = {s: tensors.pop(f"{p}.{s}") for s in QUANT_TENSORS if f"{p}.{s}" in tensors}
        missing = {"qweight", "qzeros", "scales"} - set(parts)
        if missing:
            raise SourceError(f"{p} lacks {', '.join(sorted(missing))}; the checkpoint is incomplete")
        mats[p] = read_matrix(pq, parts, p)
    return mats, tensors


def load_model(src, pq: Prequantized):
    """The transformers model (float32, eval) whose linears hold the checkpoint's codes
    dequantized exactly; the quantization_config is dropped, so no kernel package is needed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src.directory, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    mats, sd = read_checkpoint(src.directory, pq)
    for p, m in mats.items():
        sd[p + ".weight"] = np.ascontiguousarray(m.dequantize().T)  # [N, K] as nn.Linear stores it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise SourceError(f"the {pq.method.upper()} checkpoint {src.name} does not match its {config.model_type} "
                          f"config: missing {missing[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}")
    if tied:
        model.tie_weights()
    log.info("%s: %d %s-bit %s matrices dequantized exactly for the reference model", src.name, len(mats),
             pq.bits, pq.origin)
    return model.eval()


def presets(src, spec, pq: Prequantized, wq: qz.WeightQuantization) -> dict[str, qz.QuantizedMatrix]:
    """Graph name -> the checkpoint's codes for every fused decoder matmul (exporter/quantize.py
    LINEARS) whose parts are all quantized in it; the rest are rounded by the caller. ConfigError
    when the build's bits / block size differ from the checkpoint's (that would re-quantize)."""
    if wq.method != "rtn":
        raise ConfigError(f"{src.name} is already {pq.method.upper()}-quantized; drop --quant-method {wq.method} "
                          f"(its codes are used as they are)")
    if (wq.bits, wq.block_size) != (pq.bits, pq.group_size):
        raise ConfigError(f"{src.name} holds {pq.bits}-bit codes in groups of {pq.group_size or 'all K'}, not "
                          f"{wq.precision} blocks of {wq.block_size or 'all K'}: pass {pq.flags} to keep them "
                          f"exactly, or --weights fp32/fp16 to build from their dequantized values")
    mats, _ = read_checkpoint(src.directory, pq, quantized_only=True)
    out = {}
    for i in range(spec.num_layers):
        for short, alternatives in HF_PARTS.items():
            for parts in alternatives:
                found = [mats.get(f"model.layers.{i}.{s}") for s in parts]
                if all(m is not None for m in found):
                    out[f"model.layers.{i}.{short}.weight"] = qz.concat_columns(found)
                    break
    return out
