"""The build manifest (`kvexport.json`): the typed schema every part reads. The exporter writes
it last, so a directory with a valid manifest is a complete build; everything downstream loads
it through `load()` and never guesses, and nobody reads it by string keys.

    Manifest ─ model: ModelEntry        (the exporter's ModelSpec, whole, with typed reads)
             ─ kv: KVSpec               (layout, attention, KV dtype and sizes)
             ─ graphs: {phase: GraphEntry}   (file + io.TensorSpec inputs/outputs)
             ─ weights: WeightsEntry    ─ validation: ValidationEntry | None
                   ─ quantization: WeightQuantizationEntry | None  (int8/int4: manifest_weights.py)
             ─ engines: EnginesEntry | None  (TensorRT engines: files, limits, GPU; manifest_engines.py)

`Manifest.from_json` checks every field's type and refuses unknown ones (ManifestError naming
the field, e.g. 'engines.limits.max_num_seqs'); `to_json()` gives back exactly what it read.
`load()` also checks the files the manifest lists, and the kv spec against the graphs' I/O
(kvexport/graph_check.py).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__, graph_check, io, outputs
from .decode import Words, decode, got
from .errors import ManifestError
from .manifest_engines import (EngineBuildOptions, EngineFile, EngineLimits, EnginesEntry, GpuInfo, PluginInfo,
                               ShapeRange)
from .manifest_weights import CalibrationEntry, QuantizedMatrices, QuantizedTable, WeightQuantizationEntry

__all__ = ["CalibrationEntry", "EngineBuildOptions", "EngineFile", "EngineLimits", "EnginesEntry", "GpuInfo",
           "GraphEntry", "KVSpec", "Manifest", "ModelEntry", "NativeOpValidation", "OpCheck", "PluginInfo",
           "QuantizedMatrices", "QuantizedTable", "ShapeRange", "ValidationEntry", "WeightQuantizationEntry",
           "WeightsEntry", "load", "missing_tokenizer", "model_source_refusal", "sha256", "versions"]

REBUILD = "rebuild with `kvexport build --force`"
REBUILD_ENGINES = "rebuild the engines with `kvexport engines BUILD_DIR`"
# how a validation ran the graphs' attention: standard ops, the native CPU PagedAttention op,
# the float64 reference op (exporter/validate.py)
VALIDATION_OPS = ("onnx", "native", "reference")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVSpec:
    layout: str  # io.KVLayout value
    attention: str  # io.Attention value
    dtype: str  # io.DType value of the cache
    block_size: int  # tokens per block (paged); 0 for contiguous
    num_layers: int  # layers with a KV cache
    num_kv_heads: int  # KV heads per layer
    head_dim: int  # elements per head
    bytes_per_token: int  # io.kv_bytes_per_token(...), bytes
    max_seq_len: int  # longest context (prompt + output) the build serves, tokens
    quantization: dict | None = None  # int8 KV: scheme, calibration, scales [layers][k, v][kv_heads][head_dim]
    # (per-head schemes, builds before per-channel scales: [layers][k, v][kv_heads])
    # paged builds of models with full-attention and windowed layers: the windowed layers' KV is
    # its own cache group (io.LOCAL_GROUP; layers io.kv_groups(model.layer_windows)) whose blocks
    # behind this window (tokens, the largest of those layers') are released; None: one group
    # NOTE: left out of the JSON when None, so one-group manifests stay exactly as before it existed
    local_window: int | None = field(default=None, metadata={"omit_if_none": True})
    # MLA builds (DeepSeek-V2/V3, io.py "MLA"): the model's kv_lora_rank; each layer then has ONE
    # latent pool, num_kv_heads is 1 and head_dim the row width kv_lora_rank + qk_rope_head_dim.
    # None: K and V pools. NOTE: left out of the JSON when None (older manifests stay as they were)
    latent_rank: int | None = field(default=None, metadata={"omit_if_none": True})
    # True: the paged graphs take io.OBSERVATION_LENS and return io.attention_scores(i) (importance
    # eviction, `--kv-eviction snapkv`); None (left out of the JSON): builds made before it, or forms
    # that do not score (exporter/build.py scores_declared)
    attention_scores: bool | None = field(default=None, metadata={"omit_if_none": True})

    @property
    def latent(self) -> bool:
        """One latent pool per layer (MLA) instead of key and value pools."""
        return self.latent_rank is not None


@dataclass(frozen=True, slots=True)
class GraphEntry:
    file: str  # the .onnx file inside the build
    inputs: tuple[io.TensorSpec, ...]  # io.graph_io(...).inputs, in order
    outputs: tuple[io.TensorSpec, ...]  # io.graph_io(...).outputs, in order
    bytes: int  # size of the .onnx file, bytes (weights live in the shared data file)
    # the layer boundaries of its io.HIDDEN_STATES output (`--hidden-states`); None (left out of the JSON):
    # none, or builds made before it
    hidden_layers: tuple[int, ...] | None = field(default=None, metadata={"omit_if_none": True})


# The ModelSpec fields downstream reads, with their types (checked when a manifest is read).
_MODEL_FIELDS: dict[str, Any] = {
    "family": str, "model_type": str, "num_layers": int, "hidden_size": int, "num_heads": int,
    "num_kv_heads": int, "head_dim": int, "vocab_size": int, "max_positions": int,
    "sliding_window": int | None, "tie_embeddings": bool, "bos_token_id": int | None,
    "eos_token_ids": tuple[int, ...],
}
# Fields a spec has only where they differ from their default (exporter/spec.py ModelSpec.to_json):
# checked when present; absent in the manifests of builds made before they existed.
_OPTIONAL_MODEL_FIELDS: dict[str, Any] = {
    "layer_windows": tuple[int | None, ...],
    "generation_eos_token_ids": tuple[int, ...],  # builds before it: config.json's eos_token_ids only
}


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """The model spec: exporter/spec.py `ModelSpec.to_json()`, kept whole (so nothing the
    exporter records is lost and it saves back byte for byte), with typed reads of the fields
    the runtime and tools use; those are checked when the entry is made.

    NOTE: a view, not a copy of ModelSpec: kvexport/ must not import the exporter, and a field
    the exporter adds later rides along without a schema change."""

    spec: dict[str, Any]  # ModelSpec.to_json()

    def __post_init__(self) -> None:
        for name, tp in _MODEL_FIELDS.items():
            if name not in self.spec:
                raise _FieldError(f"model.{name}", "is missing")
            decode(tp, self.spec[name], f"model.{name}", _WORDS)
        for name, tp in _OPTIONAL_MODEL_FIELDS.items():
            if name in self.spec:
                decode(tp, self.spec[name], f"model.{name}", _WORDS)
        windows = self.spec.get("layer_windows")
        if windows is not None and len(windows) != self.num_layers:
            raise _FieldError("model.layer_windows", f"must list {self.num_layers} layers, got {len(windows)}")

    @property
    def family(self) -> str:  # registry name, e.g. "llama"
        return self.spec["family"]

    @property
    def model_type(self) -> str:  # transformers model_type it was read from
        return self.spec["model_type"]

    @property
    def num_layers(self) -> int:  # decoder layers
        return self.spec["num_layers"]

    @property
    def hidden_size(self) -> int:  # model width, elements
        return self.spec["hidden_size"]

    @property
    def num_heads(self) -> int:  # query heads
        return self.spec["num_heads"]

    @property
    def num_kv_heads(self) -> int:  # KV heads (< num_heads: GQA)
        return self.spec["num_kv_heads"]

    @property
    def head_dim(self) -> int:  # elements per head
        return self.spec["head_dim"]

    @property
    def rotary_dim(self) -> int:  # channels per head RoPE rotates (exporter/spec.py); 0 without RoPE
        rope = self.spec.get("rope")
        return int(self.head_dim * rope["partial_rotary_factor"]) if rope else 0

    @property
    def vocab_size(self) -> int:  # tokens; logits are [.., vocab_size]
        return self.spec["vocab_size"]

    @property
    def max_positions(self) -> int:  # longest context the model was trained for, tokens
        return self.spec["max_positions"]

    @property
    def sliding_window(self) -> int | None:  # tokens a query may look back, itself included; None: full
        return self.spec["sliding_window"]

    @property
    def layer_windows(self) -> tuple[int | None, ...]:  # each layer's window (None: full attention)
        windows = self.spec.get("layer_windows")
        return tuple(windows) if windows is not None else (self.sliding_window,) * self.num_layers

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has the same one, else None. NOTE: a build with one KV
        cache group frees the blocks behind a window only when every layer is windowed alike
        (mistral); builds with a local group (`kv.local_window`, gemma2/3) free the windowed
        layers' blocks in that group."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def tie_embeddings(self) -> bool:  # lm_head shares the embedding matrix
        return self.spec["tie_embeddings"]

    @property
    def bos_token_id(self) -> int | None:
        return self.spec["bos_token_id"]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end tokens: any of them ends a sequence. config.json's eos_token_id, then those
        generation_config.json (GGUF: its metadata) adds (exporter/end_tokens.py); builds made
        before `generation_eos_token_ids` have config.json's only."""
        return tuple(dict.fromkeys((*self.spec["eos_token_ids"], *(self.spec.get("generation_eos_token_ids") or ()))))


