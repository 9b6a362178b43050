"""End tokens: the ids that end a generated sequence. config.json's `eos_token_id` is often
not all of them: generation_config.json holds the real list (Llama-3-Instruct ends a turn with
<|eot_id|>, which only generation_config names), and a GGUF file names end-of-turn and
end-of-message tokens next to its eos. A build records both (the spec's `eos_token_ids` from
config.json, `generation_eos_token_ids` from generation_config.json or the GGUF metadata) and
the runtime stops on their union (kvexport/manifest.py ModelEntry.eos_token_ids).

NOTE: transformers' `generate` takes generation_config.json's `eos_token_id` when the file
exists (it replaces config.json's there); the union stops wherever that stops, and also on
config.json's own eos, which vLLM adds too.

An id outside the vocabulary is logged as a warning naming it, not refused: transformers
tolerates it (such an id never matches a sampled token), and tiny test checkpoints carry
one (GPT2Config's default eos 50256 over a 128-token vocabulary); the build still stops on
its other end tokens, and at max_tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

from kvexport.errors import ConfigError

# GGUF_END_KEYS: eos (transformers reads it into config.eos_token_id), end of turn, end of message;
# llama.cpp stops on each
from .source import GGUF_END_KEYS, ModelSource, gguf_metadata
from .spec import ModelSpec

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def ids_of(value, where: str) -> tuple[int, ...]:
    """An `eos_token_id` value (an int, a list of ints, or null) as a tuple; ConfigError naming
    `where` (file and field) for anything else."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{where} must be a token id (an integer >= 0) or a list of them, got {value!r}; "
                              f"fix the file or download the model again")
    return tuple(dict.fromkeys(items))


def generation_eos(src: ModelSource) -> tuple[int, ...] | None:
    """The end tokens the source names beyond config.json: generation_config.json's
    `eos_token_id` (HF folders), the eos / eot / eom ids of the metadata (GGUF). None when it
    names none (no generation_config.json, or one without `eos_token_id`)."""
    if src.gguf_file:
        return _gguf_end_ids(src)
    path = src.directory / GENERATION_CONFIG
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix it or download the model again") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}; fix it or download it again")
    if data.get("eos_token_id") is None:
        return None
    return ids_of(data["eos_token_id"], f"field 'eos_token_id' of {path}")


def _gguf_end_ids(src: ModelSource) -> tuple[int, ...] | None:
    meta = gguf_metadata(src.directory / src.gguf_file)  # read once: source.resolve checked the file
    ids = [meta[k] for k in GGUF_END_KEYS if k in meta]
    return ids_of(ids, f"GGUF fields {', '.join(GGUF_END_KEYS)} of {src.gguf_file}") or None


def with_generation_eos(spec: ModelSpec, src: ModelSource) -> ModelSpec:
    """`spec` with the source's further end tokens recorded (generation_eos_token_ids: the
    source's list, when it names one config.json lacks), each
    end token outside the vocabulary logged by name (the module docstring says why not refused)."""
    more = generation_eos(src)
    if more is not None and set(more) <= set(spec.eos_token_ids):
        more = None  # NOTE: nothing beyond config.json's: left out, so such manifests stay as before the field
    spec = replace(spec, generation_eos_token_ids=more)
    where = {t: "config.json 'eos_token_id'" for t in spec.eos_token_ids}
    for t in spec.generation_eos_token_ids or ():
        where.setdefault(t, f"{src.gguf_file or GENERATION_CONFIG} 'eos_token_id'")
    for t, field in where.items():
        if t >= spec.vocab_size:
            log.warning("end token %d (%s of %s) is outside the vocabulary (vocab_size %d): no sampled token can "
                        "match it, so it never ends a sequence; fix the model's config if it should", t, field,
                        src.name, spec.vocab_size)
    if not any(t < spec.vocab_size for t in where):
        log.warning("%s names no end token inside its vocabulary: its sequences end only at max_tokens or a "
                    "stop string", src.name)
    return spec
