"""NVIDIA Dynamo's wire format on kvexport's side: what `kvexport dynamo` (dynamo_worker.py)
reads from and writes to the Dynamo runtime. Pure functions and no Dynamo import, so they are
tested without Dynamo installed.

    PreprocessedRequest (the frontend tokenized it)      ──request_to_params──▶ prompt, SamplingParams
        {token_ids, stop_conditions, sampling_options, output_options, eos_token_ids, ...}
    engine_thread.Event                                  ──chunk──▶ {token_ids, log_probs?, top_logprobs?,
                                                                     finish_reason?, completion_usage?}
    BlockPool events (BlockStored / BlockRemoved)        ──kv_event_batch──▶ KvEventPublisher.publish_batch
    routing.cache_salt / extra_args.nvext.cache_salt     ──request_cache_salt──▶ the request's cache_salt

What the frontend does itself, so the engine does not: stop strings (it detokenizes, finds them
and stops the request: the worker sees the context stopped), detokenization, chat templates.

NOTE: Dynamo's router hashes the *tokens* of each stored block itself (xxh3 per block,
`compute_block_hash_for_seq`) and walks its radix tree by those; the `block_hashes` of an
event are the engine's own names for the blocks, used to chain a block to its parent and to
remove it later. kvexport's names are its prefix-cache keys (SHA-256 chained, core/block_hash.py),
cut to the signed 64-bit integers the publisher takes (`external_hash`): two live blocks
colliding in 64 bits is no practical concern, and a collision could only misroute, never serve
wrong KV (the engine looks blocks up by its full 32-byte keys).

NOTE: salts. A client's `cache_salt` (top level, as vLLM takes it, or `nvext.cache_salt`, which
wins in Dynamo 1.6.1's frontend) reaches the worker as `routing.cache_salt` and
`extra_args.nvext.cache_salt`, one value; the worker salts the request's prefix-cache keys with
it (block_hash.request_salt(None, cache_salt): Dynamo's frontend passes no API key or header to
the worker, so there is no tenant part). Which salts are taken is cache_salts.py's rule: with
the worker's --cache-salt-key only those a gateway signed, so no field a client fills can choose
one. Dynamo 1.6.1's router mixes a request's cache_salt into the hash of *every* block
(`compute_block_hash_for_seq` `cache_namespace=`), so each stored entry carries its blocks'
`cache_salt` and the router's radix tree keeps salted blocks apart from unsalted and differently
salted ones: a salted request is routed by its salted hashes only. A salt with a tenant part
(not made by this worker) is sent whole, so it can never equal a tenant-less request's
cache_salt either way except by a client sending that very string, which could only misroute,
never share KV.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core.block_hash import BlockHash, split_salt
from ..core.block_pool import BlockRemoved, BlockStored
from ..sampling_params import SamplingParams, StructuredOutputs
from .engine_thread import Event
from .cache_salts import SaltKey, accept_salt
from .requests import RequestError, RequestParser, structured_outputs

# kvexport finish reasons -> Dynamo's (FinishReason in its LLMEngineOutput; "error" is raised, never sent)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled"}

# sampling_options fields taken as SamplingParams' fields of the same name
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty")


def _refuse_set(group: Mapping[str, Any], where: str, names: Sequence[str], why: str) -> None:
    for k in names:
        v = group.get(k)
        if v not in (None, False, [], {}):
            raise RequestError(f"{where}.{k}={v!r}: {why}", f"{where}.{k}")


def guided_decoding(value: Any, param: str = "sampling_options.guided_decoding") -> StructuredOutputs | None:
    """The frontend's guided decoding ({json | regex | choice | grammar, backend?, whitespace_pattern?}: what
    it makes of response_format, structured_outputs, guided_* and tool_choice required/named) ->
    StructuredOutputs. `backend` names a library and is ignored (kvexport uses xgrammar);
    whitespace_pattern and structural_tag are refused by name."""
    if value in (None, {}):
        return None
    if not isinstance(value, Mapping):
        raise RequestError(f"{param} must be an object, got {type(value).__name__}", param)
    for k in ("whitespace_pattern", "structural_tag"):
        if value.get(k) is not None:
            raise RequestError(f"{param}.{k}: not supported by kvexport's engine", f"{param}.{k}")
    return structured_outputs({k: v for k, v in value.items() if k not in ("backend", "whitespace_pattern",
                                                                            "structural_tag")}, param)


def request_to_params(request: Any, parser: RequestParser) -> tuple[list[int], SamplingParams]:
    """A Dynamo PreprocessedRequest -> (checked prompt token ids, SamplingParams). Raises
    RequestError naming the field for what kvexport cannot do (beam search, guided decoding,
    n > 1, prompt logprobs) and for bad values; unknown fields are ignored (newer frontends)."""
    if not isinstance(request, Mapping):
        raise RequestError(f"the request must be an object, got {type(request).__name__}")
    prompt = parser.prompt(request.get("token_ids"), "token_ids")
    stop = request.get("stop_conditions") or {}
    samp = request.get("sampling_options") or {}
    out = request.get("output_options") or {}
    for where, group in (("stop_conditions", stop), ("sampling_options", samp), ("output_options", out)):
        if not isinstance(group, Mapping):
            raise RequestError(f"{where} must be an object, got {type(group).__name__}", where)
    _refuse_set(samp, "sampling_options", ("use_beam_search",), "not supported by kvexport's engine")
    for k in ("n", "best_of"):
        if samp.get(k) not in (None, 1):
            raise RequestError(f"sampling_options.{k}={samp[k]!r}: a kvexport Dynamo worker returns one "
                               f"choice per request; send {k}=1 (or several requests)", f"sampling_options.{k}")
    # NOTE: Dynamo 1.6.1's frontend turns a client's `echo: true` into prompt_logprobs=1 too: say both
    _refuse_set(out, "output_options", ("prompt_logprobs",), "prompt log-probabilities (`prompt_logprobs`, or "
                "`echo`, which the frontend asks them for) are served by `kvexport serve` (on --all-logits "
                "builds), not by the Dynamo worker")
    _refuse_set(stop, "stop_conditions", ("max_thinking_tokens",), "not supported by kvexport's engine")
    values: dict[str, Any] = {k: samp.get(k) for k in _SAMPLING}
    if isinstance(values["top_k"], int) and not isinstance(values["top_k"], bool) and values["top_k"] < 0:
        values["top_k"] = 0  # -1: off, as vLLM spells it
    # hidden stop ids (the frontend adds the model's EOS ids) stop and are not shown; visible ones are
    # shown: the frontend decides what the client sees, the engine only has to stop on all of them
    ids: list[int] = []
    for k in ("stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible"):
        v = stop.get(k)
        if v is not None:
            if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
                raise RequestError(f"stop_conditions.{k} must be a list of token ids", f"stop_conditions.{k}")
            ids += [t for t in v if t not in ids]
    values.update(max_tokens=stop.get("max_tokens"), min_tokens=stop.get("min_tokens"),
                  ignore_eos=stop.get("ignore_eos"), stop_token_ids=ids or None,
                  logprobs=out.get("logprobs"))
    if values["ignore_eos"]:  # the frontend lists the EOS ids among the hidden stop ids: drop them too
        eos = set(request.get("eos_token_ids") or ())
        values["stop_token_ids"] = [t for t in ids if t not in eos] or None
    values["structured"] = guided_decoding(samp.get("guided_decoding"))
    names = {k: f"sampling_options.{k}" for k in _SAMPLING}
    names.update(max_tokens="stop_conditions.max_tokens", min_tokens="stop_conditions.min_tokens",
                 ignore_eos="stop_conditions.ignore_eos", stop_token_ids="stop_conditions.stop_token_ids",
                 logprobs="output_options.logprobs")
    return prompt, parser.sampling_params(values, len(prompt), names=names)


def request_cache_salt(request: Mapping[str, Any], key: SaltKey | None = None) -> str | None:
    """A PreprocessedRequest's one `cache_salt`, by the rule every front end applies
    (cache_salts.accept_salt), or None. Dynamo 1.6.1's frontend writes the salt a client sent
    (`nvext.cache_salt` if given, else the top-level `cache_salt`; an empty one is dropped) into
    both `routing.cache_salt` and `extra_args.nvext.cache_salt`; two different values there were
    not made by that frontend and are refused, not chosen between. With `key` (the worker's
    --cache-salt-key) only a salt the gateway signed is taken, and a request without one is
    refused. Raises RequestError naming the field."""
    routing = request.get("routing") or {}
    extra = request.get("extra_args") or {}
    nvext = extra.get("nvext") if isinstance(extra, Mapping) else None
    routed = routing.get("cache_salt") if isinstance(routing, Mapping) else None
    extra_salt = nvext.get("cache_salt") if isinstance(nvext, Mapping) else None
    return accept_salt((("routing.cache_salt", routed), ("extra_args.nvext.cache_salt", extra_salt)), key)


def router_cache_salt(salt: str | None) -> str | None:
    """The `cache_salt` a stored KV event names for blocks of prefix-cache salt `salt`: the
    client's own cache_salt, which Dynamo's router hashes the request with (module NOTE)."""
    if salt is None:
        return None
    try:
        tenant, cache_salt = split_salt(salt)
    except ValueError:
        return salt
    return cache_salt if tenant is None else salt


def chunk(ev: Event, decode: Callable[[int], str] | None = None) -> dict[str, Any]:
    """One engine event -> one Dynamo response chunk: the new token ids, their log-probabilities when
    asked for (`top_logprobs` entries need `decode`: token id -> text), and on the last event the
    finish reason. An event with an error is not a chunk: the caller raises it."""
    out: dict[str, Any] = {"token_ids": list(ev.new_token_ids)}
    if ev.logprobs is not None and len(ev.logprobs) == len(ev.new_token_ids):
        out["log_probs"] = [float(x) for x in ev.logprobs]
        if ev.top_logprobs is not None and decode is not None:
            out["top_logprobs"] = [[{"rank": r + 1, "token_id": int(t), "token": decode(int(t)),
                                     "logprob": float(lp)} for r, (t, lp) in enumerate(top)]
                                   for top in ev.top_logprobs]
    if ev.finished and ev.finish_reason != "error":
        out["finish_reason"] = FINISH_REASONS.get(ev.finish_reason or "stop", "stop")
    return out


def completion_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The usage the frontend passes to the client (OpenAI's `usage`, with the prefix-cache hit)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def external_hash(block_hash: BlockHash) -> int:
    """A prefix-cache key as the signed 64-bit block hash Dynamo's KV events carry."""
    return int.from_bytes(block_hash[:8], "little", signed=True)