@dataclass(frozen=True, slots=True)
class WeightsEntry:
    file: str  # the external-data file every graph's initializers live in (io.WEIGHTS_FILE)
    bytes: int  # its size, bytes (checked by load(): a truncated copy is refused)
    parameters: int  # model parameters stored in it (RoPE tables not counted)
    precision: str | None = None  # matmul weights: fp32 | fp16 | int8 | int4 (None: builds before; = dtype)
    # int8/int4: what is quantized, how, and how it is served (exporter/quantize.py describe()); None: float weights
    quantization: WeightQuantizationEntry | None = None
    # hex sha256 of the file, checked before serving and by `kvexport inspect --verify` (kvexport/verify.py);
    # None: builds before it (left out of the JSON then, so their manifests stay as they were)
    sha256: str | None = field(default=None, metadata={"omit_if_none": True})


@dataclass(frozen=True, slots=True)
class NativeOpValidation:
    """Read only, from builds written before `ValidationEntry.op`: their plugin graphs were
    checked with the reference op, then a second time, in full, with the native CPU op."""

    max_abs_diff: float  # max |Δ logits| over all steps
    greedy_identical: bool  # every argmax equals transformers' greedy token
    token_agreement: float  # fraction of (prompt, step) argmaxes equal to the reference, 0..1
    passed: bool


