"""The runtime settings: one definition, one set of defaults.

`EngineConfig` is what every front end builds an engine from: the Python API
(`LLM(build, **settings)`), every CLI command that serves (`generate`, `bench`, `serve`),
the OpenAI server and the Triton model (whose config.pbtxt `parameters` are these fields,
as strings). The CLI generates its options from these fields (kvexport/cli.py
`engine_options`: the flag is the field's name, the help text is `SETTINGS`), so a new
setting is added here once and appears everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvexport.errors import ConfigError
from kvexport.io import BACKENDS  # onnxruntime | tensorrt, as `kvexport build --backend` names them
from kvexport.manifest_weights import WEIGHT_MATMUL_ACCURACY  # onnxruntime CPU, int8/int4 weights: session_plan.py

from .core.memory import parse_budget, parse_size

# core/streaming.py: attention sinks + a recent window; core/importance.py: attention-scored (snapkv at the
# prompt, h2o also while decoding) within a per-sequence budget
KV_EVICTIONS = ("none", "streaming", "snapkv", "h2o")
SPECULATIVE = ("none", "ngram", "draft")  # core/speculation.py: speculative decoding's proposer
FLOAT_SETTINGS = ("kv_budget_fraction",)  # settings that take a number with a fraction (the CLI's type)
CHOICES = {"backend": BACKENDS, "weight_matmul_accuracy": WEIGHT_MATMUL_ACCURACY,
           "kv_eviction": KV_EVICTIONS, "speculative": SPECULATIVE}  # settings with a fixed set of values


@dataclass(frozen=True, slots=True)
class EngineConfig:
    kv_cache_memory: str | int = "2GiB"  # KV pool budget: "2GiB", bytes, or "30%" of available memory
    max_num_seqs: int = 64  # sequences per engine step
    max_num_batched_tokens: int = 512  # tokens per engine step (prompt chunks + decodes)
    max_model_len: int | None = None  # tokens per sequence (prompt + output); None: the build's max_seq_len
    enable_prefix_caching: bool = True  # reuse KV blocks of identical prompt prefixes
    threads: int | None = None  # onnxruntime intra-op threads; None: all cores
    backend: str = "onnxruntime"  # "onnxruntime" | "tensorrt" (the build's engines)
    cuda_graph_batch_sizes: tuple[int, ...] = ()  # tensorrt: decode batch sizes captured as CUDA graphs
    max_sequences_per_request: int = 64  # sequences one front-end request may submit (prompts x n), max
    # int8/int4 weights on onnxruntime (CPU): "auto" | "int8" | "float" (execution/session_plan.py);
    # None: the build's own (weights.quantization.matmul_accuracy; "auto" for builds before it)
    weight_matmul_accuracy: str | None = None
    # KV tiers below the pool (runtime/core/kv_tiers.py): evicted prefix-cache blocks go to host memory,
    # then to disk; a prefix found there is copied back instead of recomputed
    kv_offload_memory: str | int = "0"  # host tier budget: a size ("4GiB", bytes); "0": no host tier
    kv_offload_dir: str = ""  # disk tier folder (survives restarts); "": no disk tier
    kv_offload_disk: str | int = "8GiB"  # disk tier budget, a size; used with kv_offload_dir
    # "streaming": a sequence keeps its first kv_sink_tokens and its last kv_recent_tokens tokens' KV,
    # the blocks between are freed, and it may run past max_model_len (runtime/core/streaming.py)
    kv_eviction: str = "none"
    kv_sink_tokens: int = 4  # streaming: tokens kept at the start (rounded up to whole blocks)
    kv_recent_tokens: int | None = None  # streaming: tokens kept at the end; None: half of max_model_len
    # snapkv / h2o (runtime/core/importance.py): KV tokens a sequence keeps, at most; and/or a share of its prompt
    kv_budget_tokens: int | None = None
    kv_budget_fraction: float | None = None
    kv_observation_tokens: int = 32  # snapkv / h2o: the prompt's last tokens whose attention scores its KV
    # speculative decoding (core/speculation.py): "ngram" (prompt lookup), "draft" (draft_model), "none"
    speculative: str = "none"
    draft_model: str = ""  # speculative "draft": the draft build's folder (same vocabulary)
    num_speculative_tokens: int = 4  # drafts per decoding step, at most (1..16)
    # sequences running above which nobody drafts; below it the cost model decides (docs/BENCHMARKS.md: 16
    # measured at par or better than 8 with it on a 2-core CPU)
    speculative_max_batch: int = 16
    # speculative: drafts chosen by the measured step cost (core/speculation.py StepCost): only those whose
    # expected tokens pay for the rows they add; False: every draft the per-sequence back-off allows
    speculative_cost_model: bool = True
    # hybrid (gated DeltaNet) builds' prefix caching (core/state_pool.py): a recurrent-state checkpoint every this
    # many KV blocks (prompt chunks end on those boundaries); 0: hybrids recompute every prompt
    state_checkpoint_blocks: int = 32
    state_checkpoints: int = 64  # hybrids: checkpoint slots (each one sequence's recurrent state), least recently used evicted

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.weight_matmul_accuracy is not None and self.weight_matmul_accuracy not in WEIGHT_MATMUL_ACCURACY:
            raise ConfigError(f"weight_matmul_accuracy must be one of {', '.join(WEIGHT_MATMUL_ACCURACY)}, "
                              f"got {self.weight_matmul_accuracy!r}")
        if self.kv_eviction not in KV_EVICTIONS:
            raise ConfigError(f"kv_eviction must be one of {', '.join(KV_EVICTIONS)}, got {self.kv_eviction!r}")
        v = self.kv_sink_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"kv_sink_tokens must be an integer >= 0 (0: a plain sliding window), got {v!r}")
        v = self.kv_recent_tokens
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"kv_recent_tokens must be an integer >= 1 (or unset: half of max_model_len), got {v!r}")
        for name in ("kv_budget_tokens", "kv_observation_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        v = self.kv_budget_fraction
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1):
            raise ConfigError(f"kv_budget_fraction must be a number in (0, 1) (the share of a prompt's KV kept), "
                              f"got {v!r}")
        if (self.kv_budget_tokens is not None or self.kv_budget_fraction is not None) \
                and self.kv_eviction not in ("snapkv", "h2o"):
            raise ConfigError(f"kv_budget_tokens / kv_budget_fraction are budgets of --kv-eviction snapkv or h2o, "
                              f"not of {self.kv_eviction!r}: set --kv-eviction snapkv, or leave the budget unset")
        if self.speculative not in SPECULATIVE:
            raise ConfigError(f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}")
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
        if not isinstance(self.speculative_cost_model, bool):
            raise ConfigError(f"speculative_cost_model must be true or false, got {self.speculative_cost_model!r}")
        if not isinstance(self.draft_model, str) or bool(self.draft_model) != (self.speculative == "draft"):
            raise ConfigError(f"draft_model is the draft build of speculative 'draft' and only of it: got "
                              f"speculative {self.speculative!r} with draft_model {self.draft_model!r}; give "
                              f"--speculative draft --draft-model BUILD, or neither")
        v = self.num_speculative_tokens
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 16:
            raise ConfigError(f"num_speculative_tokens must be an integer in [1, 16] (drafts per step), got {v!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_sequences_per_request", "speculative_max_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ConfigError(f"threads must be an integer >= 1 (or unset: all cores), got {self.threads!r}")
        for name in ("state_checkpoint_blocks", "state_checkpoints"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0 (0: no hybrid prefix caching), got {v!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        sizes = self.cuda_graph_batch_sizes
        if not isinstance(sizes, tuple) or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ConfigError(f"cuda_graph_batch_sizes must be a tuple of integers >= 1, got {sizes!r}")
        parse_budget(self.kv_cache_memory)  # raises ConfigError naming the accepted forms
        for name in ("kv_offload_memory", "kv_offload_disk"):
            try:
                parse_size(getattr(self, name))
            except ConfigError as e:
                raise ConfigError(f"{name}: {e}") from None
        if not isinstance(self.kv_offload_dir, str):
            raise ConfigError(f"kv_offload_dir must be a folder path (or empty: no disk tier), got {self.kv_offload_dir!r}")
        if self.kv_offload_dir and parse_size(self.kv_offload_disk) < 1:
            raise ConfigError(f"kv_offload_disk is 0 bytes but kv_offload_dir is set: give the disk tier a size such "
                              "as 8GiB, or leave kv_offload_dir empty")
        if (self.kv_offload_dir or parse_size(self.kv_offload_memory)) and not self.enable_prefix_caching:
            raise ConfigError("kv_offload_memory / kv_offload_dir keep prefix-cache blocks, so they need "
                              "enable_prefix_caching; turn prefix caching on or the offload off")

    # ---- string form (Triton model parameters) ----------------------------------------
    def to_strings(self) -> dict[str, str]:
        """Every field as a string (Triton's config.pbtxt parameters); `from_strings` inverts it."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "cuda_graph_batch_sizes":
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
        """Settings from strings (absent or empty: the default). Unknown names are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown runtime setting(s) {unknown}; settings: {', '.join(sorted(known))}")
        kw: dict[str, Any] = {}
        for name, text in values.items():
            text = text.strip()
            if not text:
                continue
            try:
                if name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "threads",
                            "max_sequences_per_request", "kv_sink_tokens", "kv_recent_tokens",
                            "num_speculative_tokens", "speculative_max_batch", "kv_budget_tokens",
                            "kv_observation_tokens", "state_checkpoint_blocks", "state_checkpoints"):
                    kw[name] = int(text)
                elif name in FLOAT_SETTINGS:
                    kw[name] = float(text)
                elif name in ("enable_prefix_caching", "speculative_cost_model"):
                    if text.lower() not in ("true", "false", "1", "0"):
                        raise ValueError(text)
                    kw[name] = text.lower() in ("true", "1")
                elif name == "cuda_graph_batch_sizes":
                    kw[name] = tuple(int(b) for b in text.split(",") if b.strip())
                else:
                    kw[name] = text
            except ValueError:
                raise ConfigError(f"runtime setting {name}={text!r} is not a valid value") from None
        if kw.get("threads") == 0:  # "0" = all cores, as in Triton's parameters
            kw.pop("threads")
        return cls(**kw)


# help of each field, for the CLI options and docs (kvexport/cli_options.py engine_options)
SETTINGS: dict[str, str] = {
    "kv_cache_memory": "KV pool budget: a size (2GiB, 512MiB, bytes) or a share of free memory (30%).",
    "max_num_seqs": "Sequences per engine step, max.",
    "max_num_batched_tokens": "Tokens per engine step (prompt chunks + decodes), max.",
    "max_model_len": "Tokens per sequence, prompt + output [the build's max_seq_len].",
    "enable_prefix_caching": "Reuse the KV blocks of identical prompt prefixes.",
    "threads": "onnxruntime intra-op threads [all cores].",
    "backend": "Execution backend: onnxruntime, or tensorrt (the build's engines; needs TensorRT and a GPU).",
    "cuda_graph_batch_sizes": "tensorrt: decode batch sizes to capture as CUDA graphs, comma-separated (e.g. 1,2,4,8).",
    "weight_matmul_accuracy": "int8/int4 weights on onnxruntime (CPU) [the build's: `kvexport inspect` says which]. "
                              "auto: block-wise weights' steps of 8 tokens or more as int8 pairs (~15-bit "
                              "activations and weights on int8 x int8 GEMMs, a second session: +2 bytes per weight "
                              "of RSS), smaller ones with int8 activations (MatMulNBits); fp16 int4 builds: large "
                              "steps in float. int8: int8 activations throughout, steps of 4+ tokens as per-channel "
                              "int8 x int8 GEMMs (fastest; smollm2 rtn int4 perplexity +1.9% with VNNI, +13% on "
                              "AVX2-only CPUs, whose int8 activations get 7 bits). float: exact everywhere (slow "
                              "decode).",
    "kv_eviction": "KV eviction: none (a sequence stops at max_model_len), streaming (attention sinks: keep "
                   "the first --kv-sink-tokens and the last --kv-recent-tokens tokens' KV, free the blocks between; "
                   "max_tokens may exceed max_model_len; docs/ARCHITECTURE.md \"Streaming\"), snapkv (when a prompt "
                   "completes, keep the KV blocks its last --kv-observation-tokens attend to most, within "
                   "--kv-budget-tokens / --kv-budget-fraction; sinks and recent tokens always kept) or h2o (snapkv, "
                   "and while decoding the blocks with the most accumulated attention, so a generation stays within "
                   "the budget).",
    "kv_sink_tokens": "streaming: tokens kept at the start of each sequence (rounded up to whole KV blocks; 0: a "
                      "plain sliding window).",
    "kv_recent_tokens": "streaming: most recent tokens kept [half of max_model_len]; at least one KV block, and "
                        "sinks + recent + one block within max_model_len and the KV pool.",
    "kv_budget_tokens": "snapkv / h2o: KV tokens each sequence keeps, at most (at least sinks + recent + one block; "
                        "a request may ask for fewer: kv_budget_tokens).",
    "kv_budget_fraction": "snapkv / h2o: the share of each prompt's KV kept (0-1, e.g. 0.25); with "
                          "--kv-budget-tokens the smaller wins.",
    "kv_observation_tokens": "snapkv / h2o: the prompt's last tokens whose attention scores the rest (the observation "
                             "window; always kept).",
    "kv_offload_memory": "Host-memory tier for prefix-cache blocks evicted from the KV pool, a size (4GiB); 0: off. "
                         "A prefix found there is copied back instead of recomputed.",
    "kv_offload_dir": "Disk tier folder for evicted prefix-cache blocks (below the host tier; survives restarts). "
                      "It holds only kvexport's block files, marked; a folder with other files is refused.",
    "kv_offload_disk": "Disk tier budget, a size (used with --kv-offload-dir); a full disk turns the tier off.",
    "speculative": "Speculative decoding: none, ngram (prompt lookup: drafts copied from the request's own tokens), "
                   "or draft (a smaller build's drafts, --draft-model). Outputs are distributed exactly as without "
                   "it (greedy: identical); a request may turn it off (speculative: false).",
    "draft_model": "speculative draft: the draft model's build folder (same tokenizer and vocabulary).",
    "num_speculative_tokens": "speculative: tokens drafted per decoding step, at most (1-16; backed off per "
                              "sequence when its drafts are rejected).",
    "speculative_max_batch": "speculative: with more sequences running than this, nobody drafts (a large batch's "
                             "decode is no longer memory-bound); at or below it the step-cost model decides.",
    "speculative_cost_model": "speculative: time the steps and draft only where the expected accepted tokens pay "
                              "for the rows they add (a CPU's large batch drafts little, a GPU's or a single "
                              "stream's all); off: every draft the per-sequence back-off allows.",
    "state_checkpoint_blocks": "Hybrid (gated DeltaNet) builds: save the linear layers' recurrent state every this "
                               "many KV blocks, so prompts sharing a prefix resume from the nearest checkpoint (prompt "
                               "chunks end on those boundaries); 0: no prefix caching for hybrids.",
    "state_checkpoints": "Hybrid builds: recurrent-state checkpoints kept (each one sequence's state: kvexport plan "
                         "shows its bytes); the least recently used is dropped for a new one.",
    "max_sequences_per_request": "Sequences one request may ask for (prompts x n), max; more is refused with 400. "
                                 "Requests share the engine in turn, so a large one cannot starve the others.",
}
