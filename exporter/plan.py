"""`kvexport plan`: will a model fit? This module owns the answer. It reads a model's shape
without its weights (an HF folder, whose config.json is enough, a bare config.json, a GGUF's
metadata, an alias, or a build's manifest), and reports

    weights   parameters and bytes per precision (fp32, fp16, int8 / int4 as quantize.py stores them),
              counted in exporter/plan_weights.py
    KV        bytes per token per KV cache group (GQA/MQA heads, per-layer windows), per KV dtype,
              plus what a KV dtype needs outside the pool (int8's static scales, int4's key transform)
    fit       for a memory size, per KV dtype and layout: how many sequences of max_model_len
              tokens fit at once, and (given max_num_seqs) the longest context each can have; a
              hybrid's sequences each hold their recurrent state beside their KV, and its state
              checkpoints (EngineConfig.state_checkpoints, at most) come off the budget first

NOTE: one formula, one pool sizing. KV bytes come from kvexport/io.py
(`kv_bytes_per_token_by_group`, `kv_static_bytes`) and the paged pools from
runtime/core/memory.py `kv_pool_sizes`, the calls runtime/engine.py makes, so a plan's block
counts are the engine's for the same budget and settings. What a paged sequence holds follows
the KV cache managers and the scheduler:

    full attention            ceil(L / bs) blocks, for its whole life
    every layer windowed (W)  the scheduler frees blocks behind the window (one group), so a
                              sequence longer than ceil(W / bs) + 1 blocks is budgeted as the
                              local group is (windowed_kv_cache_manager.py `local_blocks_needed`:
                              ceil(W / bs) + 1 each, plus one step's new tokens' blocks); the
                              scheduler still caps a sequence at the pool's tokens
    full + windowed layers    two groups, split by `kv_pool_sizes` for max_num_seqs sequences;
                              the full group holds ceil(L / bs) blocks per sequence

`contiguous` (interop: optimum, onnxruntime-genai) reserves max_model_len tokens of every
layer per sequence; windows free nothing there.

Extension point: the KV dtypes tabulated are exporter/limits.py `KV_DTYPES`; a new KV form
(int4, MLA's latent) appears here once it is listed there and kvexport/io.py gives its bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvexport import io
from kvexport import manifest as mf
from kvexport.errors import ConfigError, SourceError
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.core.windowed_kv_cache_manager import local_blocks_needed
from kvexport.runtime.core.memory import PoolSizes, kv_pool_sizes, parse_budget

from . import kv_forms, source
from .limits import KV_DTYPES, WEIGHT_PRECISIONS
from .options import range_of
from .plan_weights import WeightsEstimate, weights_estimate
from .spec import ModelSpec

LAYOUTS = (io.KVLayout.PAGED.value, io.KVLayout.CONTIGUOUS.value)
DEFAULT_MODEL_WEIGHTS = "fp16"  # weights of a model (not a build) when --weights is not given
MAX_DEFAULT_LEN = 32768  # a build's default max_seq_len cap (exporter/build.py MAX_ROPE_TABLE)


@dataclass(frozen=True, slots=True)
class BuildWeights:
    """A build's actual weights (its manifest's `weights` entry)."""

    precision: str  # matmul weights: fp32 | fp16 | int8 | int4
    bytes: int  # the weights file, bytes
    parameters: int  # model parameters stored in it, elements


@dataclass(frozen=True, slots=True)
class KVGroupBytes:
    group: str  # io.FULL_GROUP | io.LOCAL_GROUP (paged builds of full-attention + windowed layers)
    layers: int  # layers whose KV is in the group
    window: int | None  # tokens the group's layers look back (their largest window); None: full attention
    bytes_per_token: int  # K and V of the group's layers, one token, bytes


@dataclass(frozen=True, slots=True)
class KVBytes:
    """One KV dtype: io.kv_bytes_per_token_by_group of the model's paged KV cache groups."""

    kv_dtype: str  # io.DType value
    bytes_per_token: int  # all layers, one token, bytes (the manifest's kv.bytes_per_token)
    static_bytes: int  # outside the pool, whatever the tokens (int8: the scales, int4: the key transform), bytes
    groups: tuple[KVGroupBytes, ...]  # paged KV cache groups


