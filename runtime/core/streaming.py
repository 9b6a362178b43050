"""Streaming eviction (`--kv-eviction streaming`): attention sinks + a recent window, so a
sequence runs past the context with a bounded KV cache (StreamingLLM, Xiao et al. 2023).

`StreamingWindow` is the window (checked by `streaming_window`); `StreamingEviction` is the
scheduler's eviction policy (runtime/core/policies.py) that applies it to every running sequence:

    KV cache of a sequence (block j = positions j*bs..):
      [ sink blocks | released (PAD_BLOCK_ID) ............ | recent blocks | next token ]
        first cdiv(kv_sink_tokens, bs) blocks              blocks holding the last kv_recent_tokens

    after every step: the blocks between the sinks and the recent window are released
                      (KVCacheManager.free_outside_window(keep_first=sink_blocks), the sliding
                      window's release)
    the runner sees:  the table without the released blocks (`compact`): attention index =
                      position for the sinks, position - gap after them (the graphs mask cached
                      keys by index in the table, never by position: exporter/attention.py)
    positions:        each token keeps the position it was computed at, and positions stay below
                      max_model_len (the graphs' RoPE tables end at the build's max_seq_len): when
                      a sequence's next token would reach max_model_len, a **context shift** drops the
                      tokens between the sinks and the last kv_recent_tokens from the sequence's KV token
                      list and recomputes the kept ones at positions 0.. (the sink blocks come back from
                      the prefix cache), like a preemption by recompute.

Why recompute instead of re-rotating kept keys (llama.cpp's context shift): it needs no RoPE
arithmetic outside the graphs, so it holds for every position scheme the graphs compute (default,
linear, llama3, yarn RoPE, learned positions, NoPE) and for every KV form (int8 codes are never
re-quantized) and backend. The cost: a prefill of sinks + window every
(max_model_len - sinks - window) tokens. docs/ARCHITECTURE.md "Streaming" has the semantics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvexport.errors import ConfigError
from kvexport.io import PAD_BLOCK_ID

from .kv_cache_interface import KVCacheManagerProtocol
from .outputs import ModelRunnerOutput
from .policies import EvictionPolicy
from .request import Request


@dataclass(frozen=True, slots=True)
class StreamingWindow:
    """What a streaming sequence keeps. Built by `streaming_window`, which checks it."""

    block_size: int  # tokens per KV block
    sink_blocks: int  # blocks kept at the start: cdiv(kv_sink_tokens, block_size)
    recent_tokens: int  # the next token attends to (at least) this many tokens before it

    @property
    def sink_tokens(self) -> int:
        """Tokens the sink blocks hold (kv_sink_tokens rounded up to whole blocks)."""
        return self.sink_blocks * self.block_size

    @property
    def release_window(self) -> int:
        """The window `free_outside_window` takes: the next token and the recent tokens."""
        return self.recent_tokens + 1

    @property
    def kept_after_shift(self) -> int:
        """KV tokens a sequence keeps at a context shift (the next token included)."""
        return self.sink_tokens + self.recent_tokens


def compact(table: Sequence[int], block_size: int) -> tuple[tuple[int, ...], int]:
    """A streaming sequence's block table without its released blocks, and the tokens they
    covered (the gap the runner subtracts from positions after the sinks: model_runner.pack).
    NOTE: the released blocks are one run between the sinks and the recent window (they are
    released front to back), so dropping them keeps every kept block in position order."""
    kept = tuple(b for b in table if b != PAD_BLOCK_ID)
    return kept, (len(table) - len(kept)) * block_size


@dataclass(slots=True)
class StreamState:
    """A streaming sequence's state (`Request.policy_state["eviction"]`)."""

    num_dropped: int = 0  # tokens after the sinks dropped from the KV token list by context shifts
    num_shifts: int = 0  # context shifts so far
    released: bool = False  # blocks were released since the last recompute: later blocks are not published


