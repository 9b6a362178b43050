"""`kvexport build`: model source -> build directory (graphs, shared weights, tokenizer,
manifest), validated against transformers. The build runs as named stages, each a small
function with typed inputs and outputs:

    resolve   source.resolve(model)                        -> ModelSource
    read      read_model(src, opts)                         -> Plan (spec, options decided, KV form)
    load      load(src, plan)                               -> Loaded (transformers model, weights, RoPE, tokenizer)
    KV form   kv_forms.kv_constants(plan.kv, ...)           -> KVConstants (scales / key transform)
    weights   weight_form.weight_form(src, opts, ...)       -> WeightForm (float or int8/int4 QDQ)
    graphs    write_graphs(d, plan, loaded, kv, wf)         -> Graphs (prefill + decode, weights.data, tokenizer)
    manifest  make_manifest(src, plan, kv, wf, graphs)      -> Manifest (+ sample inputs)
    validate  validated(d, manifest, plan, loaded)          -> Manifest (the comparison with transformers)

NOTE: everything is written into a temporary sibling directory and renamed into place
only after the manifest is written (kvexport/outputs.py, which also decides what --force may
replace), so an interrupted build never leaves a directory that looks complete; the manifest
is the last file written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvexport import __version__, io, outputs
from kvexport.errors import ConfigError, ValidationError
from kvexport.manifest import GraphEntry, KVSpec, Manifest, ModelEntry, WeightsEntry, sha256, versions

from . import end_tokens, interop, linear_attention, lora, mla, source
from .families import FAMILIES, read_spec
from .graph import DecoderGraph, GraphOptions, model_rope_tables
from .kv_forms import KVConstants, KVForm, kv_constants, kv_form
from .onnx_builder import WeightStore, save_model
from .options import BuildOptions
from .progress import Progress, quiet_step
from .samples import write_samples
from .spec import ModelSpec
from .tensorrt_build import EngineBuildOptions, add_engines
from .validate import fit_prompts, prompt_ids, validate, verdicts
from .weight_form import WeightForm, weight_form

log = logging.getLogger(__name__)
MAX_ROPE_TABLE = 32768  # default cap on max_seq_len when the model allows more, tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What the build makes, decided from the options and the model's config before any weight is read."""

    opts: BuildOptions  # with the attention decided (default_attention)
    config: Any  # transformers' config (config.json / GGUF metadata)
    spec: ModelSpec  # the normalized model spec, end tokens included
    kv: KVForm  # the KV form (exporter/kv_forms.py)
    max_len: int  # longest context served, tokens
    attention_note: str | None = None  # why the attention fell back to onnx (None: it did not)
    lora: Any = None  # exporter/lora.py LoraAdapter merged into the weights (--lora); None: none
    hidden_layers: tuple[int, ...] = ()  # io.HIDDEN_STATES boundaries (--hidden-states); (): no such output
    lora_plan: dict | None = None  # the adapters the graphs take at serve time (exporter/lora.py serve_plan)


@dataclass(frozen=True, slots=True, kw_only=True)
class Loaded:
    """The model as transformers loads it, and what the graphs are built from."""

    model: Any  # the transformers model (float32), also the validation reference
    weights: Any  # exporter/families.py ModelWeights
    rope: Any  # RoPE cos/sin tables up to max_len (exporter/graph.py model_rope_tables); None: no RoPE
    tokenizer: Any  # transformers tokenizer; None: the source has none


@dataclass(frozen=True, slots=True, kw_only=True)
class Graphs:
    """The graphs written into the build directory."""

    entries: dict[str, GraphEntry]  # io.Phase value -> graph
    weight_bytes: int  # size of io.WEIGHTS_FILE, bytes
    parameters: int  # model parameters stored (RoPE tables and quantization constants not counted)
    tokenizer: str | None  # the tokenizer folder inside the build; None: no tokenizer
    local_window: int | None  # paged builds of full-attention + windowed layers: the local group's window
    weights_sha256: str  # hex sha256 of io.WEIGHTS_FILE (checked before serving: kvexport/verify.py)


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

    kv_dtype = opts.kv
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
          progress: Progress = quiet_step) -> tuple[Path, Manifest]:
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
        with progress("building TensorRT engines"):
            manifest = add_engines(out, opts.engines or EngineBuildOptions())
    return out, manifest


def _build_into(d: Path, src: source.ModelSource, opts: BuildOptions, progress: Progress) -> Manifest:
    """The stages, in order, writing into `d`."""
    plan = read_model(src, opts, progress)
    loaded = load(src, plan, progress)
    kv = kv_constants(plan.kv, loaded.model, plan.spec, loaded.tokenizer, opts.calibration_text,
                      opts.calibration_tokens, progress)
    wf = weight_form(src, plan.opts, loaded.model, plan.spec, loaded.weights, loaded.tokenizer, progress)
    graphs = write_graphs(d, plan, loaded, kv, wf, progress)
    manifest = make_manifest(src, plan, kv, wf, graphs)
    with progress("writing sample inputs"):
        manifest = replace(manifest, samples=write_samples(d, manifest))
    manifest = validated(d, manifest, plan, loaded, progress)
    with progress("writing config.json, generation_config.json, genai_config.json"):
        interop.write_side_files(d, manifest=manifest, config=plan.config,
                                 model_generation_config=getattr(loaded.model, "generation_config", None))
    manifest.save(d)
    return manifest