@dataclass(frozen=True, slots=True)
class Fit:
    """One KV dtype and layout in the memory given."""

    kv_dtype: str  # io.DType value
    layout: str  # "paged" | "contiguous"
    kv_budget_bytes: int  # memory - weights - static KV - recurrent state (0: the weights alone do not fit), bytes
    num_blocks: int | None  # paged: blocks of each full-group pool (pad block included) the engine allocates
    # for max_num_seqs (given, else `max_seqs`); 0: the budget holds fewer than the minimum; None: contiguous
    local_num_blocks: int | None  # paged builds with a local group: its pools' blocks; else None
    max_seqs: int  # sequences of max_model_len tokens that fit at once
    max_context: int | None  # max_num_seqs given: the longest context each of them can have, tokens
    context_limit: str | None  # what bounds max_context: "memory" | "model" (its max positions / the build's)
    build: bool  # the build's own KV dtype and layout
    # hybrids: the recurrent state beside the KV: max_num_seqs (given, else max_seqs) running slots and the
    # checkpoint slots (`kvexport serve --state-checkpoints`), bytes; the KV pools get kv_budget_bytes
    state_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """What `plan()` found; `to_json()` is the `kvexport plan --json` object."""

    model: str  # what was planned (path or alias, as given)
    source: str  # "build" | "hf" (folder or config.json) | "gguf" | "alias"
    family: str  # registry name (exporter/families.py)
    model_type: str  # transformers model_type
    num_layers: int
    hidden_size: int  # elements
    num_heads: int  # query heads
    num_kv_heads: int  # KV heads (MLA: 1, the latent pool)
    head_dim: int  # elements per head (MLA: the latent row, kv_lora_rank + qk_rope_head_dim)
    attention: str  # "MHA" | "GQA" | "MQA" | "MLA: latent L + rope R"
    layer_windows: tuple[int | None, ...]  # each layer's window, tokens; None: full attention
    max_positions: int  # the model's trained context, tokens
    weights: tuple[WeightsEstimate, ...]  # per precision
    build_weights: BuildWeights | None  # a build's actual weights; None: a model
    kv: tuple[KVBytes, ...]  # per KV dtype
    block_size: int  # tokens per KV block (paged)
    max_model_len: int  # tokens per sequence the fit is for
    max_num_seqs: int | None  # sequences the longest context is for; None: not asked
    max_num_batched_tokens: int  # tokens per engine step (sizes a windowed group's blocks)
    memory_bytes: int | None  # the memory given; None: no fit asked
    fit_weights: str | None  # the weights precision the fit subtracts
    fit_weights_bytes: int | None  # its bytes (a build's own precision: the actual file)
    weights_fit: bool | None  # the weights alone fit in memory_bytes
    fits: tuple[Fit, ...]  # per KV dtype and layout; () without memory_bytes
    notes: tuple[str, ...]  # what the numbers assume
    # hybrids (gated DeltaNet layers, exporter/linear_attention.py): the recurrent state one sequence holds
    # whatever its length (io.state_bytes_per_sequence), bytes; 0: no linear layers
    state_bytes_per_seq: int = 0
    linear_layers: int = 0  # layers with recurrent state instead of KV

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# ---- reading a model without its weights --------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Model:
    kind: str  # Plan.source
    spec: ModelSpec
    manifest: mf.Manifest | None  # builds only


def read_model(model: str) -> _Model:
    """MODEL (anything `build` takes, a bare config.json, or a build) -> its spec; no weights read."""
    p = Path(model)
    if p.is_dir() and (p / io.MANIFEST_NAME).is_file():
        m = mf.load(p, check_graphs=False)
        return _Model("build", ModelSpec.from_json(m.model.spec), m)
    cfg = p / "config.json" if p.is_dir() else p
    if cfg.is_file() and cfg.suffix == ".json":
        from .families import read_spec

        return _Model("hf", read_spec(source.load_config_file(cfg)), None)
    if p.is_dir():
        raise SourceError(f"{p} has neither {io.MANIFEST_NAME} (a build) nor config.json (a model): give a build "
                          f"directory or a HF model folder")
    if not p.exists() and model not in source.ALIASES:
        raise SourceError(f"MODEL {model!r} does not exist: give a build directory, a HF model folder (its "
                          f"config.json is enough), a config.json, a .gguf file or an alias "
                          f"({', '.join(source.ALIASES)})")
    src = source.resolve(model)  # a .gguf (its metadata only) or an alias; anything else fails naming it
    from .families import read_spec

    return _Model(src.kind, read_spec(source.load_config(src)), None)


