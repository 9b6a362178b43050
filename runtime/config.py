"""The runtime settings: one definition, one set of defaults, one set of checks.

`EngineConfig` is what every front end builds an engine from: the Python API
(`LLM(build, **settings)`), every CLI command that runs an engine (`generate`, `bench`, `serve`,
`triton`, `dynamo`), the OpenAI server, the Dynamo worker and the Triton model (whose
config.pbtxt `parameters` are these fields as strings: `to_strings` / `from_strings`). Each field
is declared once with its default, unit (comment) and `Option` spec (kvexport/option_spec.py, the
spec `BuildOptions` uses): its help, group (the concern), choices or range, and the reader of a
size. From it are generated the click options (kvexport/cli/options.py `engine_options`, flag
`flag()`), the string form, and the per-field checks with their messages (`_check`); what holds
between fields is `EngineConfig._check_together`. So a new setting is one declaration here plus
its use.
"""

from __future__ import annotations

import typing
from dataclasses import Field, dataclass, fields
from typing import Any

from kvexport.errors import ConfigError
from kvexport.io import BACKENDS  # onnxruntime | tensorrt, as `kvexport build --backend` names them
from kvexport.manifest_weights import WEIGHT_MATMUL_ACCURACY  # onnxruntime CPU, int8/int4 weights: session_plan.py
from kvexport.option_spec import option, spec_of

from .core.memory import parse_budget, parse_size

