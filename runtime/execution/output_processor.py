"""The output processor: the scheduler's per-request step results -> `RequestOutput`s.

This module owns detokenization (one `IncrementalDetokenizer` per request), stop
*strings* (they need the text; token-level stops belong to the scheduler), logprob
accumulation and request timing. Every step returns new `RequestOutput` objects: nothing a
caller holds is changed later, so a front end can hand them to another thread as they are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..core.outputs import EngineCoreOutput, PromptLogprobs
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state after a step: cumulative fields plus what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str  # the final text so far (held-back text excluded)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    new_text: str = ""  # text added by this step (streaming)
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by this step
    logprobs: list[float] | None = None  # per generated token, when requested
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None  # per token: (token, logprob), best first
    arrival_time: float = 0.0  # time.perf_counter() seconds
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache
    # every prompt token's logprob from position 1 (SamplingParams.prompt_logprobs), once the prompt is computed
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True, eq=False)
class _RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    first_token_time: float | None = None
    num_cached_prompt_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    output: RequestOutput | None = None  # the latest snapshot

    def snapshot(self, new_text: str, new_ids: list[int], finish_reason: str | None, error: str | None,
                 finish_time: float | None) -> RequestOutput:
        self.output = RequestOutput(
            self.request_id, self.prompt_token_ids, list(self.token_ids), self.text, finish_reason is not None,
            finish_reason, error, new_text, new_ids,
            # NOTE: shallow copies of immutable entries (a step costs a pointer copy per token)
            list(self.logprobs) if self.logprobs is not None else None,
            list(self.top_logprobs) if self.top_logprobs is not None else None,
            self.arrival_time, self.first_token_time, finish_time, self.num_cached_prompt_tokens,
            self.prompt_logprobs)  # NOTE: immutable, shared by the snapshots
        return self.output


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
        st = _RequestState(request_id, list(prompt), params, IncrementalDetokenizer(self.tokenizer, params.stop),
                           time.perf_counter(), logprobs=[] if params.logprobs is not None else None,
                           top_logprobs=[] if params.logprobs else None)
        self._states[request_id] = st
        return st.snapshot("", [], None, None, None)

    def finish(self, request_id: str, reason: str, error: str | None = None) -> RequestOutput | None:
        """Mark a request finished outside a step (refused at admission, aborted)."""
        st = self._states.get(request_id)
        if st is None or (st.output is not None and st.output.finished):
            return None
        return st.snapshot("", [], reason, error, time.perf_counter())

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """One step's scheduler results -> (the new RequestOutputs, request ids that hit a
        stop string and must be finished in the scheduler)."""
        now = time.perf_counter()
        changed, stopped = [], []
        for o in outputs:
            st = self._states.get(o.request_id)
            if st is None or (st.output is not None and st.output.finished):
                continue  # unknown, or finished already (a stop string ends it before the scheduler knows)
            reason, new_text = o.finish_reason, ""
            if o.prompt_logprobs is not None:
                st.prompt_logprobs = o.prompt_logprobs
            st.num_cached_prompt_tokens = o.num_cached_prompt_tokens or st.num_cached_prompt_tokens
            new_ids = []
            for j, tok in enumerate(o.new_token_ids):
                st.first_token_time = st.first_token_time or now
                st.token_ids.append(tok)
                new_ids.append(tok)
                # speculation: a step of several tokens carries each one's logprobs (EngineCoreOutput.tokens)
                lp, top = (o.tokens[j].logprob, o.tokens[j].top_logprobs) if o.tokens else (o.logprob, o.top_logprobs)
                if st.logprobs is not None and lp is not None:
                    st.logprobs.append(lp)
                    if st.top_logprobs is not None:
                        st.top_logprobs.append(tuple(top or ()))
                piece, hit = st.detok.add(tok)
                new_text += piece
                if hit:
                    if reason is None:
                        stopped.append(o.request_id)
                    reason = "stop"
                    break  # NOTE: nothing after a stop string (a step may carry several tokens)
            if reason is not None and reason != "error":
                new_text += st.detok.flush()  # held-back text is final now (nothing after a stop string)
            st.text += new_text
            changed.append(st.snapshot(new_text, new_ids, reason, o.error,
                                       now if reason is not None else None))
        return changed, stopped

    def output(self, request_id: str) -> RequestOutput:
        st = self._states[request_id]
        assert st.output is not None
        return st.output

    def pop(self, request_id: str) -> RequestOutput:
        st = self._states.pop(request_id)
        assert st.output is not None
        return st.output

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states