# ---- KV ------------------------------------------------------------------------------------
def kv_bytes(spec: ModelSpec, kv_dtype: io.DType) -> KVBytes:
    """KV bytes per token of `spec` per paged KV cache group (io.kv_groups of its layer windows)."""
    windows = tuple(spec.window(i) for i in range(spec.num_layers))
    groups = io.kv_groups(windows)
    heads, row = (1, spec.mla.row_width) if spec.mla is not None else (spec.num_kv_heads, spec.head_dim)
    latent = spec.mla is not None  # MLA: one latent pool per layer, layers x (kv_lora_rank + rope dim) x bytes
    # NOTE: per layer its own KV shape, and a cache shared by several layers (Gemma 4) once: only
    # spec.kv_layers hold pools (io.kv_bytes_per_token_layers, the runtime's sizing too)
    dims = tuple((heads, row) if latent else spec.layer_kv_shape(i) for i in range(spec.num_layers))
    per_group = io.kv_bytes_per_token_layers(groups, dims, spec.kv_layers, kv_dtype, latent)
    entries = []
    for g, b in per_group.items():
        ws = [w for i, (w, gg) in enumerate(zip(windows, groups)) if gg == g and i in spec.kv_layers]
        entries.append(KVGroupBytes(g, len(ws), None if None in ws else max(w for w in ws if w is not None), b))
    total = sum(per_group.values())
    if spec.kv_sources is None and spec.layer_head_dims is None and spec.layer_kv_heads is None \
            and spec.linear_attn is None:
        assert total == io.kv_bytes_per_token(spec.num_layers, heads, row, kv_dtype, latent)
    # NOTE: int8 scales / the int4 key transform are held per layer holding KV (a hybrid: its attention layers)
    return KVBytes(kv_dtype.value, total, io.kv_static_bytes(len(spec.kv_layers), heads, row, kv_dtype, latent,
                                                                 num_heads=spec.num_heads),
                   tuple(entries))


# ---- fit -----------------------------------------------------------------------------------
def _largest(ok: Callable[[int], bool], hi: int) -> int:
    """The largest x in 0..hi with ok(x), for ok true up to some x and false after (ok(0) assumed)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


@dataclass(frozen=True, slots=True)
class _Paged:
    """What a paged fit needs besides the budget."""

    per_token: dict[str, int]  # group -> bytes (io.kv_bytes_per_token_by_group)
    block_size: int  # tokens per block
    window: int | None  # one group, every layer windowed alike: the scheduler's window; else None
    local_window: int | None  # the local group's window (two groups); None: one group
    max_num_batched_tokens: int


def _pools(p: _Paged, budget: int, num_seqs: int) -> PoolSizes | None:
    """The engine's pools for `budget` and max_num_seqs = num_seqs; None below the minimum."""
    if budget <= 0:
        return None
    try:
        return kv_pool_sizes(budget, p.block_size, p.per_token, p.local_window, num_seqs, p.max_num_batched_tokens)
    except ConfigError:
        return None