def kv_event_batch(events: Sequence[BlockStored | BlockRemoved], block_size: int) -> tuple[list[dict], int]:
    """BlockPool events, in order -> (KvEventPublisher.publish_batch entries, events skipped).
    Consecutive stored blocks of one chain (each the parent of the next) become one stored entry,
    consecutive removals one removed entry; a stored entry names its blocks' `cache_salt`
    (router_cache_salt) when they are salted. A stored event without tokens (its caller gave the
    pool none) is skipped: the router cannot hash it."""
    out: list[dict] = []
    skipped = 0
    last: BlockHash | None = None  # key of the last block of the open stored entry
    for ev in events:
        if isinstance(ev, BlockStored):
            if ev.token_ids is None or len(ev.token_ids) != block_size:
                skipped += 1
                last = None
                continue
            cur = out[-1] if out else None
            salt = router_cache_salt(ev.salt)
            if (cur is not None and cur["type"] == "stored" and last is not None and ev.parent_hash == last
                    and cur.get("cache_salt") == salt):
                cur["token_ids"] += ev.token_ids
                cur["num_block_tokens"].append(block_size)
                cur["block_hashes"].append(external_hash(ev.block_hash))
            else:
                out.append({"type": "stored", "token_ids": list(ev.token_ids), "num_block_tokens": [block_size],
                            "block_hashes": [external_hash(ev.block_hash)],
                            "parent_hash": None if ev.parent_hash is None else external_hash(ev.parent_hash)})
                if salt is not None:
                    out[-1]["cache_salt"] = salt
            last = ev.block_hash
        else:
            last = None
            if out and out[-1]["type"] == "removed":
                out[-1]["block_hashes"].append(external_hash(ev.block_hash))
            else:
                out.append({"type": "removed", "block_hashes": [external_hash(ev.block_hash)]})
    return out, skipped