# core/streaming.py: attention sinks + a recent window; core/importance.py: attention-scored (snapkv at the
# prompt, h2o also while decoding) within a per-sequence budget
KV_EVICTIONS = ("none", "streaming", "snapkv", "h2o")
# the tiers' precision (runtime/execution/kv_tier_codec.py); auto: the pool's
KV_OFFLOAD_DTYPES = ("auto", "int8", "int4")
SPECULATIVE = ("none", "ngram", "draft")  # speculative decoding's proposer (execution/proposers.py)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's settings; fields in the order the serving commands' --help lists them."""

    # ---- limits: the KV pool and each step -------------------------------------------------
    kv_cache_memory: str | int = option(  # KV pool budget: "2GiB", bytes, or "30%" of available memory
        "2GiB", "KV pool budget: a size (2GiB, 512MiB, bytes) or a share of free memory (30%).",
        group="cache", unit="bytes", parse=parse_budget)
    max_num_seqs: int = option(  # sequences per engine step
        64, "Sequences per engine step, max.", group="limits", unit="sequences", range=(1, None))
    max_num_batched_tokens: int = option(  # tokens per engine step (prompt chunks + decodes)
        512, "Tokens per engine step (prompt chunks + decodes), max.", group="limits", unit="tokens", range=(1, None))
    max_model_len: int | None = option(  # tokens per sequence (prompt + output); None: the build's max_seq_len
        None, "Tokens per sequence, prompt + output [the build's max_seq_len].", group="limits", unit="tokens",
        range=(2, None))
    enable_prefix_caching: bool = option(  # reuse KV blocks of identical prompt prefixes
        True, "Reuse the KV blocks of identical prompt prefixes.", group="cache")
    # ---- execution -----------------------------------------------------------------------------
    threads: int | None = option(  # onnxruntime intra-op threads; None: all cores
        None, "onnxruntime intra-op threads [all cores].", group="execution", unit="threads", range=(1, None),
        hint="or unset: all cores")
    backend: str = option(  # "onnxruntime" | "tensorrt" (the build's engines)
        "onnxruntime", "Execution backend: onnxruntime, or tensorrt (the build's engines; needs TensorRT and a GPU).",
        group="execution", choices=BACKENDS)
    cuda_graph_batch_sizes: tuple[int, ...] = option(  # tensorrt: decode batch sizes captured as CUDA graphs
        (), "tensorrt: decode batch sizes to capture as CUDA graphs, comma-separated (e.g. 1,2,4,8).",
        group="execution", unit="sequences", range=(1, None))
    max_sequences_per_request: int = option(  # sequences one front-end request may submit (prompts x n), max
        64, "Sequences one request may ask for (prompts x n), max; more is refused with 400. Requests share the "
            "engine in turn, so a large one cannot starve the others.", group="limits", unit="sequences",
        range=(1, None))
    # int8/int4 weights on onnxruntime (CPU): "auto" | "int8" | "float" (execution/session_plan.py);
    # None: the build's own (weights.quantization.matmul_accuracy; "auto" for builds before it)
    weight_matmul_accuracy: str | None = option(
        None, "int8/int4 weights on onnxruntime (CPU) [the build's: `kvexport inspect` says which]. auto: block-wise "
              "weights' steps of 8 tokens or more as int8 pairs (~15-bit activations and weights on int8 x int8 "
              "GEMMs, a second session: +2 bytes per weight of RSS), smaller ones with int8 activations "
              "(MatMulNBits); fp16 int4 builds: large steps in float. int8: int8 activations throughout, steps of 4+ "
              "tokens as per-channel int8 x int8 GEMMs (fastest; smollm2 rtn int4 perplexity +1.9% with VNNI, +13% "
              "on AVX2-only CPUs, whose int8 activations get 7 bits). float: exact everywhere (slow decode).",
        group="execution", choices=WEIGHT_MATMUL_ACCURACY)
    # ---- tiers: KV below the pool (runtime/core/kv_tiers.py): evicted prefix-cache blocks go to host
    # memory, then to disk; a prefix found there is copied back instead of recomputed
    kv_offload_memory: str | int = option(  # host tier budget: a size ("4GiB", bytes); "0": no host tier
        "0", "Host-memory tier for prefix-cache blocks evicted from the KV pool, a size (4GiB); 0: off. A prefix "
             "found there is copied back instead of recomputed.", group="tiers", unit="bytes", parse=parse_size)
    kv_offload_dir: str = option(  # disk tier folder (survives restarts); "": no disk tier
        "", "Disk tier folder for evicted prefix-cache blocks (below the host tier; survives restarts). It holds "
            "only kvexport's block files, marked; a folder with other files is refused.", group="tiers",
        hint="a folder path, or empty: no disk tier")
    kv_offload_disk: str | int = option(  # disk tier budget, a size; used with kv_offload_dir
        "8GiB", "Disk tier budget, a size (used with --kv-offload-dir); a full disk turns the tier off.",
        group="tiers", unit="bytes", parse=parse_size)
    kv_offload_dtype: str = option(  # the tiers' precision: auto (the pool's), int8 or int4 (kv_tier_codec.py)
        "auto", "Precision of the blocks the host and disk tiers hold: auto (the pool's), int8 or int4 (each "
                "token's key and value of each head rounded on its own scale, int4 after a Hadamard rotation; "
                "decoded on the way back): ~3.8x / ~7.1x the blocks of an fp32 pool in the same budget.",
        group="tiers", choices=KV_OFFLOAD_DTYPES)
    # ---- eviction: "streaming": a sequence keeps its first kv_sink_tokens and its last kv_recent_tokens
    # tokens' KV, the blocks between are freed, and it may run past max_model_len (runtime/core/streaming.py);
    # snapkv / h2o (runtime/core/importance.py): attention-scored within a per-sequence budget
    kv_eviction: str = option(
        "none", "KV eviction: none (a sequence stops at max_model_len), streaming (attention sinks: keep the first "
                "--kv-sink-tokens and the last --kv-recent-tokens tokens' KV, free the blocks between; max_tokens "
                "may exceed max_model_len; docs/ARCHITECTURE.md \"Streaming\"), snapkv (when a prompt completes, "
                "keep the KV blocks its last --kv-observation-tokens attend to most, within --kv-budget-tokens / "
                "--kv-budget-fraction; sinks and recent tokens always kept) or h2o (snapkv, and while decoding the "
                "blocks with the most accumulated attention, so a generation stays within the budget).",
        group="eviction", choices=KV_EVICTIONS)
    kv_sink_tokens: int = option(  # streaming: tokens kept at the start (rounded up to whole blocks)
        4, "streaming: tokens kept at the start of each sequence (rounded up to whole KV blocks; 0: a plain sliding "
           "window).", group="eviction", unit="tokens", range=(0, None), hint="0: a plain sliding window")
    kv_recent_tokens: int | None = option(  # streaming: tokens kept at the end; None: half of max_model_len
        None, "streaming: most recent tokens kept [half of max_model_len]; at least one KV block, and sinks + recent "
              "+ one block within max_model_len and the KV pool.", group="eviction", unit="tokens", range=(1, None),
        hint="or unset: half of max_model_len")
    kv_budget_tokens: int | None = option(  # snapkv / h2o: KV tokens a sequence keeps, at most; None: no cap
        None, "snapkv / h2o: KV tokens each sequence keeps, at most (at least sinks + recent + one block; a request "
              "may ask for fewer: kv_budget_tokens).", group="eviction", unit="tokens", range=(1, None))
    kv_budget_fraction: float | None = option(  # snapkv / h2o: share of a prompt's KV kept; None: no cap
        None, "snapkv / h2o: the share of each prompt's KV kept (0-1, e.g. 0.25); with --kv-budget-tokens the "
              "smaller wins.", group="eviction", unit="share", range=(0, 1), open=True,
        hint="the share of a prompt's KV kept")
    kv_observation_tokens: int = option(  # snapkv / h2o: the prompt's last tokens whose attention scores its KV
        32, "snapkv / h2o: the prompt's last tokens whose attention scores the rest (the observation window; always "
            "kept).", group="eviction", unit="tokens", range=(1, None))
    # ---- speculation (core/speculation.py): "ngram" (prompt lookup), "draft" (draft_model), "none"
    speculative: str = option(
        "none", "Speculative decoding: none, ngram (prompt lookup: drafts copied from the request's own tokens), or "
                "draft (a smaller build's drafts, --draft-model). Outputs are distributed exactly as without it "
                "(greedy: identical); a request may turn it off (speculative: false).",
        group="speculation", choices=SPECULATIVE)
    draft_model: str = option(  # speculative "draft": the draft build's folder (same vocabulary)
        "", "speculative draft: the draft model's build folder (same tokenizer and vocabulary).",
        group="speculation", hint="a build folder, or empty")
    num_speculative_tokens: int = option(  # drafts per decoding step, at most (1..16)
        4, "speculative: tokens drafted per decoding step, at most (1-16; backed off per sequence when its drafts "
           "are rejected).", group="speculation", unit="tokens", range=(1, 16), hint="drafts per step")
    # sequences running above which nobody drafts; below it the cost model decides (docs/BENCHMARKS.md: 16
    # measured at par or better than 8 with it on a 2-core CPU)
    speculative_max_batch: int = option(
        16, "speculative: with more sequences running than this, nobody drafts (a large batch's decode is no longer "
            "memory-bound); at or below it the step-cost model decides.", group="speculation", unit="sequences",
        range=(1, None))
    # speculative: drafts chosen by the measured step cost (core/speculation.py StepCost): only those whose
    # expected tokens pay for the rows they add; False: every draft the per-sequence back-off allows
    speculative_cost_model: bool = option(
        True, "speculative: time the steps and draft only where the expected accepted tokens pay for the rows they "
              "add (a CPU's large batch drafts little, a GPU's or a single stream's all); off: every draft the "
              "per-sequence back-off allows.", group="speculation")
    # ---- state: hybrid (gated DeltaNet) builds' prefix caching (core/state_pool.py): a recurrent-state
    # checkpoint every this many KV blocks (prompt chunks end on those boundaries); 0: hybrids recompute every prompt
    state_checkpoint_blocks: int = option(
        32, "Hybrid (gated DeltaNet) builds: save the linear layers' recurrent state every this many KV blocks, so "
            "prompts sharing a prefix resume from the nearest checkpoint (prompt chunks end on those boundaries); 0: "
            "no prefix caching for hybrids.", group="state", unit="blocks", range=(0, None),
        hint="0: no hybrid prefix caching")
    state_checkpoints: int = option(  # hybrids: checkpoint slots (each one sequence's recurrent state), LRU evicted
        64, "Hybrid builds: recurrent-state checkpoints kept (each one sequence's state: kvexport plan shows its "
            "bytes); the least recently used is dropped for a new one.", group="state", unit="checkpoints",
        range=(0, None), hint="0: no hybrid prefix caching")

    # ---- lora: adapters served beside the base model (runtime/lora.py; builds made with --lora-max-rank)
    lora_modules: str = option(  # "NAME=PATH[,NAME=PATH..]": PEFT adapter folders, each served under its name
        "", "LoRA adapters to serve, NAME=PATH[,NAME=PATH...] (PEFT folders; the build needs --lora-max-rank). A "
            "request picks one by name (its `model` over HTTP); the others run the base model in the same steps.",
        group="lora", parse=lambda v: parse_lora_modules(v), hint="NAME=PATH pairs, or empty")
    max_loras: int = option(  # adapters loaded at once (each a slot of every adapted matmul)
        4, "LoRA: adapters loaded at once, max (each adds its rank to every adapted matmul of every step).",
        group="lora", unit="adapters", range=(1, 64))

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f, getattr(self, f.name))
        self._check_together()

    def _check_together(self) -> None:
        """What must hold between settings (each one's own range or choices: `_check`)."""
        if (self.kv_budget_tokens is not None or self.kv_budget_fraction is not None) \
                and self.kv_eviction not in ("snapkv", "h2o"):
            raise ConfigError(f"kv_budget_tokens / kv_budget_fraction are budgets of --kv-eviction snapkv or h2o, "
                              f"not of {self.kv_eviction!r}: set --kv-eviction snapkv, or leave the budget unset")
        if self.kv_eviction == "h2o" and self.speculative != "none":
            # NOTE: not exact, so refused: h2o adds each decoded token's attention to its blocks' scores and may
            # release a block after any token; a speculative step computes the token and its drafts at once, and
            # the attention op sums its observed rows, so their scores (a rejected draft's too) cannot be told
            # apart nor a block released between them (runtime/core/importance.py, "Speculative decoding")
            raise ConfigError(f"--kv-eviction h2o cannot be combined with --speculative {self.speculative}: h2o "
                              f"scores every decoded token's attention on its own step, and a speculative step "
                              f"decodes several tokens at once, so greedy text would differ from decoding "
                              f"without it; give --speculative none, or --kv-eviction snapkv (it scores the "
                              f"prompt only, and speculates exactly)")
        if bool(self.draft_model) != (self.speculative == "draft"):
            raise ConfigError(f"draft_model is the draft build of speculative 'draft' and only of it: got "
                              f"speculative {self.speculative!r} with draft_model {self.draft_model!r}; give "
                              f"--speculative draft --draft-model BUILD, or neither")
        if (n := len(parse_lora_modules(self.lora_modules))) > self.max_loras:
            raise ConfigError(f"lora_modules names {n} adapters, more than max_loras {self.max_loras}: raise "
                              f"--max-loras or serve fewer adapters")
        if self.kv_offload_dir and parse_size(self.kv_offload_disk) < 1:
            raise ConfigError(f"kv_offload_disk is 0 bytes but kv_offload_dir is set: give the disk tier a size such "
                              "as 8GiB, or leave kv_offload_dir empty")
        if self.kv_offload_dtype != "auto" and not (self.kv_offload_dir or parse_size(self.kv_offload_memory)):
            raise ConfigError(f"kv_offload_dtype {self.kv_offload_dtype} sets the precision of the KV tiers, and none "
                              f"is on: give --kv-offload-memory (a size) or --kv-offload-dir, or leave it auto")
        if (self.kv_offload_dir or parse_size(self.kv_offload_memory)) and not self.enable_prefix_caching:
            raise ConfigError("kv_offload_memory / kv_offload_dir keep prefix-cache blocks, so they need "
                              "enable_prefix_caching; turn prefix caching on or the offload off")

    # ---- string form (Triton model parameters) ----------------------------------------
    def to_strings(self) -> dict[str, str]:
        """Every field as a string (Triton's config.pbtxt parameters); `from_strings` inverts it."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                out[f.name] = ",".join(str(b) for b in v)
            elif v is None:
                out[f.name] = ""
            elif isinstance(v, bool):
                out[f.name] = "true" if v else "false"
            else:
                out[f.name] = str(v)
        return out

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> "EngineConfig":
        """Settings from strings (absent or empty: the default), each read as its field's type.
        Unknown names are an error."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown runtime setting(s) {unknown}; settings: {', '.join(sorted(known))}")
        kw: dict[str, Any] = {}
        for name, text in values.items():
            text = text.strip()
            if not text:
                continue
            try:
                kw[name] = _from_text(value_type(known[name]), text)
            except ValueError:
                raise ConfigError(f"runtime setting {name}={text!r} is not a valid value") from None
        if kw.get("threads") == 0:  # "0" = all cores, as in Triton's parameters
            kw.pop("threads")
        return cls(**kw)