def _holds(p: _Paged, sizes: PoolSizes | None, num_seqs: int, seq_len: int) -> bool:
    """`sizes` holds `num_seqs` sequences of `seq_len` tokens at once (see the module NOTE)."""
    if sizes is None or seq_len > sizes.pool_tokens:  # the scheduler caps a sequence at the pool
        return False
    blocks = -(-seq_len // p.block_size)
    if p.window is not None and blocks > -(-p.window // p.block_size) + 1:  # freed behind the window
        return local_blocks_needed(p.window, p.block_size, num_seqs, p.max_num_batched_tokens) <= sizes.num_blocks
    return num_seqs * blocks <= sizes.num_blocks - 1


def _paged_fit(p: _Paged, budget: int, max_model_len: int, max_num_seqs: int | None, cap: int,
               state: int = 0) -> tuple:
    """(max_seqs, max_context, context_limit, pools) of the paged layout; `state`: bytes each sequence holds
    beside its KV (a hybrid's recurrent state), so n sequences leave `budget - n * state` to the pools."""
    per_seq_bytes = -(-max_model_len // p.block_size) * p.block_size * p.per_token[io.FULL_GROUP]
    hi = max(budget, 0) // per_seq_bytes + 1
    if p.window is not None:  # windowed sequences hold less than max_model_len's blocks
        hi = max(budget, 0) // (p.block_size * p.per_token[io.FULL_GROUP]) + 1
    seqs = _largest(lambda n: _holds(p, _pools(p, budget - n * state, n), n, max_model_len), hi)
    if max_num_seqs is None:
        return seqs, None, None, _pools(p, budget - max(seqs, 1) * state, max(seqs, 1))
    sizes = _pools(p, budget - max_num_seqs * state, max_num_seqs)
    context = _largest(lambda n: _holds(p, sizes, max_num_seqs, n), cap)
    return seqs, context, "model" if context == cap else "memory", sizes


def _contiguous_fit(per_token: int, budget: int, max_model_len: int, max_num_seqs: int | None, cap: int) -> tuple:
    seqs = max(budget, 0) // (max_model_len * per_token)
    if max_num_seqs is None:
        return seqs, None, None
    context = min(max(budget, 0) // (max_num_seqs * per_token), cap)
    return seqs, context, "model" if context == cap else "memory"


def _fit_rows(spec: ModelSpec, man: mf.Manifest | None, kvs: tuple[KVBytes, ...], budget: int, block_size: int,
              max_model_len: int, max_num_seqs: int | None, mnbt: int, cap: int, state: int = 0,
              checkpoints: int = 0) -> tuple[Fit, ...]:
    """One Fit per KV dtype and layout; `budget`: the memory left after the weights, bytes; `state`: a
    hybrid's recurrent state per sequence, bytes, and `checkpoints` slots of it held besides."""
    # NOTE: the paged rows have a paged build's groups (its kv.local_window is this window)
    local_window = io.local_window(spec.window(i) for i in range(spec.num_layers))
    one_window = spec.uniform_window if local_window is None else None
    fits = []
    for kv in kvs:
        left = budget - kv.static_bytes - checkpoints * state
        for layout in LAYOUTS:
            own = man is not None and (kv.kv_dtype, layout) == (man.kv.dtype, man.kv.layout)
            if layout == io.KVLayout.CONTIGUOUS.value and (spec.mla is not None or spec.linear_attn is not None):
                continue  # MLA and hybrid builds are paged only
            if layout == io.KVLayout.CONTIGUOUS.value:
                seqs, ctx, limit = _contiguous_fit(kv.bytes_per_token, left, max_model_len, max_num_seqs, cap)
                fits.append(Fit(kv.kv_dtype, layout, max(left, 0), None, None, seqs, ctx, limit, own))
                continue
            per_token = ({g.group: g.bytes_per_token for g in kv.groups} if local_window is not None
                         else {io.FULL_GROUP: kv.bytes_per_token})
            p = _Paged(per_token, block_size, one_window, local_window, mnbt)
            seqs, ctx, limit, sizes = _paged_fit(p, left, max_model_len, max_num_seqs, cap, state)
            local = sizes.local_num_blocks if sizes else (0 if local_window else None)
            held = (checkpoints + (max_num_seqs if max_num_seqs is not None else max(seqs, 1))) * state
            fits.append(Fit(kv.kv_dtype, layout, max(budget - kv.static_bytes - held, 0),
                            sizes.num_blocks if sizes else 0, local, seqs, ctx, limit, own, held))
    return tuple(fits)


def _option_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"--{name.replace('_', '-')} must be an integer {bound}, got {value!r}")


def plan(model: str, memory: str | int | None = None, *, weights: str | None = None, max_model_len: int | None = None,
         max_num_seqs: int | None = None, block_size: int | None = None,
         max_num_batched_tokens: int | None = None) -> Plan:
    """Plan `model` (see the module doc). `memory`: a size ("24GiB", bytes, or "30%" of the memory
    available now; None: no fit); `weights`: the precision the fit subtracts (None: a build's own,
    fp16 for a model); `max_model_len`: tokens per sequence (None: a build's max_seq_len, or the
    model's max positions capped as `build` caps them); `max_num_seqs`: also find the longest
    context of that many sequences; `block_size`, `max_num_batched_tokens`: as the build and the
    engine (None: the build's / 16, EngineConfig's). Raises KvExportError subclasses naming the
    option or field."""
    engine = EngineConfig()
    lo_bs, hi_bs = range_of("block_size")
    m = read_model(model)
    spec, man = m.spec, m.manifest
    notes: list[str] = []
    if block_size is not None:
        _option_int("block_size", block_size, lo_bs, hi_bs)
    if man is not None and man.kv.block_size and block_size not in (None, man.kv.block_size):
        raise ConfigError(f"--block-size {block_size} differs from the build's {man.kv.block_size} (fixed when it was "
                          f"built): leave --block-size out, or plan the model itself")
    block_size = block_size or (man.kv.block_size if man is not None and man.kv.block_size else 16)
    mnbt = engine.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    _option_int("max_num_batched_tokens", mnbt, 1)
    if max_num_seqs is not None:
        _option_int("max_num_seqs", max_num_seqs, 1)
    if weights is not None and weights not in WEIGHT_PRECISIONS:
        raise ConfigError(f"--weights must be one of {', '.join(WEIGHT_PRECISIONS)}, got {weights!r}")
    cap = man.kv.max_seq_len if man is not None else spec.max_positions
    if max_model_len is None:
        max_model_len = cap if man is not None else min(spec.max_positions, MAX_DEFAULT_LEN)
    _option_int("max_model_len", max_model_len, 2, range_of("max_seq_len")[1])
    if man is not None and max_model_len > cap:
        raise ConfigError(f"--max-model-len {max_model_len} exceeds the build's max_seq_len {cap} (the engine serves "
                          f"at most that): give <= {cap}, or rebuild with `kvexport build --max-seq-len`")
    if man is None and max_model_len > spec.max_positions:
        if spec.position == "learned":
            raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's {spec.max_positions} learned "
                              f"positions: give <= {spec.max_positions}")
        notes.append(f"max_model_len {max_model_len} is beyond the model's trained context ({spec.max_positions})")
    estimates = tuple(weights_estimate(spec, w, max_model_len) for w in WEIGHT_PRECISIONS)
    build_weights = None
    if man is not None:
        build_weights = BuildWeights(man.weights.precision or man.dtype, man.weights.bytes, man.weights.parameters)
    # the KV forms the model can take (exporter/kv_forms.py: int4 only where its groups fit the heads;
    # MLA: float or int8 latent pools)
    kvs = tuple(kv_bytes(spec, d) for d in KV_DTYPES if kv_forms.allows(d, spec))
    mem: int | None = None
    fit_w: str | None = None
    fit_w_bytes: int | None = None
    weights_fit: bool | None = None
    fits: tuple[Fit, ...] = ()
    if memory is not None:
        try:
            mem = parse_budget(memory)
        except ConfigError as e:
            raise ConfigError(f"--memory: {e}") from None
        if mem < 1:
            raise ConfigError(f"--memory {memory!r} is 0 bytes: give the accelerator's (or host's) memory, e.g. 24GiB")
        fit_w = weights or (build_weights.precision if build_weights else DEFAULT_MODEL_WEIGHTS)
        if build_weights is not None and fit_w == build_weights.precision:
            w_bytes = build_weights.bytes
        else:
            w_bytes = next(e.bytes for e in estimates if e.precision == fit_w)
        fit_w_bytes, weights_fit = w_bytes, w_bytes < mem
        state = state_bytes_per_seq(spec)
        fits = _fit_rows(spec, man, kvs, mem - w_bytes, block_size, max_model_len, max_num_seqs, mnbt, cap, state,
                         engine.state_checkpoints if state else 0)
        if not weights_fit:
            smaller = [e for e in estimates if e.bytes < mem]
            notes.append(f"the {fit_w} weights alone ({_gib(w_bytes)}) do not fit in {_gib(mem)}"
                         + (f"; --weights {' or '.join(f'{e.precision} ({_gib(e.bytes)})' for e in smaller)} would"
                            if smaller else "; no weight precision does"))
        notes.append("activations, workspace and the runtime itself are not counted: leave headroom")
    if note := _window_note(spec):
        notes.append(note)
    if spec.kv_sources is not None and len(spec.kv_layers) < spec.num_layers:  # Gemma 4's num_kv_shared_layers
        notes.append(f"{spec.num_layers - len(spec.kv_layers)} of the {spec.num_layers} layers read an earlier "
                     f"layer's KV cache: their KV is counted once, with the layer that writes it")
    if spec.layer_head_dims is not None or spec.layer_kv_heads is not None:
        shapes = sorted({spec.layer_kv_shape(i) for i in range(spec.num_layers)})
        notes.append("KV heads × head_dim differ per layer: " + ", ".join(f"{h} × {d}" for h, d in shapes)
                     + " (the header gives the first layer's)")
    state = 0
    if (la := spec.linear_attn) is not None:  # hybrids: constant state per sequence beside the attention layers' KV
        state = io.state_bytes_per_sequence(len(la.layers), la.state_dims())
        notes.append(f"{len(la.layers)} of the {spec.num_layers} layers are {la.KIND}: no KV, "
                     f"{state:,} bytes ({_size(state)}) of recurrent state per running sequence whatever its length; "
                     f"the fit gives each sequence that state beside the KV of the {len(spec.kv_layers)} attention "
                     f"layers and holds {engine.state_checkpoints} prefix-cache checkpoints of it (the default "
                     f"--state-checkpoints) off the budget first; --kv-cache-memory is the KV budget column; "
                     f"hybrids build paged; an int8 / int4 KV row quantizes the attention layers' KV only (the "
                     f"recurrent state stays float32)")
    windows = tuple(spec.window(i) for i in range(spec.num_layers))
    heads, row = (1, spec.mla.row_width) if spec.mla is not None else (spec.num_kv_heads, spec.head_dim)
    return Plan(model, m.kind, spec.family, spec.model_type, spec.num_layers, spec.hidden_size, spec.num_heads,
                heads, row, _attention(spec), windows, spec.max_positions, estimates,
                build_weights, kvs, block_size, max_model_len, max_num_seqs, mnbt, mem, fit_w, fit_w_bytes, weights_fit,
                fits, tuple(notes), state, len(spec.linear_attn.layers) if spec.linear_attn is not None else 0)


def state_bytes_per_seq(spec: ModelSpec) -> int:
    """A hybrid's recurrent state per sequence (io.state_bytes_per_sequence), bytes; 0 without linear layers."""
    la = spec.linear_attn
    return io.state_bytes_per_sequence(len(la.layers), la.state_dims()) if la is not None else 0


def _attention(spec: ModelSpec) -> str:
    if spec.mla is not None:  # one latent "KV head" of kv_lora_rank + qk_rope_head_dim
        return f"MLA: latent {spec.mla.kv_lora_rank} + rope {spec.mla.qk_rope_head_dim}"
    return "MQA" if spec.num_kv_heads == 1 else ("MHA" if spec.num_kv_heads == spec.num_heads else "GQA")


def _window_note(spec: ModelSpec) -> str | None:
    windows = tuple(spec.window(i) for i in range(spec.num_layers))
    groups = io.kv_groups(windows)
    if io.LOCAL_GROUP in groups:
        return (f"paged: the windowed layers' KV is its own group (local, window {io.local_window(windows)}), released "
                f"behind the window; the full group keeps every block")
    if spec.uniform_window is not None:
        return (f"paged: every layer has window {spec.uniform_window}: the scheduler frees blocks behind it, so a "
                f"sequence holds at most ceil(window / block) + 1 blocks (+ one step's new tokens), but never more "
                f"tokens than the pool")
    if any(w is not None for w in windows):
        return "paged: the layers' windows differ and none is full attention: one group, every block kept"
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


# ---- human output ----------------------------------------------------------------------------
def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _windows(spec_windows: tuple[int | None, ...]) -> str:
    counts: dict[int | None, int] = {}
    for w in spec_windows:
        counts[w] = counts.get(w, 0) + 1
    if list(counts) == [None]:
        return "full attention"
    return ", ".join(f"{n} layers " + ("full" if w is None else f"window {w}") for w, n in counts.items())


def render(p: Plan, console) -> None:
    """`p` as a few concise tables on `console` (a rich Console)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    def table(*columns: str) -> Table:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for i, c in enumerate(columns):
            t.add_column(c, justify="left" if i < 2 else "right")
        return t

    console.print(f"[bold]{escape(p.model)}[/] ({p.source}): {p.family} ({escape(p.model_type)}), {p.num_layers} "
                  f"layers, {p.num_heads} heads / {p.num_kv_heads} KV head{'s' * (p.num_kv_heads > 1)} × {p.head_dim} "
                  f"({p.attention}), "
                  f"{escape(_windows(p.layer_windows))}, {p.max_positions} positions")
    t = table("weights", "form", "parameters", "bytes")
    for e in p.weights:
        form = {"fp32": "float32", "fp16": "float16; norms float32"}.get(
            e.precision, f"codes + float32 scale {f'/ {e.block_size} rows' if e.block_size else 'per column'}; "
                         f"head int8")
        mark = " ←" if e.precision == p.fit_weights and p.build_weights is None else ""
        t.add_row(e.precision + mark, form, f"{e.parameters / 1e9:.2f} B", _size(e.bytes))
    if p.build_weights is not None:
        b = p.build_weights
        t.add_row(f"{b.precision} (build)" + (" ←" if b.precision == p.fit_weights else ""), "weights file",
                  f"{b.parameters / 1e9:.2f} B", _size(b.bytes))
    console.print(t)
    t = table("KV dtype", "group", "layers", "window", "bytes/token", "static")
    for kv in p.kv:
        for i, g in enumerate(kv.groups):
            static = _size(kv.static_bytes) if kv.static_bytes and i == 0 else "-"
            t.add_row(kv.kv_dtype, g.group, str(g.layers), str(g.window or "-"),
                      f"{g.bytes_per_token:,} ({_size(g.bytes_per_token)})", static)
    console.print(t)
    if p.state_bytes_per_seq:
        console.print(f"recurrent state ({p.linear_layers} linear-attention layers): {p.state_bytes_per_seq:,} bytes "
                      f"({_size(p.state_bytes_per_seq)}) per sequence, whatever its length")
    if p.memory_bytes is None:
        console.print("give --memory (e.g. 24GiB) for what fits", style="dim")
    else:
        assert p.fit_weights_bytes is not None
        head = f"fit in {_size(p.memory_bytes)} with {p.fit_weights} weights ({_size(p.fit_weights_bytes)})"
        if not p.weights_fit:  # nothing is left for the KV cache: a note says which weights would fit
            console.print(f"{head}: [bold red]the weights alone do not fit[/]")
            for n in p.notes:
                console.print(f"note: {escape(n)}", style="dim")
            return
        console.print(f"{head}; block size {p.block_size}, max_num_batched_tokens {p.max_num_batched_tokens}")
        cols = ["KV dtype", "layout", "KV budget"] + (["state"] if p.state_bytes_per_seq else []) + [
            "blocks", f"seqs × {p.max_model_len} tokens"]
        if p.max_num_seqs is not None:
            cols.append(f"context × {p.max_num_seqs} seqs")
        t = table(*cols)
        for f in p.fits:
            blocks = "-" if f.num_blocks is None else (
                f"{f.num_blocks:,}" + (f" + {f.local_num_blocks:,} local" if f.local_num_blocks is not None else ""))
            row = [f.kv_dtype + (" (build)" if f.build else ""), f.layout, _size(f.kv_budget_bytes)] + (
                [_size(f.state_bytes)] if p.state_bytes_per_seq else []) + [blocks, f"{f.max_seqs:,}"]
            if p.max_num_seqs is not None:
                row.append(f"{f.max_context:,}" + (" (model max)" if f.context_limit == "model" else ""))
            t.add_row(*row)
        console.print(t)
    for n in p.notes:
        console.print(f"note: {escape(n)}", style="dim")
