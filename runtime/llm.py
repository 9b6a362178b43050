"""The public Python API: `LLM(build_dir).generate(prompts, SamplingParams(...))`, a
streaming iterator and an async iterator.

A prompt is text, token ids, chat messages, or (as vLLM's TextPrompt / TokensPrompt) a dict
`{"prompt": text}` or `{"prompt_token_ids": ids}` with an optional `"cache_salt"`: the
prompt then shares prefix-cache blocks only with prompts of the same salt.

One `LLM` may be used from several threads at once: every touch of the engine (adding,
stepping, aborting, popping) holds one lock, and whichever caller holds it steps the engine
for everyone, so the requests of concurrent `generate`/`stream` calls are batched together.
Each caller waits only for its own requests; step outputs of a streamed request are queued
for its stream, so none is lost when another thread ran the step.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

from kvexport.errors import KvExportError
from kvexport.manifest import model_source_refusal

from .engine import EngineConfig, LLMEngine, RequestOutput
from .core.block_hash import request_salt
from .serving.requests import RequestError, RequestParser, check_cache_salt
from .sampling_params import SamplingParams

Prompt = str | list[int] | list[dict] | dict  # text, token ids, chat messages, or a prompt dict (below)
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")  # vLLM's TextPrompt / TokensPrompt fields


def _model_source_refusal(build_dir: str | os.PathLike) -> str | None:
    """Why `build_dir` is a model source rather than a build, saying to build it first
    (the words every command uses: kvexport/manifest.py); None when it is not one."""
    return model_source_refusal(build_dir, "LLM(BUILD)")


def _is_prompt_dict(p) -> bool:
    """A vLLM-style prompt dict ({"prompt": ...} or {"prompt_token_ids": ...}), not a chat message."""
    return isinstance(p, dict) and ("prompt" in p or "prompt_token_ids" in p) and "role" not in p


def _is_one_prompt(prompts) -> bool:
    return isinstance(prompts, str) or _is_prompt_dict(prompts) or (
        isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], (int, dict))
        and not _is_prompt_dict(prompts[0]))


def _unwrap(prompt: Prompt, param: str) -> tuple[Prompt, str | None]:
    """(the prompt itself, its prefix-cache salt): a prompt dict's "prompt" or
    "prompt_token_ids" and its checked "cache_salt"; any other prompt as it is, unsalted."""
    if not isinstance(prompt, dict):
        return prompt, None
    if unknown := sorted(map(str, set(prompt) - set(PROMPT_DICT_KEYS))):
        raise RequestError(f"{param}: unknown key(s) {unknown} in a prompt dict; keys: {', '.join(PROMPT_DICT_KEYS)}",
                           param)
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise RequestError(f"{param}: a prompt dict takes exactly one of 'prompt' (text) and 'prompt_token_ids'",
                           param)
    salt = check_cache_salt(prompt.get("cache_salt"), f"{param}.cache_salt")
    inner = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    if "prompt" in prompt and not isinstance(inner, str):
        raise RequestError(f"{param}.prompt must be a string (token ids go in 'prompt_token_ids')", f"{param}.prompt")
    return inner, request_salt(None, salt)


class LLM:
    def __init__(self, build_dir: str | Path, config: EngineConfig | None = None, **settings):
        """`build_dir`: a folder written by `kvexport build`. `config`, or the runtime settings
        as keywords (EngineConfig's fields, e.g. kv_cache_memory="1GiB", max_num_seqs=32); not both."""
        if isinstance(build_dir, bool) or not isinstance(build_dir, (str, os.PathLike)):
            raise KvExportError(f"build_dir must be the path of a kvexport build (a str or Path), got "
                                f"{type(build_dir).__name__} {build_dir!r}")
        if config is not None and not isinstance(config, EngineConfig):
            raise KvExportError(f"config must be an EngineConfig (or pass the settings as keywords), got "
                                f"{type(config).__name__}")
        if config is not None and settings:
            raise KvExportError("pass an EngineConfig or settings as keywords, not both")
        known = EngineConfig.__dataclass_fields__
        if unknown := sorted(set(settings) - set(known)):
            raise KvExportError(f"unknown runtime setting(s) {unknown}; settings: {', '.join(known)}")
        if (why := _model_source_refusal(build_dir)) is not None:
            raise KvExportError(why)
        try:
            config = config or EngineConfig(**settings)
        except TypeError as e:  # NOTE: a dataclass's own type errors, e.g. a positional mix-up
            raise KvExportError(f"invalid runtime settings: {e}") from None
        self.engine = LLMEngine(build_dir, config)
        self.parser = RequestParser.for_engine(self.engine)
        # NOTE: the engine is not thread-safe (its scheduler, block pool and request ids); every
        # call into it holds this lock, and no lock is held while a caller's code runs (a yield)
        self._lock = threading.Lock()
        self._streams: dict[str, collections.deque[RequestOutput]] = {}  # rid -> step outputs not yet yielded

    # ---- requests -----------------------------------------------------------------------------
    def _tokens(self, prompt: Prompt, chat: bool = False, param: str = "prompt") -> list[int]:
        """A prompt -> checked token ids (runtime/serving/requests.py); raises RequestError. Chat
        messages (or any prompt with chat=True) go through the chat template."""
        if chat or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            return self.parser.chat([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
                                    param)
        return self.parser.prompt(prompt, param)

    def _add(self, ids: list[int], params: SamplingParams, salt: str | None = None) -> list[str]:
        """Queue one tokenized prompt (the lock held). n > 1: sample i draws from its own seeded
        stream; samples after the first are admitted once the first has computed the prompt,
        so they reuse its KV blocks.
        NOTE: the prompt's length is not checked here: an empty or too long prompt fails
        alone (its output carries the engine's error): docs/ARCHITECTURE.md, "A request fails alone"."""
        rids = [self.engine.add_request(ids, params, salt=salt)]
        for i in range(1, params.n):
            rids.append(self.engine.add_request(ids, params, sample_index=i, share_prompt_with=rids[0], salt=salt))
        return rids

    def _params_per_prompt(self, params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
            if len(params) != count:
                raise RequestError(f"params: {len(params)} SamplingParams for {count} prompt(s); pass one "
                                   f"SamplingParams for all, or one per prompt", "params")
            return list(params)
        raise RequestError(f"params must be a SamplingParams or a list of them (one per prompt), got "
                           f"{type(params).__name__}", "params")

    def _step(self) -> None:
        """One engine step (the lock held); a streamed request's outputs go to its queue."""
        for o in self.engine.step():
            q = self._streams.get(o.request_id)
            if q is not None:
                q.append(o)

    def _drop(self, rids: list[str]) -> None:
        with self._lock:
            for r in rids:
                self._streams.pop(r, None)
                self.engine.abort(r)
                self.engine.pop_output(r)

    # ---- the API ------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str | Path) -> None:
        """Serve the PEFT LoRA folder at `path` as adapter `name` from now on (`SamplingParams(lora=name)`), beside
        those of `lora_modules`, at most `max_loras` at once; the build needs --lora-max-rank. ConfigError naming
        lora_name / lora_path."""
        from kvexport import lora_adapters

        adapter = lora_adapters.read(Path(path).expanduser(), what="lora_path")  # NOTE: outside the lock: file reads
        with self._lock:
            self.engine.load_lora(name, adapter)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`; RequestError naming lora_name while requests run under it."""
        with self._lock:
            self.engine.unload_lora(name)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """All prompts are submitted at once and served with continuous batching. `params`: one
        SamplingParams for every prompt, or a list of one per prompt (as vLLM takes). Returns
        one output per prompt (n outputs per prompt, consecutively, when its n > 1). Safe to
        call from several threads at once."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        elif isinstance(prompts, tuple) or hasattr(prompts, "tolist"):  # a numpy array: one prompt per row
            prompts = list(prompts)
        elif not isinstance(prompts, list):
            raise RequestError(f"prompts must be a string, token ids, chat messages or a list of those, got "
                               f"{type(prompts).__name__}", "prompts")
        per_prompt = self._params_per_prompt(params, len(prompts))
        # tokenized before the lock: a chat template or a long text does not hold up the other callers
        unwrapped = [_unwrap(p, "prompt" if len(prompts) == 1 else f"prompts[{i}]") for i, p in enumerate(prompts)]
        ids = [self._tokens(p, chat, "prompt" if len(prompts) == 1 else f"prompts[{i}]")
               for i, (p, _) in enumerate(unwrapped)]
        rids: list[str] = []
        try:
            with self._lock:
                for tokens, sp, (_, salt) in zip(ids, per_prompt, unwrapped):
                    rids += self._add(tokens, sp, salt)
            while True:
                with self._lock:
                    if all(self.engine.output(r).finished for r in rids):
                        return [self.engine.pop_output(r) for r in rids]
                    self._step()
        except BaseException:  # a bad prompt or an interrupt: leave nothing queued for the next call
            self._drop(rids)
            raise

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False) -> Iterator[RequestOutput]:
        """Yields the request's output each time it gains text or tokens; the last one is finished."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}", "params")
        if params.n != 1:
            raise KvExportError("stream() serves one sample; use generate() for n > 1")
        prompt, salt = _unwrap(prompt, "prompt")
        ids = self._tokens(prompt, chat)
        with self._lock:
            (rid,) = self._add(ids, params, salt)
            out = self.engine.output(rid)
            q = self._streams[rid] = collections.deque()
        try:
            if out.finished:  # refused at admission
                yield out
            while not out.finished:
                with self._lock:
                    if not q:
                        self._step()
                    ready = list(q)
                    q.clear()
                for out in ready:
                    yield out
        finally:
            self._drop([rid])

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None,
                      chat: bool = False) -> AsyncIterator[RequestOutput]:
        for out in self.stream(prompt, params, chat):
            yield out
            await asyncio.sleep(0)
