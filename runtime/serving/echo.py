"""The prompt's part of a `/v1/completions` answer: `echo` (the prompt's text before the
completion, and with `logprobs` its tokens' log-probabilities in OpenAI's legacy form) and
vLLM's `prompt_logprobs`. Pure functions over the engine's `PromptLogprobs`; the server
(runtime/serving/server.py) calls them off its event loop (they decode many tokens).

    echo + logprobs: k ──▶ {tokens, token_logprobs: [null, ..], top_logprobs: [null, {tok: lp}, ..], text_offset}
    prompt_logprobs: k ──▶ [null, {"<id>": {logprob, rank, decoded_token}, ...}, ...]

Each position's dict holds the top-k and the prompt token itself (vLLM's form: up to k + 1
entries); the first prompt token has nothing to be predicted from, hence the nulls.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from ..core.outputs import PromptLogprobs


def decode_each(tokenizer: Any, ids) -> dict[int, str]:
    """Each distinct token id -> its text alone, as the server decodes generated tokens (the id
    itself without a tokenizer)."""
    uniq = set(int(i) for i in ids)
    return {i: str(tokenizer.decode([i])) if tokenizer is not None else str(i) for i in uniq}


def prompt_text(tokenizer: Any, source: str | None, ids: Sequence[int]) -> str:
    """The echoed text: the prompt as sent when it was text (as OpenAI echoes it), else its
    tokens decoded (each token's text, joined, without a tokenizer: their ids)."""
    if source is not None:
        return source
    if tokenizer is None:
        return "".join(str(i) for i in ids)
    return str(tokenizer.decode(list(ids)))


def _tokens(p: PromptLogprobs | None, ids: Sequence[int]) -> list[int]:
    out = list(ids)
    if p is not None:
        for top in p.top or ():
            out += [t for t, _ in top]
    return out


def legacy_logprobs(ids: Sequence[int], p: PromptLogprobs, k: int, text: dict[int, str]) -> dict:
    """OpenAI's completions `logprobs` of the prompt tokens `ids` (text_offset from 0), with
    the top-k dicts when k > 0 (else top_logprobs null, as for generated tokens with logprobs 0)."""
    assert p.start == 1 and len(p) == len(ids) - 1, "one score per prompt token after the first"
    toks = [text[t] for t in ids]
    tops = None
    if k:
        tops = [None] + [{**{text[t]: v for t, v in top[:k]}, text[tok]: lp}
                         for top, tok, lp in zip(p.top or (), p.token_ids, p.logprobs)]
    return {"tokens": toks, "token_logprobs": [None, *p.logprobs],
            "text_offset": list(itertools.accumulate([0] + [len(s) for s in toks[:-1]])), "top_logprobs": tops}


def vllm_prompt_logprobs(ids: Sequence[int], p: PromptLogprobs, k: int, text: dict[int, str]) -> list:
    """vLLM's `prompt_logprobs` of a choice: per prompt position (null for the first) the
    prompt token and the top-k, token id (a string, as JSON keys are) -> logprob, rank, text."""
    assert p.start == 1 and len(p) == len(ids) - 1, "one score per prompt token after the first"
    out: list[dict | None] = [None]
    for i, (tok, lp, rank) in enumerate(zip(p.token_ids, p.logprobs, p.ranks)):
        d = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": text[t]}
             for r, (t, v) in enumerate((p.top[i] if p.top is not None else ())[:k])}
        d[str(tok)] = {"logprob": lp, "rank": rank, "decoded_token": text[tok]}
        out.append(d)
    return out


def prompt_parts(tokenizer: Any, ids: Sequence[int], p: PromptLogprobs | None, echo_k: int | None,
                 vllm_k: int | None) -> tuple[dict | None, list | None]:
    """(the echo's logprobs block, or None when `echo_k` is None; vLLM's prompt_logprobs, or
    None when `vllm_k` is None) of one prompt. `p`: its scores (from the engine)."""
    if p is None or (echo_k is None and vllm_k is None):
        return None, None
    text = decode_each(tokenizer, _tokens(p, ids))
    return (legacy_logprobs(ids, p, echo_k, text) if echo_k is not None else None,
            vllm_prompt_logprobs(ids, p, vllm_k, text) if vllm_k is not None else None)