@dataclass(frozen=True, slots=True)
class OpCheck:
    """A plugin build's second, cut-down check with the float64 reference PagedAttention: it
    pins the graph itself, independent of the op that served the main check."""

    op: str  # one of VALIDATION_OPS: "reference"
    prompts: int  # the first `prompts` of the main check's prompts
    steps: int  # decode steps after the prefill
    max_abs_diff: float  # max |Δ logits| over all steps
    greedy_identical: bool  # every argmax equals transformers' greedy token
    token_agreement: float  # fraction of (prompt, step) argmaxes equal to the reference, 0..1
    passed: bool  # the main check's bounds, less the share of agreeing greedy tokens (exporter/validate.py)


@dataclass(frozen=True, slots=True)
class ValidationEntry:
    """The graphs against transformers on the same weights (exporter/validate.py)."""

    prompts: int  # prompts run
    prompt_lengths: tuple[int, ...]  # tokens of each prompt
    steps: int  # decode steps after the prefill
    max_abs_diff_per_step: tuple[float, ...]  # max |Δ logits| of each step; step 0 = prefill
    max_abs_diff: float  # max over the steps
    tolerance: float  # max |Δ logits| accepted (exporter/validate.py TOLERANCE)
    greedy_identical: bool  # every argmax equals transformers' greedy token
    token_agreement: float  # fraction of (prompt, step) argmaxes equal to the reference, 0..1
    passed: bool  # tolerance (and greedy equality where required) met, by every check run
    op: str | None = None  # one of VALIDATION_OPS: how the graphs' attention ran; None: not recorded
    cross_check: OpCheck | None = None  # plugin graphs served by the native op: the reference op's check
    native_op: NativeOpValidation | None = None  # builds written before `op` only (see NativeOpValidation)


