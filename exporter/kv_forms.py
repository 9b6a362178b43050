"""The KV forms a build can store its cache in: one table (`KV_FORMS`) of entries, each a KV dtype
for standard attention (K and V pools) or for multi-head latent attention (one latent pool,
exporter/mla.py), saying what the model must allow, what is calibrated (and how), and the note
the manifest carries. The build's "KV form" stage (`kv_constants`) runs the entry's calibration;
a new KV form is one entry here (+ its graph code and its choice in limits.KV_DTYPES).

    (kv dtype, latent) ─> KVForm ─ refusal(spec)      why a model cannot take it (None: it can)
                                 ─ calibrate(run)      -> KVConstants (scales | key offsets, kv.quantization)
                                 ─ note                the manifest's words for it
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvexport import io
from kvexport.errors import ConfigError, KvExportError

from . import calibrate, gemma4, mla
from .progress import Progress
from .spec import ModelSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class KVConstants:
    """What a KV form's calibration gives the graphs and the manifest."""

    # int8: [KV layers, 2, kv_heads, head_dim] (MLA: [layers, L + R]) float32; KV layers: spec.kv_layers, every
    # layer but a hybrid's linear ones (they hold recurrent state, no KV)
    scales: np.ndarray | None = None
    offsets: np.ndarray | None = None  # int4: the calibrated key transform's arrays per KV layer (exporter/kv_int4.py)
    quantization: dict | None = None  # the manifest's kv.quantization; None: a float cache


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """One calibration run's inputs: the model (transformers, float32) and the token ids of the text."""

    model: Any  # the transformers model
    spec: ModelSpec
    ids: list[int]  # calibration tokens
    text: str  # the text's file name, or "random-ids" (models without a tokenizer)


@dataclass(frozen=True, slots=True, kw_only=True)
class KVForm:
    dtype: io.DType  # the KV-cache dtype (`--kv-dtype`)
    latent: bool = False  # MLA's latent pool (exporter/mla.py) rather than K and V pools
    # why a model cannot take this form, in words that say what to do (None: it can)
    refusal: Callable[[ModelSpec], str | None] = lambda spec: None
    step: str | None = None  # the calibration step's name (progress); None: nothing is calibrated
    calibrate: Callable[[Calibration], KVConstants] | None = None
    note: str | None = None  # the manifest's note on this form

    @property
    def calibrated(self) -> bool:
        return self.calibrate is not None


def _int4_head_dim(spec: ModelSpec) -> str | None:
    if spec.head_dim % io.KV_INT4_GROUP:
        return (f"--kv-dtype int4 needs head_dim a multiple of {io.KV_INT4_GROUP} (its channels share a scale in "
                f"groups of {io.KV_INT4_GROUP}); this model's head_dim is {spec.head_dim}: use --kv-dtype int8 or fp32")
    return None


def _int8(c: Calibration) -> KVConstants:  # a row per KV layer (a hybrid: its attention layers)
    scales = calibrate.compute_scales(c.model, c.ids, rotary_dim=c.spec.rotary_dim if c.spec.rope else 0)
    if len(scales) != len(c.spec.kv_layers):
        raise KvExportError(f"transformers' cache of this {c.spec.model_type} model holds keys for {len(scales)} "
                            f"layers, the spec {len(c.spec.kv_layers)} (spec.kv_layers): cannot place its int8 KV "
                            f"scales; build with --kv-dtype fp32")
    layers = calibrate.constant_layers(c.spec.kv_layers, c.spec.num_layers)
    return KVConstants(scales=scales, quantization=calibrate.quantization_entry(scales, c.text, c.ids, layers))


def _int8_latent(c: Calibration) -> KVConstants:  # one scale row [L + R] per layer
    scales = mla.calibrate_latent(c.model, c.ids, c.spec)
    return KVConstants(scales=scales, quantization=mla.quantization_entry(scales, c.text, c.ids))


