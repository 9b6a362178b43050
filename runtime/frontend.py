"""What a front end may use of an engine from its own threads (issue 43 §5). One thread steps the
engine (serving/engine_thread.py); preparing a request (tokenizing, rendering a chat template,
checking its settings against the engine's, compiling its grammar) happens in the front end's
worker threads before it is queued, and needs only these parts of the engine, each read-only or
thread-safe:

    RequestPrep.tokenizer         the build's tokenizer (HF tokenizers are safe to call from threads)
    RequestPrep.check_params      SamplingParams against the engine's settings (reads settings only)
    RequestPrep.compile           a structured-output spec compiled and cached (StructuredOutputManager:
                                  thread-safe), so the engine thread's own compile is a cache hit
    vocab_size, max_model_len     numbers
    lora_names                    the LoRA adapters served (runtime/lora.py): a request's `model` may name one

The OpenAI server, the Triton model and the Dynamo worker prepare requests through it and reach the
engine otherwise only through the engine thread's inbox.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .sampling_params import SamplingParams, StructuredOutputs


@dataclass(frozen=True, slots=True)
class RequestPrep:
    tokenizer: Any  # the build's tokenizer, or None (a build without one: token-id prompts only)
    vocab_size: int  # token ids are in [0, vocab_size)
    max_model_len: int  # tokens per sequence (prompt + output)
    check_params: Callable[[SamplingParams], None]  # RequestError naming the field the engine refuses
    _compile: Callable[[StructuredOutputs, str | None], Any]
    _lora_names: Callable[[], tuple[str, ...]] = tuple  # the LoRA adapters served now (they may change)

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters served now, by name (SamplingParams.lora; adapters may be loaded while serving)."""
        return self._lora_names()

    def compile(self, spec: StructuredOutputs, param: str | None = None) -> None:
        """Compile `spec`'s grammar now (cached for the engine thread); GrammarError naming `param`."""
        self._compile(spec, param)


__all__ = ["RequestPrep"]