@dataclass(frozen=True, slots=True)
class Manifest:
    schema_version: int  # io.SCHEMA_VERSION
    kvexport_version: str  # kvexport that wrote the build
    source: dict  # exporter/source.py ModelSource.to_json(): kind, name, path, weight files (+ sha256)
    model: ModelEntry
    dtype: str  # io.DType value of weights/activations
    kv: KVSpec
    graphs: dict[str, GraphEntry]  # io.Phase value ("prefill" / "decode") -> graph
    weights: WeightsEntry
    tokenizer: str | None  # folder inside the build, or None
    all_logits: bool  # prefill returns logits for every token
    validation: ValidationEntry | None  # None: not validated
    tools: dict[str, str | None]  # package -> version at build time (versions())
    notes: tuple[str, ...] = ()  # human-readable remarks on the build
    samples: dict[str, str] = field(default_factory=dict)  # phase -> polygraphy input file
    engines: EnginesEntry | None = None  # TensorRT engines, when built (exporter/tensorrt_build.py)
    # the LoRA adapters the graphs take at serve time (exporter/lora.py serve_plan: max_rank, targets, parts,
    # layers; kvexport/io.py LORA_INDEX); None (left out of the JSON): none
    lora: dict | None = field(default=None, metadata={"omit_if_none": True})

    def to_json(self) -> dict:
        return _to_json(self)

    @property
    def layer_groups(self) -> tuple[str, ...] | None:
        """Each layer's KV cache group (io.kv_groups) in a build with a local group, else None
        (one group: every layer's KV in the pools of `kv.block_size` blocks named as before)."""
        return io.kv_groups(self.model.layer_windows) if self.kv.local_window is not None else None

    @property
    def logits_indices(self) -> bool:
        """The prefill graph takes io.LOGITS_INDICES (logits of the rows a step asks for: speculative
        decoding's 1 + k rows, echo's prompt rows); False for builds made before it (last token,
        or every token's with all_logits). Read from the graph entry's recorded inputs."""
        g = self.graphs.get(io.Phase.PREFILL.value)
        return g is not None and any(t.name == io.LOGITS_INDICES for t in g.inputs)

    @property
    def scores_prompts(self) -> bool:
        """Prompt rows' logits are available (echo, prompt_logprobs): an all_logits or a
        logits_indices build."""
        return self.all_logits or self.logits_indices

    def save(self, build_dir: Path) -> None:
        """Write kvexport.json atomically (temp file + rename: never half-written, and a
        hard-linked copy of a build keeps its own manifest)."""
        build_dir = Path(build_dir)
        fd, tmp = outputs.new_temp_file(build_dir, f".{io.MANIFEST_NAME}.")  # umask's permissions, not 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.to_json(), indent=2) + "\n")
            os.replace(tmp, build_dir / io.MANIFEST_NAME)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        """The manifest of parsed kvexport.json `d`, every field checked; ManifestError names
        the first field that is missing, unknown, of the wrong type or inconsistent."""
        version = d.get("schema_version")
        if version != io.SCHEMA_VERSION or isinstance(version, bool):
            raise ManifestError(f"manifest field 'schema_version' is {version!r}; this kvexport reads "
                                f"{io.SCHEMA_VERSION}: rebuild with `kvexport build --force`")
        try:
            m = decode(cls, d, "", _WORDS)
            _check_values(m)
        except _FieldError as e:
            hint = REBUILD_ENGINES if e.path.startswith("engines") else REBUILD
            raise ManifestError(f"manifest field {e.path!r} {e.what}; {hint}") from None
        return m


