"""Build recipes: YAML files that carry any `kvexport build` option, loaded into a typed,
validated dataclass. One recipe per supported family ships in this folder.

The schema is the Recipe dataclass itself: its field types (and EngineBuildOptions' for the
`engines` mapping), the choices of the enumerated options and the ranges of the numeric ones
(exporter/limits.py) are checked when a Recipe is made; a wrong key or value raises
ConfigError naming it (`engines.max_num_seqs`)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.exporter.limits import (BACKENDS, DTYPES, KV_DTYPES, QUANT_METHODS, RANGES, WEIGHT_BLOCK_SIZES,
                                      WEIGHT_PRECISIONS)
from kvexport.manifest_engines import PRECISIONS, EngineBuildOptions
from kvexport.manifest_weights import WEIGHT_MATMUL_ACCURACY

RECIPE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Recipe:
    model: str | None = None  # model path or alias; the CLI argument wins when given
    out: str | None = None  # build directory; --out wins when given
    force: bool | None = None  # replace an existing build directory
    layout: str | None = None  # "paged" | "contiguous"
    dtype: str | None = None  # "fp32" | "fp16"
    attention: str | None = None  # "onnx" | "plugin" (paged only)
    kv_dtype: str | None = None  # "fp32" | "fp16" | "int8" (None: same as dtype)
    calibration_text: str | None = None  # int8 KV: text file for the scales
    calibration_tokens: int | None = None  # int8 KV: tokens of it used
    backend: str | None = None  # "onnxruntime" | "tensorrt" (also build TensorRT engines)
    engines: dict | None = None  # TensorRT engine options (exporter/tensorrt_build.EngineBuildOptions fields)
    block_size: int | None = None  # tokens per KV block
    max_seq_len: int | None = None  # tokens
    all_logits: bool | None = None
    validate: bool | None = None
    validate_steps: int | None = None
    weights: str | None = None  # matmul weights: "fp32" | "fp16" | "int8" | "int4" (None: dtype)
    weight_block_size: int | None = None  # int8/int4: rows of K per scale (0 = per output channel | 32 | 64 | 128)
    quant_method: str | None = None  # int8/int4 from float weights: "rtn" | "awq" | "smoothquant"
    weight_matmul_accuracy: str | None = None  # int8/int4: the build's serving default: "auto" | "int8" | "float"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f.name, getattr(self, f.name), _hints(Recipe)[f.name])

    def options(self) -> dict:
        """The fields that are set, as BuildOptions-style keyword arguments (the `engines`
        mapping becomes a typed EngineBuildOptions)."""
        kw = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k not in ("model", "out")}
        if "engines" in kw:  # checked when the Recipe was made
            kw["engines"] = EngineBuildOptions(**kw["engines"])
        return kw


CHOICES = {"layout": tuple(e.value for e in io.KVLayout), "attention": tuple(e.value for e in io.Attention),
           "dtype": tuple(d.value for d in DTYPES), "kv_dtype": tuple(d.value for d in KV_DTYPES),
           "backend": (*BACKENDS, "onnx"), "engines.precision": PRECISIONS, "weights": WEIGHT_PRECISIONS,
           "weight_block_size": WEIGHT_BLOCK_SIZES, "quant_method": QUANT_METHODS,
           "weight_matmul_accuracy": WEIGHT_MATMUL_ACCURACY}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check(key: str, value: Any, tp: Any) -> None:
    """`value` of recipe key `key` against its declared type `tp`, choices and range."""
    if value is None:
        if type(None) in typing.get_args(tp):
            return
        raise ConfigError(f"{key} must not be empty")
    base = next((a for a in typing.get_args(tp) if a is not type(None)), tp)  # X | None -> X
    if base is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of option: value, got {_got(value)}")
        known = _hints(EngineBuildOptions)
        for k, v in value.items():
            if k not in known:
                raise ConfigError(f"{key}: unknown option {k!r}; known: {', '.join(known)}")
            _check(f"{key}.{k}", v, known[k])
        try:
            EngineBuildOptions(**value)  # its own range checks
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
        return
    names = {bool: "true or false", int: "an integer", str: "a string", float: "a number"}
    ok = isinstance(value, base) and not (base is int and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{key} must be {names.get(base, base.__name__)}, got {_got(value)}")
    if base is str and ("\0" in value or not value.strip()):
        raise ConfigError(f"{key} must be a non-empty string without NUL characters, got {_got(value)}")
    choices = CHOICES.get(key)
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}, got {_got(value)}")
    if key in RANGES:
        lo, hi = RANGES[key]
        if not lo <= value <= hi:
            raise ConfigError(f"{key} must be in {lo}..{hi}, got {value}")
    elif base is int and value < 0:
        raise ConfigError(f"{key} must be >= 0, got {value}")


def _got(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


MAX_DEPTH = 16  # YAML nesting a recipe may have (its deepest option, engines.X, is 2 levels)


class _RecipeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses what safe_load takes silently or crashes on: a key given
    twice in one mapping (safe_load keeps the last) and nesting deeper than MAX_DEPTH (safe_load
    recurses per level, so a few thousand levels end in RecursionError)."""

    _depth = 0

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"nested more than {MAX_DEPTH} levels deep (line {mark.line + 1}); a recipe is a "
                                  f"flat mapping of option: value (engines: a mapping of its options)")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *anchor": merged keys may be overridden, as YAML says
            key = self.construct_object(key_node, deep=True)
            try:
                dup = key in seen
            except TypeError:  # an unhashable key: SafeConstructor reports it
                break
            if dup:
                raise ConfigError(f"key {_got(key)} is given twice (line {key_node.start_mark.line + 1}); give each "
                                  f"option once")
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_recipe(path: str | Path) -> Recipe:
    """A recipe file, or the name of a shipped one ("llama" -> recipes/llama.yaml)."""
    p = Path(path)
    if not p.is_file() and (RECIPE_DIR / f"{path}.yaml").is_file():
        p = RECIPE_DIR / f"{path}.yaml"
    try:
        data = yaml.load(p.read_text(), Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(f"recipe {p}: {e}") from None
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, a NUL in the path
        raise ConfigError(f"cannot read recipe {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {p} is not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {p} must be a mapping of option: value")
    fields = [f.name for f in dataclasses.fields(Recipe)]
    unknown = sorted(map(str, set(data) - set(fields)))
    if unknown:
        raise ConfigError(f"recipe {p}: unknown option(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    try:
        return Recipe(**data)
    except ConfigError as e:
        raise ConfigError(f"recipe {p}: {e}") from None


def shipped_recipes() -> list[Path]:
    return sorted(RECIPE_DIR.glob("*.yaml"))