def _int4(c: Calibration) -> KVConstants:  # dynamic scales; calibrated: the key transform (exporter/kv_int4.py)
    # NOTE: the call `kvexport calibrate` makes (μ only for plain softmax attention: key_offset_layers)
    offsets, transform = calibrate.int4_key_transform(c.model, c.spec, c.ids, c.text)
    return KVConstants(offsets=offsets, quantization={
        "scheme": io.KV_INT4_FORMAT, "group": io.KV_INT4_GROUP, "rotation": "hadamard",
        "row_bytes": io.kv_row_width(c.spec.head_dim, "int4"), "key_transform": transform})


_INT8_NOTE = ("int8 KV: static symmetric scales per layer and KV head (kv.quantization); QuantizeLinear on write, "
              "DequantizeLinear on read")
_INT4_NOTE = (f"int4 KV: {io.KV_INT4_FORMAT} (kv.quantization): 4-bit codes with a float16 scale per token, KV head "
              f"and {io.KV_INT4_GROUP} channels in the pool rows; q, k, v Hadamard-rotated")

KV_FORMS: tuple[KVForm, ...] = (
    KVForm(dtype=io.DType.FP32),
    KVForm(dtype=io.DType.FP16),
    KVForm(dtype=io.DType.INT8, refusal=lambda s: gemma4.kv_refusal(s, "int8"), step="calibrating int8 KV scales",
           calibrate=_int8, note=_INT8_NOTE),
    KVForm(dtype=io.DType.INT4, refusal=lambda s: gemma4.kv_refusal(s, "int4") or _int4_head_dim(s),
           step="calibrating the int4 KV key transform",
           calibrate=_int4, note=_INT4_NOTE),
    KVForm(dtype=io.DType.FP32, latent=True),
    KVForm(dtype=io.DType.FP16, latent=True),
    KVForm(dtype=io.DType.BF16, latent=True),
    KVForm(dtype=io.DType.INT8, latent=True, step="calibrating int8 latent KV scales", calibrate=_int8_latent,
           note=_INT8_NOTE),
)


def kv_form(kv_dtype: io.DType, spec: ModelSpec) -> KVForm:
    """The table's entry for `kv_dtype` on this model; ConfigError naming the option when the
    model cannot take it (MLA: the latent forms only)."""
    latent = spec.mla is not None
    form = next((f for f in KV_FORMS if f.dtype is kv_dtype and f.latent == latent), None)
    if form is None:
        kinds = [f.dtype.value for f in KV_FORMS if f.latent == latent]
        what = f"multi-head latent attention ({spec.family})" if latent else "this model"
        raise ConfigError(f"--kv-dtype {kv_dtype.value} is not implemented for {what}; use --kv-dtype "
                          f"{', '.join(kinds[:-1])} or {kinds[-1]}")
    if (why := form.refusal(spec)) is not None:
        raise ConfigError(why)
    return form


def allows(kv_dtype: io.DType, spec: ModelSpec) -> bool:
    """Whether the model can take `kv_dtype` (an entry for it, and no refusal)."""
    latent = spec.mla is not None
    return any(f.dtype is kv_dtype and f.latent == latent and f.refusal(spec) is None for f in KV_FORMS)


def kv_constants(form: KVForm, model, spec: ModelSpec, tokenizer, text: str | None, tokens: int,
                 progress: Progress) -> KVConstants:
    """The "KV form" stage: run the form's calibration on `text` (None: the bundled Hamlet; no
    tokenizer: random ids) for `tokens` tokens; a float form calibrates nothing."""
    if not form.calibrated:
        return KVConstants()
    path = Path(text) if text else None
    if tokenizer is not None and path is None:
        path = calibrate.default_text(why=f"--kv-dtype {form.dtype.value} calibrates on a text")
    ids = calibrate.calibration_ids(tokenizer, spec.vocab_size, path, tokens)
    with progress(form.step):
        out = form.calibrate(Calibration(model=model, spec=spec, ids=ids, text=path.name if path else "random-ids"))
    calibrate.check_finite({"scales": out.scales, "offsets": out.offsets}, f"{form.dtype.value} KV constants",
                           path.name if path else "random-ids")
    return out
