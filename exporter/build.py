"""`kvexport build`: model source -> build directory (graphs, shared weights, tokenizer,
manifest), validated against transformers.

NOTE: everything is written into a temporary sibling directory and renamed into place
only after the manifest is written (kvexport/outputs.py, which also decides what --force may
replace), so an interrupted build never leaves a directory that looks complete; the manifest
is the last file written.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from kvexport import __version__, io, outputs
from kvexport.errors import ConfigError, ValidationError
from kvexport.manifest import EngineBuildOptions, GraphEntry, KVSpec, Manifest, ModelEntry, WeightsEntry, versions
from kvexport.manifest_weights import WEIGHT_MATMUL_ACCURACY

from . import end_tokens, interop, source
from .families import FAMILIES, read_spec
from .graph import DecoderGraph, GraphOptions, model_rope_tables
from .limits import BACKENDS, CALIBRATED_METHODS, DTYPES, KV_DTYPES, RANGES, default_matmul_accuracy
from .onnx_builder import WeightStore, save_model
from .samples import write_samples
from .validate import fit_prompts, prompt_ids, validate, verdicts

log = logging.getLogger(__name__)
# what int8/int4 builds keep in the activation dtype, and why (the manifest records it)
KEPT = {"lm_head": "int8 even in int4 builds (exporter/quantize.py HEAD_BITS): the logits are the most "
                   "rounding-sensitive matmul; embeddings gather their rows from int8 codes too (tied: the same)",
        "norms, RoPE tables, biases": "tiny; float32 as transformers computes them"}
MOE_KEPT = {"MoE routers": "as transformers computes them (exporter/moe.py route); rounded, they would change "
                           "which experts a token gets"}
MAX_ROPE_TABLE = 32768  # default cap on max_seq_len when the model allows more, tokens


@dataclass(frozen=True, slots=True)
class BuildOptions:
    layout: io.KVLayout = io.KVLayout.PAGED
    # None: plugin for paged builds, or onnx where the native CPU op cannot serve the build
    # (not built, or fp16 activations/KV: default_attention says why); onnx for contiguous ones
    attention: io.Attention | None = None
    dtype: io.DType = io.DType.FP32  # weights/activations
    kv_dtype: io.DType | None = None  # None: same as dtype
    block_size: int = 16  # tokens per KV block (paged)
    max_seq_len: int | None = None  # None: the model's max positions (capped at MAX_ROPE_TABLE)
    all_logits: bool = False  # prefill returns logits for every token (perplexity)
    validate: bool = True
    validate_steps: int = 16  # greedy decode steps compared with transformers
    force: bool = False
    allow_pickle: bool = False  # accept *.bin weights (loaded with weights_only=True)
    calibration_text: str | None = None  # int8 KV: text for the scales, int4: the key transform (None: bundled Hamlet)
    calibration_tokens: int = 2048  # int8 / int4 KV: tokens of that text run through the model
    # the backend the build is for, named as the runtime's --backend: "onnxruntime" (ONNX graphs
    # only) | "tensorrt" (also TensorRT engines; needs --attention plugin). "onnx" = onnxruntime
    backend: str = "onnxruntime"
    engines: EngineBuildOptions | None = None  # TensorRT engine limits / precision; None: the defaults
    weights: str | None = None  # matmul weights: fp32 | fp16 | int8 | int4 (None: --dtype); exporter/quantize.py
    # int8/int4: rows of K per scale, 0 per output channel; None: the default form (limits.DEFAULT_WEIGHT_FORM)
    weight_block_size: int | None = None
    # int8/int4 weights from float ones: rtn | awq | smoothquant (calibration_text: its text); None: the default form
    quant_method: str | None = None
    # int8/int4: the weight_matmul_accuracy the build records as its serving default (auto | int8 | float;
    # runtime/execution/session_plan.py); None: by method (limits.default_matmul_accuracy)
    weight_matmul_accuracy: str | None = None

    def __post_init__(self) -> None:
        for name, cls in (("layout", io.KVLayout), ("attention", io.Attention), ("dtype", io.DType),
                          ("kv_dtype", io.DType)):
            v = getattr(self, name)
            if not isinstance(v, cls) and not (v is None and name in ("attention", "kv_dtype")):
                raise ConfigError(f"{name} must be a kvexport.io.{cls.__name__} ({', '.join(e.value for e in cls)}), "
                                  f"got {v!r}")
        for name, (lo, hi) in RANGES.items():
            v = getattr(self, name)
            if v is None and name == "max_seq_len":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                label = name if name == "validate_steps" else "--" + name.replace("_", "-")  # the rest are flags
                raise ConfigError(f"{label} must be an integer in {lo}..{hi}, got {v!r}")
        for name in ("all_logits", "validate", "force", "allow_pickle"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.calibration_text is not None and not isinstance(self.calibration_text, str):
            raise ConfigError(f"calibration_text must be a file path, got {self.calibration_text!r}")
        if self.engines is not None and not isinstance(self.engines, EngineBuildOptions):
            raise ConfigError(f"engines must be an EngineBuildOptions, got {self.engines!r}")
        if self.attention is None and self.layout is io.KVLayout.CONTIGUOUS:
            object.__setattr__(self, "attention", io.Attention.ONNX)
        if self.attention is None and self.backend == "tensorrt":
            object.__setattr__(self, "attention", io.Attention.PLUGIN)
        if self.attention is io.Attention.PLUGIN and self.layout is not io.KVLayout.PAGED:
            raise ConfigError("--attention plugin needs --layout paged (PagedAttention reads a block pool)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype.value} is not supported; use fp32 or fp16")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype {self.kv_dtype.value} is not supported on the ONNX path; "
                              f"use fp32, fp16, int8 or int4")
        if self.backend == "onnx":  # the old name, kept for recipes written before
            object.__setattr__(self, "backend", "onnxruntime")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be onnxruntime or tensorrt, got {self.backend!r}")
        if self.backend == "tensorrt" and self.attention is io.Attention.ONNX:
            raise ConfigError("--backend tensorrt needs --attention plugin (the engines run PagedAttention "
                              "as a TensorRT plugin)")
        if self.backend == "tensorrt" and self.dtype is not io.DType.FP16:
            raise ConfigError("--backend tensorrt needs --dtype fp16 (the plugin kernels take fp16/bf16 activations)")
        wq = self.weight_quantization()  # checks weights / weight_block_size / quant_method
        if ((self.calibration_text is not None or self.calibration_tokens != 2048)
                and self.kv_dtype not in (io.DType.INT8, io.DType.INT4)
                and not (wq.quantized and wq.method in CALIBRATED_METHODS)):
            raise ConfigError("--calibration-text / --calibration-tokens only apply to --kv-dtype int8 / int4 or "
                              "--quant-method awq / smoothquant")
        if wq.precision == "fp16" and self.dtype is io.DType.FP32:
            object.__setattr__(self, "dtype", io.DType.FP16)
        elif wq.precision == "fp32" and self.dtype is io.DType.FP16 and self.weights is not None:
            raise ConfigError("--weights fp32 contradicts --dtype fp16; drop one of them")
        if not wq.quantized and (self.weight_block_size is not None or self.quant_method is not None
                                 or self.weight_matmul_accuracy is not None):
            raise ConfigError("--weight-block-size / --quant-method / --weight-matmul-accuracy only apply to "
                              "--weights int8 or int4")
        if self.weight_matmul_accuracy is not None and self.weight_matmul_accuracy not in WEIGHT_MATMUL_ACCURACY:
            raise ConfigError(f"--weight-matmul-accuracy must be one of {', '.join(WEIGHT_MATMUL_ACCURACY)}, "
                              f"got {self.weight_matmul_accuracy!r}")
        if self.backend == "tensorrt" and wq.quantized:  # what TensorRT's Q/DQ takes, before any work
            from .tensorrt_build import weight_problems

            problems = weight_problems(wq.bits, wq.block_size)
            if problems:
                raise ConfigError("--backend tensorrt: " + "; ".join(problems))

    def weight_quantization(self):
        """The matmul weights' quantization (exporter/quantize.py WeightQuantization)."""
        from .quantize import WeightQuantization

        precision = self.weights if self.weights is not None else self.dtype.value
        return WeightQuantization(precision, self.weight_block_size, self.quant_method)