def model_source_refusal(path: str | os.PathLike, then: str = "pass BUILD") -> str | None:
    """Why `path`, given where a build belongs, is a model source (a Hugging Face folder, a GGUF
    file, a built-in alias), saying to build it first and `then` what; None when it is not one."""
    p = Path(path)
    hint = f"build it first with `kvexport build {path} --out BUILD`, then {then}"
    # NOTE: a build holds a config.json too (for other tools), but never the source's weight files
    if p.is_dir() and not (p / io.MANIFEST_NAME).exists() and (p / "config.json").is_file() and (
            any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin"))):
        return f"{path} is a model source (a Hugging Face folder), not a kvexport build: {hint}"
    if p.is_file() and p.suffix.lower() == ".gguf":
        return f"{path} is a model source (a GGUF file), not a kvexport build: {hint}"
    if not p.exists():
        from kvexport.exporter.source import ALIASES  # NOTE: here, not at the top: exporter imports this module

        if str(path) in ALIASES:
            return f"{str(path)!r} is a model alias, not a kvexport build: {hint}"
    return None


def missing_tokenizer(build_dir: Path, folder: str, why: str = "") -> str:
    """What to do about a build whose manifest lists a tokenizer folder that is gone or broken."""
    what = f"cannot be loaded ({why})" if why else "is missing"
    return (f"{build_dir / folder}, the build's tokenizer listed in its manifest, {what}: copy the model's "
            f"tokenizer files (tokenizer.json, tokenizer_config.json, ...) into it, or rebuild with "
            f"`kvexport build MODEL --out {build_dir} --force`")


def load(build_dir: str | Path, check_graphs: bool = True) -> Manifest:
    """Read and check a build directory's manifest: every field typed, every referenced file
    present, and (`check_graphs`) the kv spec and graph I/O agreeing with the .onnx files."""
    build_dir = Path(build_dir)
    path = build_dir / io.MANIFEST_NAME
    if not path.is_file():
        if (why := model_source_refusal(build_dir)) is not None:
            raise ManifestError(why)
        raise ManifestError(f"{build_dir} has no {io.MANIFEST_NAME}: it is not a (complete) kvexport "
                            f"build; run `kvexport build MODEL --out {build_dir}`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is corrupt ({e}); rebuild with `kvexport build --force`") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path} is corrupt (not a JSON object); rebuild with `kvexport build --force`")
    try:
        m = Manifest.from_json(data)
    except ManifestError as e:
        raise ManifestError(f"{path}: {e}") from None
    for entry in m.graphs.values():
        if not (build_dir / entry.file).is_file():
            raise ManifestError(f"{build_dir / entry.file} listed in the manifest is missing; {REBUILD}")
    weights = build_dir / m.weights.file
    if not weights.is_file():
        raise ManifestError(f"{weights} listed in the manifest is missing; {REBUILD}")
    if (size := weights.stat().st_size) != m.weights.bytes:
        raise ManifestError(f"{weights} has {size} bytes, the manifest says {m.weights.bytes} "
                            f"(truncated?); {REBUILD}")
    if m.tokenizer is not None and not (build_dir / m.tokenizer).is_dir():
        raise ManifestError(missing_tokenizer(build_dir, m.tokenizer))
    if check_graphs:  # cheap: graph protos without their weights
        graph_check.check_graphs(build_dir, m)
    return m


