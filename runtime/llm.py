"""The public Python API: `LLM(build_dir).generate(prompts, SamplingParams(...))`, a
streaming iterator and an async iterator."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

from kvexport.errors import KvExportError

from .engine import EngineConfig, LLMEngine, RequestOutput
from .sampling import SamplingParams

Prompt = str | list[int] | list[dict]  # text, token ids, or chat messages


class LLM:
    def __init__(self, build_dir: str | Path, **engine_options):
        self.engine = LLMEngine(build_dir, EngineConfig(**engine_options))

    def _tokens(self, prompt: Prompt, chat: bool = False) -> list[int]:
        tok = self.engine.tokenizer
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) or chat:
            if tok is None or not getattr(tok, "chat_template", None):
                raise KvExportError("this build's tokenizer has no chat template; pass plain prompts")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if isinstance(prompt, str):
            if tok is None:
                raise KvExportError("this build has no tokenizer; pass token ids instead of text")
            return tok(prompt)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise KvExportError(f"a prompt must be a string, a list of token ids or chat messages, got {type(prompt).__name__}")

    def _add(self, prompt: Prompt, params: SamplingParams, chat: bool) -> list[str]:
        """n > 1: sample i draws from its own seeded stream; samples after the first are
        admitted once the first has computed the prompt, so they reuse its KV blocks."""
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
        rids = [rid for p in prompts for rid in self._add(p, params, chat)]
        while self.engine.has_unfinished():
            self.engine.step()
        return [self.engine.pop_output(r) for r in rids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False) -> Iterator[RequestOutput]:
        """Yields the request's output each time it gains text or tokens; the last one is finished."""
        params = params or SamplingParams()
        if params.n != 1:
            raise KvExportError("stream() serves one sample; use generate() for n > 1")
        (rid,) = self._add(prompt, params, chat)
        try:
            out = self.engine.output(rid)
            while not out.finished:
                changed = self.engine.step()
                if any(o.request_id == rid for o in changed):
                    yield out
            if not out.token_ids:
                yield out
        finally:
            if not self.engine.output(rid).finished:
                self.engine.abort(rid)
            self.engine.pop_output(rid)

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None,
                      chat: bool = False) -> AsyncIterator[RequestOutput]:
        for out in self.stream(prompt, params, chat):
            yield out
            await asyncio.sleep(0)