Progress = Callable[[str], contextlib.AbstractContextManager]


def _weight_form(src: source.ModelSource, opts: BuildOptions, tokenizer):
    """The build's WeightQuantization: the options', except that for a pre-quantized checkpoint
    what --weight-block-size / --quant-method leave out follows the checkpoint (its group size,
    its codes mapped as they are) instead of the default form. A default form that searches
    scales on calibration text (int8: smoothquant) needs that text: ConfigError saying so, and
    what to do, before the weights are quantized."""
    wq = opts.weight_quantization()
    if not wq.quantized or (opts.weight_block_size is not None and opts.quant_method is not None):
        return wq
    from . import prequantized
    from .quantize import WeightQuantization

    pq = prequantized.config_of(src.directory) if src.kind == "hf" else None
    if pq is not None:  # what is not given follows the checkpoint (a given method is refused: presets())
        block = pq.group_size if opts.weight_block_size is None else opts.weight_block_size
        return WeightQuantization(wq.precision, block, opts.quant_method or "rtn")
    if opts.quant_method is None and wq.method in CALIBRATED_METHODS and tokenizer is not None \
            and opts.calibration_text is None:
        from . import calibrate

        calibrate.default_text(why=f"--weights {wq.precision} defaults to --weight-block-size "
                                   f"{wq.block_size or 'channel'} --quant-method {wq.method}, whose scales are "
                                   f"searched on calibration text; --weight-block-size 32 (round-to-nearest) "
                                   f"needs none")
    return wq


