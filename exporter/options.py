"""`BuildOptions`: the one definition of a build option. Each field carries its type, default,
unit (comment), and an `Option` spec (kvexport/option_spec.py, shared with the runtime settings):
its help, choices or range, how the command line spells it and whether a recipe may set it. From
it are generated the `kvexport build` flags (kvexport/cli/options.py `build_options`), the recipe
schema and its messages (recipes/__init__.py), and the checks of the Python API
(`BuildOptions.__post_init__`), so a new option is one field here (+ where it is used, + its
test). Light to import (no torch, no onnx): `kvexport --help` reads it.

NOTE: max_seq_len sizes the RoPE tables stored in the graphs (2 x tokens x head_dim float32)
and calibration_tokens the calibration run, so both are capped far above any real use but
below an allocation failure.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass
from typing import Any

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.manifest_engines import EngineBuildOptions
from kvexport.manifest_weights import WEIGHT_MATMUL_ACCURACY
from kvexport.option_spec import option, spec_of  # the Option spec, shared with the runtime settings

from .limits import (BACKENDS, CALIBRATED_METHODS, DTYPES, KV_DTYPES, QUANT_METHODS, WEIGHT_BLOCK_SIZES,
                     WEIGHT_PRECISIONS)


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildOptions:
    """What `kvexport build` makes; fields in the order `kvexport build --help` lists them."""

    layout: io.KVLayout = option(io.KVLayout.PAGED, "KV-cache layout [{default}].", choices=tuple(io.KVLayout))
    dtype: io.DType = option(io.DType.FP32, "Weights/activations dtype [{default}].", choices=DTYPES)
    # None: plugin for paged builds, or onnx where the native CPU op cannot serve the build
    # (not built, or fp16 activations/KV: build.default_attention says why); onnx for contiguous ones
    attention: io.Attention | None = option(
        None, "Paged attention: kvexport::PagedAttention plugin nodes (served fastest: the native CPU op, TensorRT), "
              "or standard ONNX ops for tools without kvexport's op [plugin; onnx for contiguous builds, or with a "
              "warning when the native CPU op is not built].", choices=tuple(io.Attention))
    kv_dtype: io.DType | None = option(  # None: same as dtype
        None, "KV-cache dtype [same as --dtype]; int8 uses calibrated per-channel scales.", choices=KV_DTYPES,
        where=" on the ONNX path")
    calibration_text: str | None = option(  # int8 KV: text for the scales, int4: the key transform; None: Hamlet
        None, "int8 KV: text to calibrate the scales on (int4: the key offsets) [bundled Shakespeare: Hamlet].",
        path=True)
    calibration_tokens: int = option(  # int8 / int4 KV: tokens of that text run through the model
        2048, "int8 / int4 KV: tokens of the text to use [{default}].", range=(16, 1 << 20))
    # the backend the build is for, named as the runtime's --backend: "onnxruntime" (ONNX graphs
    # only) | "tensorrt" (also TensorRT engines; needs --attention plugin)
    backend: str = option(
        "onnxruntime", "The backend the build is for, as the runtime's --backend: onnxruntime (ONNX graphs), or "
                       "tensorrt (also TensorRT engines; needs --attention plugin, TensorRT and a GPU) [{default}].",
        choices=BACKENDS)
    block_size: int = option(16, "Tokens per KV block for the paged layout [{default}].", range=(1, 1024))  # tokens
    max_seq_len: int | None = option(  # tokens; None: the model's max positions (capped at build.MAX_ROPE_TABLE)
        None, "Longest context served [model's max positions, capped at 32768].", range=(2, 1 << 18))
    all_logits: bool = option(False, "Prefill returns logits for every token (perplexity).")
    allow_pickle: bool = option(  # accept *.bin weights (loaded with weights_only=True); never from a recipe
        False, "Accept pickled *.bin weights (loaded with weights_only=True).", recipe=False)
    force: bool = option(False, "Replace an earlier kvexport build at --out (never anything else).")
    validate: bool = option(True, "Skip the comparison with transformers.")  # the flag: --no-validate
    weights: str | None = option(  # matmul weights (None: --dtype); exporter/quantize.py
        None, "Matmul weights: fp32/fp16, or int8/int4 QDQ in the fast CPU forms unless told otherwise "
              "(docs/QUANTIZATION.md) [--dtype].", choices=WEIGHT_PRECISIONS)
    # int8/int4: rows of K per scale, 0 per output channel; None: the default form (limits.DEFAULT_WEIGHT_FORM)
    weight_block_size: int | None = option(
        None, "int8/int4 weights: input rows per scale, or one scale per output channel (int8 runs as int8 x int8 "
              "GEMMs with per-token activation scales) [int8: channel with smoothquant, or 32 with another "
              "--quant-method (32: exact, GGUF Q8_0 blocks kept); int4: 32].",
        choices=WEIGHT_BLOCK_SIZES, spelled={0: "channel"})
    # int8/int4 weights from float ones (calibration_text: its text); None: the default form
    quant_method: str | None = option(
        None, "int8/int4 from float weights: round-to-nearest, AWQ scales on --calibration-text, or smoothquant "
              "(scales that also spare the int8 activations: int8 per channel, int4 blocks) [int8: smoothquant per "
              "channel, rtn in blocks; int4: rtn].", choices=QUANT_METHODS)
    # int8/int4: the weight_matmul_accuracy the build records as its serving default
    # (runtime/execution/session_plan.py); None: by method (limits.default_matmul_accuracy)
    weight_matmul_accuracy: str | None = option(
        None, "int8/int4: how onnxruntime's CPU serves the weights by default (the manifest records it; serving "
              "commands' --weight-matmul-accuracy overrides it): auto (int8 pairs, ~exact), int8 (fastest), float "
              "(exact) [int8 for smoothquant, else auto].", choices=WEIGHT_MATMUL_ACCURACY)
    # a PEFT LoRA adapter folder merged into the weights (exporter/lora.py); None: the base model alone
    lora: str | None = option(
        None, "A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) merged into the weights: "
              "the build serves base + that adapter at the base's speed.", path="dir")
    # paged builds: the graphs also return io.HIDDEN_STATES at these layer boundaries (io.hidden_state_layers:
    # "eagle3", "mtp" or a comma list); None: no hidden-state output
    hidden_states: str | None = option(
        None, "Paged builds: the graphs also return every token's hidden states at these layer boundaries, for "
              "draft heads: eagle3 (layers 2, L/2, L-3), mtp (the final normed state) or a comma list in 0..L "
              "(transformers' output_hidden_states indices) [none].")
    # paged builds: the graphs take LoRA adapters at serve time (kvexport/io.py LORA_INDEX) up to this rank
    # (rows); None: none
    lora_max_rank: int | None = option(
        None, "Paged builds: the graphs take PEFT LoRA adapters at serve time, batched per token, up to this rank "
              "[none].", range=(1, 256))
    # the HF modules those adapters may reach, comma-separated (exporter/lora.py ALL_TARGETS); None: all seven
    lora_targets: str | None = option(
        None, "With --lora-max-rank: the modules adapters may reach, comma-separated [q_proj,k_proj,v_proj,o_proj,"
              "gate_proj,up_proj,down_proj].")
    validate_steps: int = option(16, range=(1, 1024))  # greedy decode steps compared with transformers
    engines: EngineBuildOptions | None = option(None)  # TensorRT engine limits / precision; None: the defaults

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f, getattr(self, f.name))
        if self.attention is None and self.layout is io.KVLayout.CONTIGUOUS:
            object.__setattr__(self, "attention", io.Attention.ONNX)
        if self.attention is None and self.backend == "tensorrt":
            object.__setattr__(self, "attention", io.Attention.PLUGIN)
        if self.attention is io.Attention.PLUGIN and self.layout is not io.KVLayout.PAGED:
            raise ConfigError("--attention plugin needs --layout paged (PagedAttention reads a block pool)")
        if self.lora_targets is not None and self.lora_max_rank is None:
            raise ConfigError("--lora-targets needs --lora-max-rank (the rank the build takes adapters up to)")
        if self.lora_max_rank is not None and self.layout is not io.KVLayout.PAGED:
            raise ConfigError("--lora-max-rank needs --layout paged (the runtime serves adapters on paged builds)")
        if self.backend == "tensorrt" and (self.lora_max_rank is not None or self.hidden_states is not None):
            flag = "--lora-max-rank" if self.lora_max_rank is not None else "--hidden-states"
            raise ConfigError(f"--backend tensorrt: {flag} is served by the onnxruntime backend only so far (the "
                              f"TensorRT engines' runtime binds neither); build for --backend onnxruntime")
        if self.hidden_states is not None and self.layout is not io.KVLayout.PAGED:
            raise ConfigError("--hidden-states needs --layout paged (the draft heads that read them run in the "
                              "runtime, which serves paged builds)")
        if self.backend == "tensorrt" and self.attention is io.Attention.ONNX:
            raise ConfigError("--backend tensorrt needs --attention plugin (the engines run PagedAttention "
                              "as a TensorRT plugin)")
        if self.backend == "tensorrt" and self.dtype is not io.DType.FP16:
            raise ConfigError("--backend tensorrt needs --dtype fp16 (the plugin kernels take fp16/bf16 activations)")
        wq = self.weight_quantization()  # checks weights / weight_block_size / quant_method together
        if ((self.calibration_text is not None or self.calibration_tokens != _FIELDS["calibration_tokens"].default)
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
        if self.backend == "tensorrt" and wq.quantized:  # what TensorRT's Q/DQ takes, before any work
            from .tensorrt_build import weight_problems  # NOTE: lazy: it imports onnx (kvexport --help reads this)

            problems = weight_problems(wq.bits, wq.block_size)
            if problems:
                raise ConfigError("--backend tensorrt: " + "; ".join(problems))

    @property
    def kv(self) -> io.DType:
        """The KV-cache dtype (kv_dtype, or the activations' when None)."""
        return self.kv_dtype or self.dtype

    def weight_quantization(self):
        """The matmul weights' quantization (exporter/quantize.py WeightQuantization)."""
        from .quantize import WeightQuantization  # NOTE: lazy: it imports onnx (kvexport --help reads this)

        precision = self.weights if self.weights is not None else self.dtype.value
        return WeightQuantization(precision, self.weight_block_size, self.quant_method)


_FIELDS = {f.name: f for f in dataclasses.fields(BuildOptions)}
_HINTS = typing.get_type_hints(BuildOptions)


def range_of(name: str) -> tuple[int, int]:
    """The inclusive bounds of integer option `name`."""
    bounds = spec_of(_FIELDS[name]).range
    assert bounds is not None, name
    return bounds


def flag(f: dataclasses.Field) -> str:
    """The option's command-line flag: --block-size; a boolean that defaults to true: --no-validate."""
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def cli_fields() -> tuple[dataclasses.Field, ...]:
    """The fields `kvexport build` offers as flags, in order."""
    return tuple(f for f in dataclasses.fields(BuildOptions) if spec_of(f).help is not None)


def recipe_fields() -> tuple[dataclasses.Field, ...]:
    """The fields a recipe may set, in order."""
    return tuple(f for f in dataclasses.fields(BuildOptions) if spec_of(f).recipe)


def value_type(f: dataclasses.Field) -> type:
    """The field's type without None: io.KVLayout, int, str, bool, EngineBuildOptions."""
    return next(t for t in (*_args(f), object) if t is not type(None))


def choice_words(f: dataclasses.Field) -> tuple[str, ...]:
    """How the option's choices are written (enum values, CLI spellings: 0 -> "channel")."""
    s = spec_of(f)
    return tuple(v.value if isinstance(v, enum.Enum) else s.spelled.get(v, str(v)) for v in s.choices)


def from_words(f: dataclasses.Field, value: Any) -> Any:
    """A value as a recipe or the command line writes it -> the field's value ("paged" ->
    io.KVLayout.PAGED, "channel" -> 0); values already typed pass through."""
    t, s = value_type(f), spec_of(f)
    if isinstance(t, type) and issubclass(t, enum.Enum) and isinstance(value, str):
        return t(value)
    if isinstance(value, str) and value in s.spelled.values():
        return next(v for v, w in s.spelled.items() if w == value)
    if t is int and isinstance(value, str) and value.isdigit():
        return int(value)
    return value


def _args(f: dataclasses.Field) -> tuple:
    return typing.get_args(_HINTS[f.name]) or (_HINTS[f.name],)


def one_of(words: tuple[str, ...]) -> str:
    """"a or b", "one of a, b, c": what a value must be."""
    return " or ".join(words) if len(words) == 2 else "one of " + ", ".join(words)


def either(words: tuple[str, ...]) -> str:
    """"a, b, c or d": what to use instead."""
    return " or ".join((", ".join(words[:-1]), words[-1])) if len(words) > 1 else "".join(words)


def _check(f: dataclasses.Field, v: Any) -> None:
    """One field's value against its type, choices and range (ConfigError naming the flag)."""
    s, t, name = spec_of(f), value_type(f), f.name
    label = flag(f) if s.help is not None and not isinstance(f.default, bool) else name
    if v is None and type(None) in _args(f):
        return
    if isinstance(t, type) and issubclass(t, enum.Enum):
        if not isinstance(v, t):
            raise ConfigError(f"{name} must be a kvexport.io.{t.__name__} ({', '.join(e.value for e in t)}), got {v!r}")
        if v not in s.choices:
            raise ConfigError(f"{label} {v.value} is not supported{s.where}; use {either(choice_words(f))}")
    elif t is bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{name} must be true or false, got {v!r}")
    elif t is int and s.range is not None:
        lo, hi = s.range
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"{label} must be an integer in {lo}..{hi}, got {v!r}")
    elif s.choices:
        if isinstance(v, bool) or v not in s.choices:
            words = choice_words(f)
            if s.spelled:  # e.g. "channel (0)"
                words = tuple(f"{w} ({c})" if w != str(c) else w for w, c in zip(words, s.choices))
            raise ConfigError(f"{label} must be {one_of(words)}, got {v!r}")
    elif s.path:
        if not isinstance(v, str):
            raise ConfigError(f"{name} must be a {'folder' if s.path == 'dir' else 'file'} path, got {v!r}")
    elif isinstance(t, type) and not isinstance(v, t):
        raise ConfigError(f"{name} must be an {t.__name__}, got {v!r}")