def read_model(src: source.ModelSource, opts: BuildOptions, progress: Progress) -> Plan:
    """The "read" stage: the config read into a spec, the options decided for it (attention,
    context) and checked against it, the KV form chosen; ConfigError before any weight is loaded."""
    with progress("reading config"):
        config = source.load_config(src)
        spec = read_spec(config)
        source.check_weights_hold(src, spec.num_layers)  # NOTE: before transformers builds the model
        spec = end_tokens.with_generation_eos(spec, src)
    if spec.linear_attn is not None:
        linear_attention.graph_io_fields(spec, opts)  # hybrids: their refusals, before any weight is loaded
    opts, attention_note = default_attention(opts, mla=spec.mla is not None)
    max_len = opts.max_seq_len or min(spec.max_positions, MAX_ROPE_TABLE)
    if spec.position == "learned" and max_len > spec.max_positions:
        raise ConfigError(f"--max-seq-len {max_len} exceeds the {spec.max_positions} learned positions "
                          f"of this model")
    if spec.mla is not None:
        mla.check_build(spec, opts.layout, opts.weight_quantization())
    hidden: tuple[int, ...] = ()
    if opts.hidden_states is not None:
        try:
            hidden = io.hidden_state_layers(opts.hidden_states, spec.num_layers)
        except ValueError as e:
            raise ConfigError(f"--hidden-states {e}") from None
    adapter = lora.read(opts.lora) if opts.lora else None  # NOTE: checked before any weight is loaded
    lora_plan = lora.serve_plan(spec, opts.lora_max_rank, opts.lora_targets) if opts.lora_max_rank else None
    if adapter is not None and src.kind == "hf":
        from . import prequantized

        if prequantized.config_of(src.directory) is not None:
            raise ConfigError(f"--lora: {src.name} is pre-quantized (its codes are kept exactly, and a merged adapter "
                              f"would change them); merge into the float checkpoint it was quantized from, then "
                              f"quantize with --weights int8|int4")
    return Plan(opts=opts, config=config, spec=spec, kv=kv_form(opts.kv, spec), max_len=max_len,
                attention_note=attention_note, lora=adapter, hidden_layers=hidden, lora_plan=lora_plan)


def load(src: source.ModelSource, plan: Plan, progress: Progress) -> Loaded:
    """The "load" stage: transformers loads the model; the family reads its weights."""
    spec = plan.spec
    with progress("loading weights"):
        tokenizer = source.load_tokenizer(src)
        source.check_tokenizer(tokenizer, spec.vocab_size, src)  # NOTE: before the weights: a refusal costs nothing
        model = source.load_model(src)
        if plan.lora is not None:  # the merged model is also the validation reference
            lora.merge_into(model, plan.lora)
        weights = FAMILIES[spec.family].weights(model.state_dict(), spec)
        rope = model_rope_tables(spec, model.model.rotary_emb, plan.max_len) if spec.position == "rope" else None
    return Loaded(model=model, weights=weights, rope=rope, tokenizer=tokenizer)


def scores_declared(opts, spec) -> bool:
    """Whether the build's graphs return attention scores (io.OBSERVATION_LENS; importance eviction,
    runtime/core/importance.py): paged builds for onnxruntime (`plugin` and `onnx` attention; MLA models
    with `plugin` attention: kvexport::PagedMLA scores, its `onnx` form does not).
    NOTE: the TensorRT plugins take no observation_lens yet (plugins/paged_attention/spec.py "Attention
    scores")."""
    return (opts.layout is io.KVLayout.PAGED and opts.backend == "onnxruntime"
            and (spec.mla is None or opts.attention is io.Attention.PLUGIN))