def serving_words(q, dtype: str) -> str:
    """How onnxruntime's CPU serves weights `q` (a WeightQuantizationEntry) at the build's default
    accuracy, in words (the manifest's weights.quantization.serving; session_plan.describe)."""
    from kvexport.runtime.execution.session_plan import describe, plan_sessions, resolve_accuracy

    accuracy = resolve_accuracy(q, None)
    return f"onnxruntime CPU, weight_matmul_accuracy {accuracy}: " + describe(plan_sessions(q, dtype, accuracy), q)


@contextlib.contextmanager
def _quiet_step(name: str) -> Iterator[None]:
    t = time.perf_counter()
    yield
    log.info("%s: %.1fs", name, time.perf_counter() - t)


def default_attention(opts: BuildOptions, mla: bool = False) -> tuple[BuildOptions, str | None]:
    """`opts` with the attention decided, and a note saying why when a paged build that asked
    for none falls back to `onnx`. Paged builds default to the plugin (PagedAttention nodes):
    the runtime serves it fastest on CPU (the native op) and TensorRT builds only that form;
    but where the native CPU op cannot run the graphs (not built, fp16 activations or KV) the
    runtime would fall back to the slow float64 reference op, so those get the `onnx` attention.
    `mla`: the model has multi-head latent attention, whose nodes are PagedMLA (plugins/paged_mla/)."""
    if opts.attention is not None:
        return opts, None
    from kvexport.plugins.paged_attention import native

    kv_dtype = opts.kv_dtype or opts.dtype
    mla_native = None
    if mla:
        from kvexport.plugins.paged_mla import native as mla_native
    if mla and native.library() is not None and not mla_native.has_mla(native.library()):
        why = f"the native CPU op library ({native.library()}) predates PagedMLA (scripts/build_cpu_ops.sh)"
    elif mla and not mla_native.supports(opts.dtype.numpy_name, kv_dtype.numpy_name):
        why = (f"the native CPU PagedMLA op takes float32 activations with float32/float16/bfloat16/int8 pools, not "
               f"{opts.dtype.value}/{kv_dtype.value}")
    elif native.library() is None:
        why = f"the native CPU PagedAttention op is not built ({native.default_library()}; scripts/build_cpu_ops.sh)"
    elif not native.supports(opts.dtype.numpy_name, kv_dtype.numpy_name):
        why = (f"the native CPU PagedAttention op takes float32 activations with float32/int8/int4 KV, not "
               f"{opts.dtype.value}/{kv_dtype.value}")
    else:
        return replace(opts, attention=io.Attention.PLUGIN), None
    note = (f"attention onnx, not the default plugin: {why}; pass --attention plugin to build "
            f"{'PagedMLA' if mla else 'PagedAttention'} nodes anyway")
    log.warning("%s", note)
    return replace(opts, attention=io.Attention.ONNX), note


