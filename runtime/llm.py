"""The public Python API: `LLM(build_dir).generate(prompts, SamplingParams(...))`, a
streaming iterator and an async iterator."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

from kvexport.errors import KvExportError

from .engine import EngineConfig, LLMEngine, RequestOutput
from .serving.requests import RequestParser
from .sampling_params import SamplingParams

Prompt = str | list[int] | list[dict]  # text, token ids, or chat messages


class LLM:
    def __init__(self, build_dir: str | Path, config: EngineConfig | None = None, **settings):
        """`config`, or the runtime settings as keywords (EngineConfig's fields, e.g.
        kv_cache_memory="1GiB", max_num_seqs=32); not both."""
        if config is not None and settings:
            raise KvExportError("pass an EngineConfig or settings as keywords, not both")
        known = EngineConfig.__dataclass_fields__
        if unknown := sorted(set(settings) - set(known)):
            raise KvExportError(f"unknown runtime setting(s) {unknown}; settings: {', '.join(known)}")
        self.engine = LLMEngine(build_dir, config or EngineConfig(**settings))

    def _tokens(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """A prompt -> checked token ids (runtime/serving/requests.py); raises RequestError. Chat
        messages (or any prompt with chat=True) go through the chat template."""
        parser = RequestParser.for_engine(self.engine)
        if chat or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            return parser.chat([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
        return parser.prompt(prompt)

    def _add(self, prompt: Prompt, params: SamplingParams, chat: bool) -> list[str]:
        """n > 1: sample i draws from its own seeded stream; samples after the first are
        admitted once the first has computed the prompt, so they reuse its KV blocks.
        NOTE: the prompt's length is not checked here: an empty or too long prompt fails
        alone (its output carries the engine's error), as DESIGN.md asks."""
        ids = self._tokens(prompt, chat)
        rids = [self.engine.add_request(ids, params)]
        for i in range(1, params.n):
            rids.append(self.engine.add_request(ids, params, sample_index=i, share_prompt_with=rids[0]))
        return rids

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """All prompts are submitted at once and served with continuous batching. Returns
        one output per prompt (n outputs per prompt, consecutively, when params.n > 1)."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        rids: list[str] = []
        try:
            for p in prompts:
                rids += self._add(p, params, chat)
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:  # a bad prompt or an interrupt: leave nothing queued for the next call
            self._drop(rids)
            raise
        return [self.engine.pop_output(r) for r in rids]

    def _drop(self, rids: list[str]) -> None:
        for r in rids:
            self.engine.abort(r)
            self.engine.pop_output(r)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False) -> Iterator[RequestOutput]:
        """Yields the request's output each time it gains text or tokens; the last one is finished."""
        params = params or SamplingParams()
        if params.n != 1:
            raise KvExportError("stream() serves one sample; use generate() for n > 1")
        (rid,) = self._add(prompt, params, chat)
        try:
            out = self.engine.output(rid)
            if out.finished:  # refused at admission
                yield out
            while not out.finished:
                for o in self.engine.step():
                    if o.request_id == rid:
                        out = o
                        yield o
        finally:
            self._drop([rid])

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None,
                      chat: bool = False) -> AsyncIterator[RequestOutput]:
        for out in self.stream(prompt, params, chat):
            yield out
            await asyncio.sleep(0)
