"""Build recipes: YAML files that carry any `kvexport build` option, loaded into a typed,
validated dataclass. One recipe per supported family ships in this folder."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvexport.errors import ConfigError

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

    def options(self) -> dict:
        """The fields that are set, as BuildOptions-style keyword arguments (the `engines`
        mapping becomes a typed EngineBuildOptions)."""
        kw = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k not in ("model", "out")}
        if "engines" in kw:
            from kvexport.exporter.tensorrt_build import EngineBuildOptions

            known = {f.name for f in dataclasses.fields(EngineBuildOptions)}
            unknown = sorted(set(kw["engines"]) - known)
            if unknown:
                raise ConfigError(f"recipe engines: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            kw["engines"] = EngineBuildOptions(**kw["engines"])
        return kw


def load_recipe(path: str | Path) -> Recipe:
    """A recipe file, or the name of a shipped one ("llama" -> recipes/llama.yaml)."""
    p = Path(path)
    if not p.is_file() and (RECIPE_DIR / f"{path}.yaml").is_file():
        p = RECIPE_DIR / f"{path}.yaml"
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read recipe {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {p} is not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {p} must be a mapping of option: value")
    fields = {f.name: f for f in dataclasses.fields(Recipe)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"recipe {p}: unknown option(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    types = {"model": str, "out": str, "force": bool, "layout": str, "dtype": str, "attention": str, "kv_dtype": str,
             "calibration_text": str, "calibration_tokens": int, "backend": str, "engines": dict, "block_size": int,
             "max_seq_len": int, "all_logits": bool, "validate": bool, "validate_steps": int}
    for key, value in data.items():
        if value is not None and (not isinstance(value, types[key]) or
                                  (types[key] is int and isinstance(value, bool))):
            raise ConfigError(f"recipe {p}: {key} must be {types[key].__name__}, got {value!r}")
    return Recipe(**data)


def shipped_recipes() -> list[Path]:
    return sorted(RECIPE_DIR.glob("*.yaml"))