class StreamingEviction(EvictionPolicy):
    """Sinks + recent window (the module docstring). The KV token list of a sequence is
    token_ids[:sink_tokens] + token_ids[sink_tokens + num_dropped:]."""

    outlives_context = True

    def __init__(self, window: StreamingWindow):
        self.window = window

    def new_state(self) -> StreamState:
        return StreamState()

    def _dropped(self, req: Request) -> int:
        st = req.policy_state.get(self.key)
        return st.num_dropped if st is not None else 0

    def num_kv_tokens(self, req: Request) -> int:
        return len(req.token_ids) - self._dropped(req)

    def kv_token_ids(self, req: Request, start: int = 0, end: int | None = None) -> list[int]:
        d, k = self._dropped(req), self.window.sink_tokens
        end = len(req.token_ids) - d if end is None else end
        ids = req.token_ids
        if not d:
            return ids[start:end]
        return (ids[start:min(end, k)] if start < k else []) + (ids[max(start, k) + d:end + d] if end > k else [])

    def publish_tokens(self, req: Request) -> Sequence[int] | None:
        # NOTE: blocks computed once a release hid part of their prefix are not published (their KV
        # is not the prefix's): only the blocks before the first release since the last recompute are
        st = req.policy_state.get(self.key)
        if st is None:
            return req.token_ids
        if st.released:
            return None
        return self.kv_token_ids(req) if st.num_dropped else req.token_ids

    def view(self, req: Request, table: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        return compact(table, self.window.block_size)

    def after_step(self, req: Request, kv: KVCacheManagerProtocol[Any], result: ModelRunnerOutput) -> None:
        w = self.window
        if kv.free_outside_window(req.request_id, req.num_computed_tokens, w.release_window, keep_first=w.sink_blocks):
            self.state(req).released = True  # later tokens no longer see their whole prefix

    def shift_context(self, req: Request, max_model_len: int) -> bool:
        """A context shift when the next token's position would reach max_model_len: drop the
        middle of the KV token list; the kept tokens are recomputed at positions 0.."""
        if self.num_kv_tokens(req) <= max_model_len:
            return False
        st = self.state(req)
        self._drop_middle(req, st)
        st.num_shifts += 1
        st.released = False
        return True

    def on_preempt(self, req: Request, keep_tokens: bool) -> None:
        if not keep_tokens:  # NOTE: recomputed anyway: only the kept tokens (as a context shift)
            st = self.state(req)
            self._drop_middle(req, st)
            st.released = False

    def _drop_middle(self, req: Request, st: StreamState) -> None:
        """Keep the sinks and the last recent_tokens (+ the next token) of the KV token list."""
        n, w = self.num_kv_tokens(req), self.window
        if n - w.kept_after_shift > 0 and n > w.sink_tokens:
            st.num_dropped += n - w.kept_after_shift


def streaming_window(*, sink_tokens: int, recent_tokens: int | None, block_size: int, max_model_len: int,
                     pool_tokens: int, max_num_batched_tokens: int) -> StreamingWindow:
    """The window for `--kv-sink-tokens`/`--kv-recent-tokens` on a pool of `pool_tokens` tokens and a
    context (positions) of `max_model_len`. recent_tokens None: half of max_model_len. Raises
    ConfigError naming the option when a window is smaller than a block, leaves no room for a token
    between context shifts, or does not fit the pool with one step's tokens."""
    sink_blocks = -(-sink_tokens // block_size)
    recent = max_model_len // 2 if recent_tokens is None else recent_tokens
    w = StreamingWindow(block_size, sink_blocks, recent)
    if recent < block_size:
        raise ConfigError(f"--kv-recent-tokens {recent} is smaller than one KV block ({block_size} tokens): the "
                          f"recent window is kept and released in whole blocks; give at least {block_size}")
    if max_model_len < 2 * block_size:
        raise ConfigError(f"--kv-eviction streaming needs max_model_len >= two KV blocks ({2 * block_size} tokens: a "
                          f"recent window of one block and the next block), got {max_model_len}: raise "
                          f"--max-model-len or serve it with --kv-eviction none")
    if w.sink_tokens + 2 * block_size > max_model_len:  # NOTE: no recent window fits: the sinks are at fault
        fit = (max_model_len - recent - block_size) // block_size * block_size  # the most sinks the window allows
        fix = (f"lower --kv-sink-tokens to <= {fit}" if fit >= 0 else
               f"lower --kv-sink-tokens to <= {max_model_len - 2 * block_size} and --kv-recent-tokens to <= "
               f"{block_size}, or --kv-sink-tokens to 0 and --kv-recent-tokens to <= {max_model_len - block_size}")
        raise ConfigError(
            f"--kv-eviction streaming: --kv-sink-tokens {sink_tokens} ({w.sink_tokens} tokens in whole blocks of "
            f"{block_size}) leaves no room in max_model_len {max_model_len} for --kv-recent-tokens {recent} and "
            f"the next block: {fix}")
    if w.kept_after_shift + block_size > max_model_len:
        raise ConfigError(
            f"--kv-eviction streaming: sinks ({w.sink_tokens} tokens: --kv-sink-tokens {sink_tokens} in whole "
            f"blocks of {block_size}) + --kv-recent-tokens {recent} + one block must fit max_model_len "
            f"{max_model_len} (positions stay below it; a context shift recomputes the kept tokens): lower "
            f"--kv-recent-tokens to <= {max_model_len - w.sink_tokens - block_size}")
    need = w.kept_after_shift + 2 * block_size + max_num_batched_tokens
    if need > pool_tokens:
        raise ConfigError(
            f"--kv-recent-tokens {recent}: a streaming sequence holds up to {need} tokens of KV (sinks "
            f"{w.sink_tokens} + recent {recent} + one step's max_num_batched_tokens {max_num_batched_tokens} + 2 "
            f"blocks), larger than the KV pool ({pool_tokens} tokens): lower --kv-recent-tokens or "
            f"--max-num-batched-tokens, or raise --kv-cache-memory")
    return w


def check_model(*, windows: Sequence[int | None], ropes: Sequence[dict], max_model_len: int) -> None:
    """Refuse `--kv-eviction streaming` on builds whose attention the scheme cannot keep exact:
    sliding-window layers (the graphs mask their window by index in the block table, which streaming
    compacts), unless the window covers max_model_len; longrope past its original context (the graphs
    pick its factor set by the sequence's KV length, which streaming keeps short while positions grow).
    `ropes`: the manifest's RoPE specs (model.rope, model.rope_local)."""
    short = [w for w in windows if w is not None and w < max_model_len]
    if short:
        raise ConfigError(
            f"--kv-eviction streaming: this build's layers attend through a sliding window of {min(short)} tokens, "
            f"shorter than max_model_len {max_model_len}; streaming compacts block tables, which such a window "
            f"cannot be masked over: serve it with --kv-eviction none (its window already bounds those layers' "
            f"KV), or with --max-model-len <= {min(short)}")
    for rope in ropes:
        omax = rope.get("original_max_positions")
        if rope.get("rope_type") == "longrope" and omax is not None and max_model_len > omax:
            raise ConfigError(
                f"--kv-eviction streaming: longrope switches to its long factors past {omax} tokens (by the "
                f"sequence's KV length, which streaming keeps short while positions grow), so positions past it "
                f"would be rotated with the short factors: use --max-model-len <= {omax} with streaming")


__all__ = ["StreamState", "StreamingEviction", "StreamingWindow", "check_model", "compact", "streaming_window"]