def write_graphs(d: Path, plan: Plan, loaded: Loaded, kv: KVConstants, wf: WeightForm,
                 progress: Progress) -> Graphs:
    """The "graphs" stage: prefill and decode graphs sharing one weights file, and the tokenizer."""
    opts, spec = plan.opts, plan.spec
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
            g = GraphOptions(opts.layout, phase, opts.dtype, opts.kv, opts.block_size, plan.max_len, opts.all_logits,
                             opts.attention, kv.scales, kv.offsets, qweights=wf.qweights, layer_groups=layer_groups,
                             logits_indices=opts.layout is io.KVLayout.PAGED, scores=scores_declared(opts, spec),
                             hidden_layers=plan.hidden_layers, lora_plan=plan.lora_plan)
            dg = DecoderGraph(spec, wf.weights, loaded.rope, g, store)
            graphs[phase] = (dg.build(), dg.io)
    with progress("writing graphs and weights"):
        weight_bytes = store.write(str(d / io.WEIGHTS_FILE))
        weights_sha256 = sha256(d / io.WEIGHTS_FILE)  # NOTE: read back from the page cache, ~1.5 s/GiB
        entries = {}
        for phase, (builder, gio) in graphs.items():
            name = io.PREFILL_GRAPH if phase is io.Phase.PREFILL else io.DECODE_GRAPH
            save_model(builder.to_model(io.WEIGHTS_FILE, doc=f"kvexport {phase.value} graph"), str(d / name))
            entries[phase.value] = GraphEntry(name, gio.inputs, gio.outputs, (d / name).stat().st_size,
                                              hidden_layers=plan.hidden_layers or None)
        tok_dir = None
        if loaded.tokenizer is not None:  # tokenizer/ and root copies any transformers >= 4.40 / onnxruntime-genai read
            tok_dir = interop.write_tokenizer(loaded.tokenizer, d)
    stored = {id(a): (k, a) for k, a in store.arrays.items()}.values()  # an alias (WeightStore.alias) counts once
    n_params = sum(int(np.prod(store.packed[k][1])) if k in store.packed else a.size for k, a in stored
                   if not k.startswith("rope.") and not k.endswith((".scale", ".zero_point", ".offset")))
    return Graphs(entries=entries, weight_bytes=weight_bytes, parameters=n_params, tokenizer=tok_dir,
                  local_window=local_window, weights_sha256=weights_sha256)


def notes(plan: Plan, kv: KVForm, wf: WeightForm) -> tuple[str, ...]:
    """The manifest's notes: the attention's fallback, then one per form the build stores."""
    opts = plan.opts
    out = [plan.attention_note] if plan.attention_note else []
    if opts.dtype is io.DType.FP16:
        out.append("fp16: matmul weights/activations in float16; norms, RoPE and attention in float32")
    out += [n for n in (wf.note(), kv.note) if n]
    if opts.attention is io.Attention.PLUGIN:
        out.append("plugin attention: kvexport::PagedAttention nodes; onnxruntime (CPU) runs them with the "
                   "native op library (kvexport.plugins.paged_attention.native; scripts/build_cpu_ops.sh) or "
                   "the reference custom op (kvexport.plugins.paged_attention.ort), TensorRT with the plugin")
    return tuple(out)


def make_manifest(src: source.ModelSource, plan: Plan, kv: KVConstants, wf: WeightForm, graphs: Graphs) -> Manifest:
    """The "manifest" stage: the build's manifest (not validated yet, no samples)."""
    opts, spec = plan.opts, plan.spec
    heads, width = io_kv_shape(spec)
    latent = spec.mla is not None
    kv_spec = KVSpec(layout=opts.layout.value, attention=opts.attention.value, dtype=opts.kv.value,
                     block_size=opts.block_size if opts.layout is io.KVLayout.PAGED else 0,
                     num_layers=spec.num_layers, num_kv_heads=heads, head_dim=width,
                     bytes_per_token=io.kv_bytes_per_token_model(spec.to_json(), heads, width, opts.kv, latent),
                     max_seq_len=plan.max_len, quantization=kv.quantization, local_window=graphs.local_window,
                     latent_rank=spec.mla.kv_lora_rank if latent else None,
                     attention_scores=True if scores_declared(opts, spec) else None)
    return Manifest(
        schema_version=io.SCHEMA_VERSION, kvexport_version=__version__,
        source=src.to_json() | ({"lora": plan.lora.to_json()} if plan.lora is not None else {}),
        model=ModelEntry(spec.to_json()), dtype=opts.dtype.value, kv=kv_spec, graphs=graphs.entries,
        weights=WeightsEntry(io.WEIGHTS_FILE, graphs.weight_bytes, graphs.parameters, wf.quantization.precision,
                             wf.record, sha256=graphs.weights_sha256),
        tokenizer=graphs.tokenizer, all_logits=opts.all_logits, validation=None, tools=versions(),
        notes=notes(plan, plan.kv, wf), lora=plan.lora_plan)


def validated(d: Path, manifest: Manifest, plan: Plan, loaded: Loaded, progress: Progress) -> Manifest:
    """The "validate" stage: the graphs against transformers (exporter/validate.py), recorded in
    the manifest; ValidationError when they disagree beyond the bounds. Skipped with --no-validate."""
    if not plan.opts.validate:
        return manifest
    prompts, steps = fit_prompts(prompt_ids(loaded.tokenizer, plan.spec.vocab_size), plan.max_len,
                                 plan.opts.validate_steps)
    manifest = replace(manifest, validation=validate(d, manifest, loaded.model, prompts, steps, progress))
    if not manifest.validation.passed:
        raise ValidationError("exported graphs disagree with transformers beyond the bounds "
                              "(exporter/validate.py):\n" + "\n".join(verdicts(manifest)))
    return manifest