def parse_lora_modules(value: Any) -> dict[str, str]:
    """lora_modules' "NAME=PATH[,NAME=PATH..]" as {name: path}, in order; ConfigError naming the bad entry."""
    if not isinstance(value, str):
        raise ConfigError(f"must be NAME=PATH[,NAME=PATH...], got {value!r}")
    out: dict[str, str] = {}
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        name, sep, path = (x.strip() for x in entry.partition("="))
        if not sep or not name or not path:
            raise ConfigError(f"{entry!r} is not NAME=PATH (a name for the adapter, then its PEFT folder)")
        if name in out:
            raise ConfigError(f"the adapter name {name!r} is given twice; give each adapter its own name")
        out[name] = path
    return out


_HINTS = typing.get_type_hints(EngineConfig)


def value_type(f: Field) -> type:
    """The setting's type without None: int, float, bool, str (also `str | int` sizes), tuple (of ints)."""
    hint = _HINTS[f.name]
    if typing.get_origin(hint) is tuple:
        return tuple
    return next(t for t in (*(typing.get_args(hint) or (hint,)), object) if t is not type(None))


def flag(f: Field) -> str:
    """The setting's command-line flag: --max-num-seqs; a boolean is --name/--no-name, without the
    enable_ of its field (--prefix-caching/--no-prefix-caching)."""
    if value_type(f) is bool:
        name = f.name.removeprefix("enable_").replace("_", "-")
        return f"--{name}/--no-{name}"
    return "--" + f.name.replace("_", "-")