def sha256(path: Path) -> str:
    """Hex sha256 of a file (the checksums the manifest records: source weights, engines)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"kvexport": __version__}
    for pkg in ("torch", "transformers", "onnx", "onnxruntime", "numpy", "gguf"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


# ---- consistency beyond types ---------------------------------------------------------------


def _one_of(value: str, choices: type[enum.Enum], path: str) -> None:
    allowed = [e.value for e in choices]
    if value not in allowed:
        raise _FieldError(path, f"is {value!r}, not one of {allowed}")


def _check_values(m: Manifest) -> None:
    """Values the types cannot express: enum members, sizes > 0, the KV formula, the model
    and kv entries agreeing, and the engines' limits within the build's."""
    kv = m.kv
    _one_of(m.dtype, io.DType, "dtype")
    _one_of(kv.layout, io.KVLayout, "kv.layout")
    _one_of(kv.attention, io.Attention, "kv.attention")
    _one_of(kv.dtype, io.DType, "kv.dtype")
    for name in ("num_layers", "num_kv_heads", "head_dim", "max_seq_len"):
        if getattr(kv, name) < 1:
            raise _FieldError(f"kv.{name}", f"must be >= 1, got {getattr(kv, name)}")
    paged = kv.layout == io.KVLayout.PAGED.value
    if (kv.block_size < 1) if paged else (kv.block_size != 0):
        raise _FieldError("kv.block_size", f"is {kv.block_size}: it must be >= 1 for the paged layout, 0 for "
                                           f"contiguous")
    mla = m.model.spec.get("mla")
    if (mla is not None) != kv.latent or (mla is not None and kv.latent_rank != mla.get("kv_lora_rank")):
        want = mla.get("kv_lora_rank") if isinstance(mla, dict) else None
        raise _FieldError("kv.latent_rank", f"is {kv.latent_rank}, but the model's MLA spec gives {want} "
                                            f"(model.mla.kv_lora_rank)")
    # an MLA layer's pool is one "KV head" of the latent row (io.py "MLA")
    model_kv = ({"num_layers": m.model.num_layers, "num_kv_heads": 1,
                 "head_dim": mla["kv_lora_rank"] + mla["qk_rope_head_dim"]} if mla is not None else
                {name: getattr(m.model, name) for name in ("num_layers", "num_kv_heads", "head_dim")})
    for name, want in model_kv.items():
        if getattr(kv, name) != want:
            of = "the model's MLA spec (model.mla) gives" if mla is not None else f"'model.{name}' is"
            raise _FieldError(f"kv.{name}", f"is {getattr(kv, name)}, but {of} {want}")
    per_token = io.kv_bytes_per_token_model(m.model.spec, kv.num_kv_heads, kv.head_dim, io.DType(kv.dtype),
                                            kv.latent)
    # NOTE: hybrid and Gemma 4 builds written before their KV was counted by layer carry the uniform figure
    legacy = io.kv_bytes_per_token(kv.num_layers, kv.num_kv_heads, kv.head_dim, io.DType(kv.dtype), kv.latent)
    if kv.bytes_per_token not in (per_token, legacy):
        formula = ("layers x (kv_lora_rank + qk_rope_head_dim) x bytes" if kv.latent else
                   "2 x kv_heads x head_dim x bytes summed over the layers holding KV")
        raise _FieldError("kv.bytes_per_token", f"is {kv.bytes_per_token}, but the kv spec gives {per_token} "
                                                f"({formula})")
    if kv.local_window is not None:
        groups = io.kv_groups(m.model.layer_windows)
        windows = [w for w, g in zip(m.model.layer_windows, groups) if g == io.LOCAL_GROUP]
        if not paged or not windows or kv.local_window != max(windows):
            want = max(windows) if paged and windows else None
            raise _FieldError("kv.local_window", f"is {kv.local_window}, but the model's layer windows give {want} "
                                                 f"(a paged build of full-attention and windowed layers only)")
    if (v := m.validation) is not None:
        ops = {"validation.op": v.op, "validation.cross_check.op": v.cross_check.op if v.cross_check else None}
        for path, op in ops.items():
            if op is not None and op not in VALIDATION_OPS:
                raise _FieldError(path, f"is {op!r}, not one of {list(VALIDATION_OPS)}")
    phases = sorted(p.value for p in io.Phase)
    if sorted(m.graphs) != phases:
        raise _FieldError("graphs", f"has {sorted(m.graphs)}, not the graphs {phases}")
    if m.engines is not None:
        if sorted(m.engines.engines) != phases:
            raise _FieldError("engines.engines", f"has {sorted(m.engines.engines)}, not the engines {phases}")
        if m.engines.limits.max_seq_len > kv.max_seq_len:
            raise _FieldError("engines.limits.max_seq_len", f"is {m.engines.limits.max_seq_len}, longer than the "
                                                            f"graphs' kv.max_seq_len {kv.max_seq_len}")


# ---- typed JSON: dataclass <-> parsed JSON, checked (decoding: kvexport/decode.py) -----------


class _FieldError(ManifestError):
    """A field that is missing, unknown, of the wrong type or inconsistent, at `path` (dotted,
    e.g. 'engines.limits.max_num_seqs'); from_json adds what to rebuild."""

    def __init__(self, path: str, what: str):
        super().__init__(f"manifest field {path!r} {what}")
        self.path, self.what = path, what


def _model_entry(value: Any, path: str) -> ModelEntry:
    if not isinstance(value, dict):
        raise _FieldError(path, f"must be an object, got {got(value)}")
    return ModelEntry(value)


# the manifest's words for the shared decoder (kvexport/decode.py): JSON's
_WORDS = Words(types={int: "an int", float: "a number", str: "a string", bool: "a boolean", dict: "an object",
                      type(None): "null"},
               make=_FieldError, special={ModelEntry: _model_entry})


def _to_json(x: Any) -> Any:
    """Parsed-JSON form of a manifest value (tuples become lists; ModelEntry its spec)."""
    if isinstance(x, ModelEntry):
        return _to_json(x.spec)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _to_json(getattr(x, f.name)) for f in dataclasses.fields(x)
                if not (f.metadata.get("omit_if_none") and getattr(x, f.name) is None)}
    if isinstance(x, (list, tuple)):
        return [_to_json(v) for v in x]
    if isinstance(x, dict):
        return {k: _to_json(v) for k, v in x.items()}
    return x