def io_kv_shape(spec) -> tuple[int, int]:
    """(KV heads, row width) of the build's pools: the model's, or for MLA one latent "head" of
    kv_lora_rank + qk_rope_head_dim (kvexport/io.py "MLA")."""
    return (1, spec.mla.row_width) if spec.mla is not None else (spec.num_kv_heads, spec.head_dim)


def default_out_dir(model: str) -> Path:
    return Path("build") / Path(model.rstrip("/")).name.removesuffix(".gguf")


def build(model: str, out: str | Path | None = None, opts: BuildOptions = BuildOptions(),
          progress: Progress = _quiet_step) -> tuple[Path, Manifest]:
    """Export `model` into `out`; returns the build directory and its manifest.
    Raises KvExportError subclasses for user mistakes; on any failure nothing is left at `out`
    (an existing build there is kept unless the new one completes and `force` is set)."""
    src = source.resolve(model, allow_pickle=opts.allow_pickle)
    out = Path(out) if out is not None else default_out_dir(model)
    # NOTE: kvexport/outputs.py's rule: --force replaces only an earlier build, never the source
    protect = [("the model source", f) for f in src.weight_files]
    if src.kind != "gguf":  # a .gguf's folder is just where the file lies
        protect.insert(0, ("the model source", src.directory))
    manifest = outputs.write_dir(out, lambda tmp: _build_into(tmp, src, opts, progress), kind=outputs.Kind.BUILD,
                                 force=opts.force, protect=protect)
    if opts.backend == "tensorrt":
        # NOTE: after the ONNX build is in place: without TensorRT or a GPU this raises
        # TensorRTUnavailableError, and the ONNX build stays complete and usable
        from .tensorrt_build import EngineBuildOptions, add_engines

        with progress("building TensorRT engines"):
            manifest = add_engines(out, opts.engines or EngineBuildOptions())
    return out, manifest


