"""`kvexport build`: model source -> build directory (graphs, shared weights, tokenizer,
manifest), validated against transformers.

NOTE: everything is written into a temporary sibling directory and renamed into place
only after the manifest is written, so an interrupted build never leaves a directory that
looks complete; the manifest is the last file written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from kvexport import __version__, io
from kvexport.errors import BuildExistsError, ConfigError, ValidationError
from kvexport.manifest import GraphEntry, KVSpec, Manifest, ModelEntry, WeightsEntry, versions

from . import source
from .families import FAMILIES, read_spec
from .graph import DecoderGraph, GraphOptions, rope_tables
from .onnx_builder import WeightStore, save_model
from .samples import write_samples
from .validate import prompt_ids, validate

if TYPE_CHECKING:
    from .tensorrt_build import EngineBuildOptions

log = logging.getLogger(__name__)
MAX_ROPE_TABLE = 32768  # default cap on max_seq_len when the model allows more, tokens


@dataclass(frozen=True, slots=True)
class BuildOptions:
    layout: io.KVLayout = io.KVLayout.PAGED
    attention: io.Attention = io.Attention.ONNX
    dtype: io.DType = io.DType.FP32  # weights/activations
    kv_dtype: io.DType | None = None  # None: same as dtype
    block_size: int = 16  # tokens per KV block (paged)
    max_seq_len: int | None = None  # None: the model's max positions (capped at MAX_ROPE_TABLE)
    all_logits: bool = False  # prefill returns logits for every token (perplexity)
    validate: bool = True
    validate_steps: int = 16  # greedy decode steps compared with transformers
    force: bool = False
    allow_pickle: bool = False  # accept *.bin weights (loaded with weights_only=True)
    calibration_text: str | None = None  # int8 KV: text file for the scales (None: bundled Hamlet)
    calibration_tokens: int = 2048  # int8 KV: tokens of that text run through the model
    # the backend the build is for, named as the runtime's --backend: "onnxruntime" (ONNX graphs
    # only) | "tensorrt" (also TensorRT engines; needs --attention plugin). "onnx" = onnxruntime
    backend: str = "onnxruntime"
    engines: EngineBuildOptions | None = None  # TensorRT engine limits / precision; None: the defaults

    def __post_init__(self) -> None:
        if self.attention is io.Attention.PLUGIN and self.layout is not io.KVLayout.PAGED:
            raise ConfigError("--attention plugin needs --layout paged (PagedAttention reads a block pool)")
        if self.dtype not in (io.DType.FP32, io.DType.FP16):
            raise ConfigError(f"--dtype {self.dtype.value} is not supported; use fp32 or fp16")
        if self.kv_dtype is not None and self.kv_dtype not in (io.DType.FP32, io.DType.FP16, io.DType.INT8):
            raise ConfigError(f"--kv-dtype {self.kv_dtype.value} is not supported on the ONNX path; "
                              f"use fp32, fp16 or int8")
        if self.backend == "onnx":  # the old name, kept for recipes written before
            object.__setattr__(self, "backend", "onnxruntime")
        if self.backend not in ("onnxruntime", "tensorrt"):
            raise ConfigError(f"--backend must be onnxruntime or tensorrt, got {self.backend!r}")
        if self.backend == "tensorrt" and self.attention is not io.Attention.PLUGIN:
            raise ConfigError("--backend tensorrt needs --attention plugin (the engines run PagedAttention "
                              "as a TensorRT plugin)")
        if self.backend == "tensorrt" and self.dtype is not io.DType.FP16:
            raise ConfigError("--backend tensorrt needs --dtype fp16 (the plugin kernels take fp16/bf16 activations)")
        if (self.calibration_text is not None or self.calibration_tokens != 2048) and self.kv_dtype is not io.DType.INT8:
            raise ConfigError("--calibration-text / --calibration-tokens only apply to --kv-dtype int8")
        if self.calibration_tokens < 16:
            raise ConfigError(f"--calibration-tokens must be >= 16, got {self.calibration_tokens}")
        if not (1 <= self.block_size <= 1024):
            raise ConfigError(f"--block-size must be in 1..1024, got {self.block_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ConfigError(f"--max-seq-len must be >= 2, got {self.max_seq_len}")
        if self.validate_steps < 1:
            raise ConfigError("validate_steps must be >= 1")


Progress = Callable[[str], contextlib.AbstractContextManager]


@contextlib.contextmanager
def _quiet_step(name: str) -> Iterator[None]:
    t = time.perf_counter()
    yield
    log.info("%s: %.1fs", name, time.perf_counter() - t)


def default_out_dir(model: str) -> Path:
    return Path("build") / Path(model.rstrip("/")).name.removesuffix(".gguf")


def build(model: str, out: str | Path | None = None, opts: BuildOptions = BuildOptions(),
          progress: Progress = _quiet_step) -> tuple[Path, Manifest]:
    """Export `model` into `out`; returns the build directory and its manifest.
    Raises KvExportError subclasses for user mistakes; on any failure nothing is left at `out`
    (an existing build there is kept unless the new one completes and `force` is set)."""
    src = source.resolve(model, allow_pickle=opts.allow_pickle)
    out = Path(out) if out is not None else default_out_dir(model)
    if out.exists() and not opts.force:
        raise BuildExistsError(f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        manifest = _build_into(tmp, src, opts, progress)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if opts.backend == "tensorrt":
        # NOTE: after the ONNX build is in place: without TensorRT or a GPU this raises
        # TensorRTUnavailableError, and the ONNX build stays complete and usable
        from .tensorrt_build import EngineBuildOptions, add_engines

        with progress("building TensorRT engines"):
            manifest = add_engines(out, opts.engines or EngineBuildOptions())
    return out, manifest


def _replace(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def _build_into(d: Path, src: source.ModelSource, opts: BuildOptions, progress: Progress) -> Manifest:
    with progress("reading config"):
        config = source.load_config(src)
        spec = read_spec(config)
    max_len = opts.max_seq_len or min(spec.max_positions, MAX_ROPE_TABLE)
    if spec.position == "learned" and max_len > spec.max_positions:
        raise ConfigError(f"--max-seq-len {max_len} exceeds the {spec.max_positions} learned positions "
                          f"of this model")
    kv_dtype = opts.kv_dtype or opts.dtype
    with progress("loading weights"):
        model = source.load_model(src)
        weights = FAMILIES[spec.family].weights(model.state_dict(), spec)
        rope = None
        if spec.position == "rope":
            rot = model.model.rotary_emb
            rope = rope_tables(spec, rot.inv_freq, float(rot.attention_scaling), max_len)
        tokenizer = source.load_tokenizer(src)
    scales = quantization = None
    if kv_dtype is io.DType.INT8:
        from . import calibrate

        with progress("calibrating int8 KV scales"):
            text = Path(opts.calibration_text) if opts.calibration_text else None
            if tokenizer is not None and text is None:
                text = calibrate.default_text()
            ids = calibrate.calibration_ids(tokenizer, spec.vocab_size, text, opts.calibration_tokens)
            scales = calibrate.compute_scales(model, ids)
            quantization = calibrate.quantization_entry(scales, text.name if text else "random-ids", ids)

    store = WeightStore()
    graphs = {}
    for phase in (io.Phase.PREFILL, io.Phase.DECODE):
        with progress(f"exporting {phase.value} graph"):
            g = GraphOptions(opts.layout, phase, opts.dtype, kv_dtype, opts.block_size, max_len, opts.all_logits,
                             opts.attention, scales)
            dg = DecoderGraph(spec, weights, rope, g, store)
            graphs[phase] = (dg.build(), dg.io)
    with progress("writing graphs and weights"):
        weight_bytes = store.write(str(d / io.WEIGHTS_FILE))
        entries = {}
        for phase, (builder, gio) in graphs.items():
            name = io.PREFILL_GRAPH if phase is io.Phase.PREFILL else io.DECODE_GRAPH
            save_model(builder.to_model(io.WEIGHTS_FILE, doc=f"kvexport {phase.value} graph"), str(d / name))
            entries[phase.value] = GraphEntry(name, gio.inputs, gio.outputs, (d / name).stat().st_size)
        tok_dir = None
        if tokenizer is not None:
            tokenizer.save_pretrained(d / io.TOKENIZER_DIR)
            tok_dir = io.TOKENIZER_DIR
    n_params = sum(a.size for k, a in store.arrays.items() if not k.startswith("rope."))
    del graphs, store

    notes = []
    if opts.dtype is io.DType.FP16:
        notes.append("fp16: matmul weights/activations in float16; norms, RoPE and attention in float32")
    if kv_dtype is io.DType.INT8:
        notes.append("int8 KV: static symmetric scales per layer and KV head (kv.quantization); "
                     "QuantizeLinear on write, DequantizeLinear on read")
    if opts.attention is io.Attention.PLUGIN:
        notes.append("plugin attention: kvexport::PagedAttention nodes; onnxruntime (CPU) runs them with the "
                     "native op library (kvexport.plugins.paged_attention.native; scripts/build_cpu_ops.sh) or "
                     "the reference custom op (kvexport.plugins.paged_attention.ort), TensorRT with the plugin")
    manifest = Manifest(
        schema_version=io.SCHEMA_VERSION, kvexport_version=__version__, source=src.to_json(),
        model=ModelEntry(spec.to_json()), dtype=opts.dtype.value,
        kv=KVSpec(opts.layout.value, opts.attention.value, kv_dtype.value,
                  opts.block_size if opts.layout is io.KVLayout.PAGED else 0, spec.num_layers,
                  spec.num_kv_heads, spec.head_dim,
                  io.kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype), max_len,
                  quantization),
        graphs=entries, weights=WeightsEntry(io.WEIGHTS_FILE, weight_bytes, n_params), tokenizer=tok_dir,
        all_logits=opts.all_logits, validation=None, tools=versions(), notes=tuple(notes))

    with progress("writing sample inputs"):
        manifest = replace(manifest, samples=write_samples(d, manifest))

    if opts.validate:
        with progress("validating against transformers"):
            prompts = prompt_ids(tokenizer, spec.vocab_size)
            steps = min(opts.validate_steps, max_len - max(len(p) for p in prompts))
            result = validate(d, manifest, model, prompts, steps)
        manifest = replace(manifest, validation=result)
        if not result.passed:
            n = result.native_op
            raise ValidationError(
                f"exported graphs disagree with transformers: max |Δ logits| {result.max_abs_diff:.3g} "
                f"(tolerance {result.tolerance}), greedy tokens identical: {result.greedy_identical}"
                + (f"; with the native CPU PagedAttention op: max |Δ logits| {n.max_abs_diff:.3g}, "
                   f"greedy tokens identical: {n.greedy_identical}" if n else ""))
    manifest.save(d)
    return manifest