def _from_text(t: type, text: str) -> Any:
    """A setting's value from its string form (ValueError: not one)."""
    if t is int:
        return int(text)
    if t is float:
        return float(text)
    if t is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return text.lower() in ("true", "1")
    if t is tuple:
        return tuple(int(b) for b in text.split(",") if b.strip())
    return text


def _check(f: Field, v: Any) -> None:
    """One setting's value against its type, choices, range or reader (ConfigError naming it)."""
    s, t, name = spec_of(f), value_type(f), f.name
    hint = f" ({s.hint})" if s.hint else ""
    if v is None and f.default is None:  # unset: its documented default (the build's, all cores, ...)
        return
    if s.parse is not None:
        try:
            s.parse(v)
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}") from None
    elif s.choices:
        if isinstance(v, bool) or v not in s.choices:
            raise ConfigError(f"{name} must be one of {', '.join(s.choices)}, got {v!r}")
    elif t is bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{name} must be true or false, got {v!r}")
    elif t in (tuple, int, float):
        assert s.range is not None, f"{name}: a numeric setting declares its range"
        lo, hi = s.range
        if t is tuple:
            if not isinstance(v, tuple) or not all(_in_range(b, int, s.range) for b in v):
                raise ConfigError(f"{name} must be a tuple of integers >= {lo}, got {v!r}")
        elif not _in_range(v, t, s.range, s.open):
            what = "an integer" if t is int else "a number"
            bounds = (f">= {lo}" if hi is None else f"in ({lo}, {hi})" if s.open else f"in [{lo}, {hi}]")
            raise ConfigError(f"{name} must be {what} {bounds}{hint}, got {v!r}")
    elif not isinstance(v, t):
        raise ConfigError(f"{name} must be {'a string' if t is str else t.__name__}{hint}, got {v!r}")


def _in_range(v: Any, t: type, bounds: tuple | None, open_: bool = False) -> bool:
    """v is a t (an int passes as a float, a bool as neither) within bounds (None: any)."""
    if isinstance(v, bool) or not isinstance(v, (int, float) if t is float else t):
        return False
    if bounds is None:
        return True
    lo, hi = bounds
    if open_:
        return lo < v and (hi is None or v < hi)
    return lo <= v and (hi is None or v <= hi)