def _build_into(d: Path, src: source.ModelSource, opts: BuildOptions, progress: Progress) -> Manifest:
    with progress("reading config"):
        config = source.load_config(src)
        spec = read_spec(config)
        source.check_weights_hold(src, spec.num_layers)  # NOTE: before transformers builds the model
        spec = end_tokens.with_generation_eos(spec, src)
    opts, attention_note = default_attention(opts, mla=spec.mla is not None)
    max_len = opts.max_seq_len or min(spec.max_positions, MAX_ROPE_TABLE)
    if spec.position == "learned" and max_len > spec.max_positions:
        raise ConfigError(f"--max-seq-len {max_len} exceeds the {spec.max_positions} learned positions "
                          f"of this model")
    kv_dtype = opts.kv_dtype or opts.dtype
    if spec.mla is not None:
        from .mla import check_build

        check_build(spec, opts.layout, kv_dtype, opts.weight_quantization())
    if kv_dtype is io.DType.INT4 and spec.head_dim % io.KV_INT4_GROUP:
        raise ConfigError(f"--kv-dtype int4 needs head_dim a multiple of {io.KV_INT4_GROUP} (its channels share a "
                          f"scale in groups of {io.KV_INT4_GROUP}); this model's head_dim is {spec.head_dim}: "
                          f"use --kv-dtype int8 or fp32")
    with progress("loading weights"):
        model = source.load_model(src)
        weights = FAMILIES[spec.family].weights(model.state_dict(), spec)
        rope = model_rope_tables(spec, model.model.rotary_emb, max_len) if spec.position == "rope" else None
        tokenizer = source.load_tokenizer(src)
    scales = offsets = quantization = None
    if kv_dtype in (io.DType.INT8, io.DType.INT4):
        from . import calibrate

        text = Path(opts.calibration_text) if opts.calibration_text else None
        if tokenizer is not None and text is None:
            text = calibrate.default_text(why=f"--kv-dtype {kv_dtype.value} calibrates on a text")
        ids = calibrate.calibration_ids(tokenizer, spec.vocab_size, text, opts.calibration_tokens)
    if kv_dtype is io.DType.INT8 and spec.mla is not None:  # MLA: one scale row [L + R] per layer
        from . import mla

        with progress("calibrating int8 latent KV scales"):
            scales = mla.calibrate_latent(model, ids, spec)
            quantization = mla.quantization_entry(scales, text.name if text else "random-ids", ids)
    elif kv_dtype is io.DType.INT8:
        with progress("calibrating int8 KV scales"):
            scales = calibrate.compute_scales(model, ids, rotary_dim=spec.rotary_dim if spec.rope else 0)
            quantization = calibrate.quantization_entry(scales, text.name if text else "random-ids", ids)
    elif kv_dtype is io.DType.INT4 and spec.mla is not None:  # refused by exporter/mla.py with its reason
        quantization = {"scheme": io.KV_INT4_FORMAT}
    elif kv_dtype is io.DType.INT4:  # dynamic scales; calibrated: the key transform (exporter/kv_int4.py)
        with progress("calibrating the int4 KV key transform"):
            # NOTE: the call `kvexport calibrate` makes (μ only for plain softmax attention: key_offset_layers)
            offsets, transform = calibrate.int4_key_transform(model, spec, ids, text.name if text else "random-ids")
        quantization = {"scheme": io.KV_INT4_FORMAT, "group": io.KV_INT4_GROUP, "rotation": "hadamard",
                        "row_bytes": io.kv_row_width(spec.head_dim, "int4"), "key_transform": transform}

    wq, qweights, wrecord = _weight_form(src, opts, tokenizer), None, None
    if wq.quantized:
        from . import mla
        from .quantize import describe
        from .weight_sources import quantized_weights

        with progress(f"quantizing weights ({wq.precision}, {wq.method})"):
            # NOTE: TensorRT dequantizes INT8 only per channel, so its builds' int8 head is per channel
            weights, qweights, requantized, method_info = quantized_weights(
                src, model, spec, weights, wq, tokenizer, opts.calibration_text, opts.calibration_tokens,
                head_block=0 if opts.backend == "tensorrt" else None)
            accuracy = opts.weight_matmul_accuracy or default_matmul_accuracy(wq.method)
            kept = KEPT | (mla.KEPT if spec.mla is not None else {}) | (MOE_KEPT if spec.moe is not None else {})
            wrecord = describe(qweights, wq, opts.dtype.numpy_name, kept, requantized, method_info, accuracy)
            wrecord = replace(wrecord, serving=serving_words(wrecord, opts.dtype.value))

    # paged builds of full-attention + windowed layers: the windowed layers' KV is its own cache
    # group (kvexport/io.py), released behind the window by the runtime
    windows = tuple(spec.window(i) for i in range(spec.num_layers))
    groups = io.kv_groups(windows)
    local_window = io.local_window(windows) if opts.layout is io.KVLayout.PAGED else None
    layer_groups = groups if local_window is not None else None
    store = WeightStore()
    graphs = {}
    for phase in (io.Phase.PREFILL, io.Phase.DECODE):
        with progress(f"exporting {phase.value} graph"):
            g = GraphOptions(opts.layout, phase, opts.dtype, kv_dtype, opts.block_size, max_len, opts.all_logits,
                             opts.attention, scales, offsets, qweights=qweights, layer_groups=layer_groups)
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
        if tokenizer is not None:  # tokenizer/ and root copies any transformers >= 4.40 / onnxruntime-genai read
            tok_dir = interop.write_tokenizer(tokenizer, d)
    stored = {id(a): (k, a) for k, a in store.arrays.items()}.values()  # an alias (WeightStore.alias) counts once
    n_params = sum(int(np.prod(store.packed[k][1])) if k in store.packed else a.size for k, a in stored
                   if not k.startswith("rope.") and not k.endswith((".scale", ".zero_point", ".offset")))
    del graphs, store

    notes = [attention_note] if attention_note else []
    if opts.dtype is io.DType.FP16:
        notes.append("fp16: matmul weights/activations in float16; norms, RoPE and attention in float32")
    if wq.quantized:
        notes.append(f"{wrecord.form()} weights: DequantizeLinear -> MatMul (opset 21); LM head and tied "
                     f"embeddings int8; served as {wrecord.serving} (weights.quantization)")
    if kv_dtype is io.DType.INT8:
        notes.append("int8 KV: static symmetric scales per layer and KV head (kv.quantization); "
                     "QuantizeLinear on write, DequantizeLinear on read")
    if kv_dtype is io.DType.INT4:
        notes.append(f"int4 KV: {io.KV_INT4_FORMAT} (kv.quantization): 4-bit codes with a float16 scale per "
                     f"token, KV head and {io.KV_INT4_GROUP} channels in the pool rows; q, k, v Hadamard-rotated")
    if opts.attention is io.Attention.PLUGIN:
        notes.append("plugin attention: kvexport::PagedAttention nodes; onnxruntime (CPU) runs them with the "
                     "native op library (kvexport.plugins.paged_attention.native; scripts/build_cpu_ops.sh) or "
                     "the reference custom op (kvexport.plugins.paged_attention.ort), TensorRT with the plugin")
    manifest = Manifest(
        schema_version=io.SCHEMA_VERSION, kvexport_version=__version__, source=src.to_json(),
        model=ModelEntry(spec.to_json()), dtype=opts.dtype.value,
        kv=KVSpec(opts.layout.value, opts.attention.value, kv_dtype.value,
                  opts.block_size if opts.layout is io.KVLayout.PAGED else 0, spec.num_layers,
                  *io_kv_shape(spec), io.kv_bytes_per_token(spec.num_layers, *io_kv_shape(spec), kv_dtype,
                                                            spec.mla is not None), max_len,
                  quantization, local_window, spec.mla.kv_lora_rank if spec.mla is not None else None),
        graphs=entries, weights=WeightsEntry(io.WEIGHTS_FILE, weight_bytes, n_params, wq.precision, wrecord),
        tokenizer=tok_dir,
        all_logits=opts.all_logits, validation=None, tools=versions(), notes=tuple(notes))

    with progress("writing sample inputs"):
        manifest = replace(manifest, samples=write_samples(d, manifest))

    if opts.validate:
        prompts, steps = fit_prompts(prompt_ids(tokenizer, spec.vocab_size), max_len, opts.validate_steps)
        manifest = replace(manifest, validation=validate(d, manifest, model, prompts, steps, progress))
        if not manifest.validation.passed:
            raise ValidationError("exported graphs disagree with transformers beyond the bounds "
                                  "(exporter/validate.py):\n" + "\n".join(verdicts(manifest)))
    with progress("writing config.json, generation_config.json, genai_config.json"):
        interop.write_side_files(d, manifest=manifest, config=config,
                                 model_generation_config=getattr(model, "generation_config", None))
    manifest.save(d)
    return manifest
