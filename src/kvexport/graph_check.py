"""Cross-check of a build's manifest against its ONNX graphs, run by `manifest.load()`: a
manifest whose kv spec or graph I/O disagrees with the .onnx files is refused with a
ManifestError naming the field, before any session is made (never an onnxruntime traceback).

Cheap: each graph is read with `onnx.load(path, load_external_data=False)` (no weights), and
only its declared inputs and outputs are looked at:

  1. it is a kvexport graph (an ONNX model with an `input_ids` input);
  2. its layers of KV tensors (key_cache.{i} / past_key_values.{i}.key inputs, present.{i}.key /
     new_key.{i} / key_cache_out.{i} outputs) number kv.num_layers;
  3. every tensor io.graph_io() gives for the manifest's layout and attention is there, with the
     manifest's KV heads, head_dim, block size and vocab on the right axes and the manifest's
     KV and activation dtypes, and there are no others;
  4. the manifest's own graphs[phase].inputs / outputs equal the graph's, in order;
  5. the position tables stored in the graphs fix the context: every RoPE cos/sin table
     (`rope[.local][.long].cos|sin`, [max_seq_len, rotary_dim / 2]) has kv.max_seq_len rows
     and, for the global kind, model.rotary_dim / 2 columns; a learned position table
     (`model.embed_positions.weight`) has at least kv.max_seq_len rows. Only the initializers'
     dims in the graph proto are read, never the weights file (a position past a table's rows
     is an onnxruntime out-of-bounds Gather, after the whole prompt ran).

NOTE: tensor names and axis orders come from kvexport/io.py alone: io.graph_io() is called with
negative stand-ins for the sizes, so where each size sits in each tensor's shape is read off
the contract, never spelt here (a real dimension is never negative).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from . import io
from .errors import ManifestError

_REBUILD = "rebuild with `kvexport build --force`"
# stand-in -> manifest field whose value belongs at that axis
_HEADS, _BLOCK, _HEAD_DIM, _VOCAB = -1, -2, -3, -4
_ACT, _KV = "<dtype>", "<kv.dtype>"
_LAYER_NAMES = (io.key_cache, io.past_key, io.present_key, io.new_key, io.key_cache_out, io.latent_cache, io.new_latent,
                io.latent_cache_out)


# NOTE: `m` below is a kvexport.manifest.Manifest; manifest.load() calls this module, so it does not import it
def check_graphs(build_dir: Path, m) -> None:
    """Refuse (ManifestError) a manifest that does not describe the graphs it lists."""
    for phase, entry in m.graphs.items():
        path = Path(build_dir) / entry.file
        model = _load(path)
        inputs, outputs = _graph_io(model)
        try:
            check_graph_io(m, io.Phase(phase), inputs, outputs, path.name)
            check_tables(m, {t.name: tuple(t.dims) for t in model.graph.initializer}, path.name)
        except ManifestError as e:
            raise ManifestError(f"{build_dir}: {e}") from None


def _load(path: Path) -> Any:
    """The graph proto of `path` without its external data (cheap: no weights are read)."""
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # NOTE: DecodeError, OSError, ValueError... from protobuf or onnx: all mean unreadable
        raise ManifestError(f"{path} is not a readable ONNX model ({type(e).__name__}: {e}); {_REBUILD}") from None


def _graph_io(model: Any) -> tuple[tuple[io.TensorSpec, ...], tuple[io.TensorSpec, ...]]:
    initializers = {t.name for t in model.graph.initializer}
    inputs = tuple(_spec(v) for v in model.graph.input if v.name not in initializers)
    return inputs, tuple(_spec(v) for v in model.graph.output)


def _spec(value_info: Any) -> io.TensorSpec:
    import onnx

    t = value_info.type.tensor_type
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
    except (KeyError, ValueError, TypeError):
        dtype = f"onnx element type {t.elem_type}"
    dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim)
    return io.TensorSpec(value_info.name, dtype, dims)


def _fmt(t: io.TensorSpec) -> str:
    return f"{t.name!r} {t.dtype} [{', '.join(map(str, t.shape))}]"


def check_graph_io(m, phase: io.Phase, inputs: tuple[io.TensorSpec, ...],
                   outputs: tuple[io.TensorSpec, ...], name: str) -> None:
    """Rules 1-4 of the module docstring for one graph (`name`: its file name, for messages)."""
    kv = m.kv
    names = {t.name for t in inputs + outputs}
    if io.INPUT_IDS not in names:
        raise ManifestError(f"{name} is not a kvexport graph (no input {io.INPUT_IDS!r}; inputs "
                            f"{[t.name for t in inputs][:6]}): corrupt or replaced? {_REBUILD}")
    # the layers holding KV pools: all, or (hybrids' linear layers, shared KV) those io.kv_layout gives
    kv_layers, dims = io.kv_layout(m.model.spec, kv.num_kv_heads, kv.head_dim)
    # layers of another KV shape than kv.num_kv_heads x kv.head_dim (Gemma 4's global layers): checked as given
    layer_dims = None if len(set(dims)) == 1 else tuple(
        (_HEADS if h == kv.num_kv_heads else h, _HEAD_DIM if d == kv.head_dim else d) for h, d in dims)
    want_layers = list(kv_layers) if kv_layers is not None else list(range(kv.num_layers))
    have_layers = [i for i in range(max(kv.num_layers, 1) + 1) if any(f(i) in names for f in _LAYER_NAMES)]
    if have_layers != want_layers:
        layers = len(have_layers) if kv_layers is not None else next(
            (n for n in range(len(have_layers) + 1) if n not in have_layers), len(have_layers))
        raise ManifestError(f"manifest field 'kv.num_layers' is {kv.num_layers}, but {name} has KV tensors of "
                            f"{layers} layers; the manifest does not describe this build: {_REBUILD}")

    sizes = {_HEADS: ("kv.num_kv_heads", kv.num_kv_heads), _BLOCK: ("kv.block_size", kv.block_size),
             # NOTE: the KV tensors' last axis; int4 pools hold io.kv_row_width bytes per head_dim channels
             _HEAD_DIM: ("kv.head_dim", io.kv_row_width(kv.head_dim, io.DType(kv.dtype).numpy_name)),
             _VOCAB: ("model.vocab_size", m.model.vocab_size)}
    dtypes = {_ACT: ("dtype", io.DType(m.dtype).numpy_name), _KV: ("kv.dtype", io.DType(kv.dtype).pool_dtype)}
    template = io.graph_io(layout=io.KVLayout(kv.layout), phase=phase, num_layers=kv.num_layers,
                           num_kv_heads=_HEADS, head_dim=_HEAD_DIM, vocab_size=_VOCAB, block_size=_BLOCK,
                           act_dtype=_ACT, kv_dtype=_KV, all_logits=m.all_logits, attention=io.Attention(kv.attention),
                           layer_groups=m.layer_groups, latent=kv.latent and kv.layout == io.KVLayout.PAGED.value,
                           logits_indices=m.logits_indices, scores=bool(kv.attention_scores),
                           kv_layers=kv_layers, layer_dims=layer_dims, state=io.state_dims(m.model.spec),
                           hidden_layers=m.graphs[phase.value].hidden_layers or (),
                           hidden_size=m.model.spec.get("hidden_size", 0),
                           lora=tuple(tuple(x) for x in m.lora["layers"]) if m.lora else ())
    build = f"a {kv.layout} build with {kv.attention} attention{' and all logits' if m.all_logits else ''}"
    pairs = (("input", template.inputs, inputs), ("output", template.outputs, outputs))
    for kind, want, got in pairs:  # names first: a wrong layout or attention shows as a missing tensor
        have = {t.name for t in got}
        missing = [w.name for w in want if w.name not in have]
        if missing:
            raise ManifestError(f"{name} has no {kind} {missing[0]!r}, which {build} has: the manifest's 'kv.layout' / "
                                f"'kv.attention' / 'all_logits' do not describe this graph; {_REBUILD}")
        extra = [n for n in have - {w.name for w in want}]
        if extra:
            raise ManifestError(f"{name} has {kind}s {sorted(extra)[:4]} that {build} of {kv.num_layers} layers does "
                                f"not have: the manifest does not describe this graph; {_REBUILD}")
    for kind, want, got in pairs:
        by_name = {t.name: t for t in got}
        for w in want:
            _check_tensor(w, by_name[w.name], kind, name, sizes, dtypes)

    entry = m.graphs[phase.value]
    for kind, listed, got in (("inputs", entry.inputs, inputs), ("outputs", entry.outputs, outputs)):
        if listed != got:
            i = next((i for i, (a, b) in enumerate(zip(listed, got)) if a != b), min(len(listed), len(got)))
            theirs = _fmt(got[i]) if i < len(got) else "nothing"
            ours = _fmt(listed[i]) if i < len(listed) else "nothing"
            raise ManifestError(f"manifest field 'graphs.{phase.value}.{kind}' disagrees with {name} at {kind[:-1]} "
                                f"{i}: the graph has {theirs}, the manifest lists {ours}; {_REBUILD}")


def _check_tensor(want: io.TensorSpec, got: io.TensorSpec, kind: str, name: str,
                  sizes: dict[int, tuple[str, int]], dtypes: dict[str, tuple[str, str]]) -> None:
    """One tensor against its template: dtype, rank, and each axis (a manifest size, a fixed
    int, or a dynamic axis name)."""
    if want.dtype in dtypes:
        field, dtype = dtypes[want.dtype]
        if got.dtype != dtype:
            raise ManifestError(f"manifest field {field!r} says {dtype}, but {name}'s {kind} {_fmt(got)} is "
                                f"{got.dtype}; {_REBUILD}")
    elif got.dtype != want.dtype:
        raise ManifestError(f"{name}'s {kind} {_fmt(got)} should be {want.dtype} (kvexport/io.py); {_REBUILD}")
    if len(got.shape) != len(want.shape):
        raise ManifestError(f"{name}'s {kind} {_fmt(got)} has {len(got.shape)} axes, a graph of this manifest "
                            f"has {len(want.shape)}; {_REBUILD}")
    for axis, (w, g) in enumerate(zip(want.shape, got.shape)):
        if isinstance(w, int) and w in sizes:
            field, value = sizes[w]
            if g != value:
                raise ManifestError(f"manifest field {field!r} is {value}, but {name}'s {kind} {_fmt(got)} has {g!r} "
                                    f"on that axis ({axis}); {_REBUILD}")
        elif g != w and not (w == io.SEQ and g == 1):
            # NOTE: contiguous decode graphs made before the sequence axis became dynamic (for
            # optimum / onnxruntime-genai) declare it as 1; the runtime feeds one token a step,
            # so those builds still serve
            raise ManifestError(f"{name}'s {kind} {_fmt(got)} has {g!r} on axis {axis}, kvexport/io.py says {w!r}; "
                                f"{_REBUILD}")


# RoPE tables as exporter/graph.py names them: "rope" (global kind) or "rope.local", then ".long"
# for longrope's long set, then ".cos" / ".sin"; learned positions (GPT-2) as its family stores them
_ROPE_TABLE = re.compile(r"rope(\.local)?(\.long)?\.(cos|sin)")
_LEARNED_POSITIONS = ("model.embed_positions.weight", "model.embed_positions.weight.q")


def check_tables(m, dims: dict[str, tuple[int, ...]], name: str) -> None:
    """Rule 5 of the module docstring for one graph: `dims` maps each initializer's name to its
    dims (from the graph proto; `name`: the graph's file name, for messages)."""
    claim = m.kv.max_seq_len
    redo = (f"rebuild with `kvexport build MODEL --max-seq-len {claim} --force` to serve {claim} tokens, or "
            f"restore the manifest the build was written with")
    for table, shape in sorted(dims.items()):
        if (match := _ROPE_TABLE.fullmatch(table)) is not None:
            if len(shape) != 2:
                raise ManifestError(f"{name}'s RoPE table {table!r} has dims {list(shape)}, not [positions, "
                                    f"rotary_dim / 2]: corrupt or replaced? {_REBUILD}")
            if shape[0] != claim:
                raise ManifestError(f"manifest field 'kv.max_seq_len' is {claim}, but {name}'s RoPE table {table!r} "
                                    f"has {shape[0]} rows: the graphs serve positions 0..{shape[0] - 1}, a context "
                                    f"of {shape[0]} tokens; {redo}")
            half = m.model.rotary_dim // 2
            # Gemma 4: layers of another head_dim (model.layer_head_dims) have their RoPE table's width
            halves = {int(d * m.model.rotary_dim / m.model.head_dim) // 2
                      for d in m.model.spec.get("layer_head_dims") or (m.model.head_dim,)}
            if match.group(1) is None and shape[1] not in halves:
                raise ManifestError(f"manifest fields 'model.head_dim' / 'model.rope.partial_rotary_factor' give "
                                    f"{half} rotated channel pairs, but {name}'s RoPE table {table!r} has "
                                    f"{shape[1]}; {_REBUILD}")
        elif table in _LEARNED_POSITIONS and (not shape or shape[0] < claim):
            rows = shape[0] if shape else 0
            raise ManifestError(f"manifest field 'kv.max_seq_len' is {claim}, but {name}'s learned position table "
                                f"{table!r} has {rows} rows: the graphs serve a context of at most {rows} tokens; "
                                f"{redo}")
