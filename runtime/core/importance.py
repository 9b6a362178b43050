"""Importance eviction (`--kv-eviction snapkv | h2o`): a sequence keeps the KV blocks its attention
uses most, within a per-sequence budget (`--kv-budget-tokens`, `--kv-budget-fraction` of the prompt).

The scores come from the attention op itself (kvexport/io.py OBSERVATION_LENS / attention_scores,
plugins/paged_attention/spec.py "Attention scores"): the scheduler asks a step for the attention of
a chunk's last tokens (`observation_len`), the runner returns it summed over layers
(execution/attention_scores.py), and `after_step` releases the lowest-scored blocks:

    prompt completes (its last chunk, chunked prefill or not) ─ observation = its last w tokens
      scores [kv_heads, kept tokens] ─ per head: normalised ─ per block: max over its tokens,
      summed over KV heads
      ─ release the lowest-scored blocks until the kept tokens fit the budget
    every decode step (h2o only): observation = the new token; its block scores are added to the
      blocks' running sums (H2O's accumulated attention); one block is released whenever the kept
      tokens pass the budget, so a long generation stays within it

    never released: the first cdiv(kv_sink_tokens, block_size) blocks (attention sinks), the blocks
    holding the last kv_recent_tokens tokens (and the one being written), and partial blocks

Granularity: whole blocks, released as the sliding window releases them (PAD_BLOCK_ID in the table),
and the runner gets the table without them (`streaming.compact`): the graphs mask cached keys by
index in the table, so a kept block's keys keep their RoPE positions and nothing is copied or
re-rotated. NOTE (why blocks, not tokens compacted into fewer blocks): compaction would copy every
kept token's K/V of every layer (a pool-wide gather per eviction), break the prefix cache's
block = hash-chain identity and need a per-token position map in the graphs; whole blocks cost
nothing to drop and, with block_size 16, lose little precision (docs/BENCHMARKS.md "Importance
eviction" has the accuracy measured at these granularities). One table per sequence means one
choice for every layer and KV head: scores are pooled over layers (the runner) and heads (here).

Prefix caching: the prompt's full blocks are published before anything is released (they hold
exactly what their hash chain says, so they stay valid entries for other requests); a sequence that
released blocks publishes nothing after (its later KV was computed without them), and a block other
sequences share is never changed, only this sequence's reference to it dropped (the pool frees it
when nobody holds it, and tiers / KV events see it evicted as usual). A sequence that will be scored
looks the prefix cache up only to its prompt's last w tokens (`prefix_lookup`): a prompt the cache holds
whole still computes, and is observed by, its whole window, not the one token after the hit.
Preemption: the sequence is recomputed whole and scored again when its prompt completes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvexport.errors import ConfigError
from kvexport.io import PAD_BLOCK_ID

from .kv_cache_interface import KVCacheManagerProtocol
from .outputs import ModelRunnerOutput
from .policies import EvictionPolicy
from .request import Request
from .streaming import compact

IMPORTANCE_EVICTIONS = ("snapkv", "h2o")  # --kv-eviction values this module serves


@dataclass(frozen=True, slots=True)
class ImportanceBudget:
    """What an importance-evicting sequence keeps. Built by `importance_budget`, which checks it."""

    block_size: int  # tokens per KV block
    budget_tokens: int | None  # KV tokens a sequence keeps, at most (None: only the fraction)
    budget_fraction: float | None  # or this share of its prompt (None: only budget_tokens)
    sink_blocks: int  # blocks kept at the start: cdiv(kv_sink_tokens, block_size)
    recent_tokens: int  # the last tokens kept (their blocks); >= observation_tokens
    observation_tokens: int  # w: the prompt's last tokens whose attention scores it
    decode: bool  # h2o: also evict while decoding, to stay within the budget
    pool_kernel: int = 1  # token scores max-pooled over this many neighbours (odd) before the block max; 1: none

    @property
    def min_tokens(self) -> int:
        """The smallest budget that leaves room to evict: sinks + recent window + one block."""
        return self.sink_blocks * self.block_size + self.recent_tokens + self.block_size

    def budget(self, num_prompt_tokens: int, request_budget: int | None = None) -> int:
        """A sequence's budget in tokens: the smallest of budget_tokens, the fraction of its prompt and
        the request's own, never below `min_tokens`."""
        limits = [b for b in (self.budget_tokens, request_budget) if b is not None]
        if self.budget_fraction is not None:
            limits.append(math.ceil(self.budget_fraction * num_prompt_tokens))
        return max(min(limits), self.min_tokens) if limits else 1 << 62


@dataclass(slots=True)
class ImportanceState:
    """An importance-evicting sequence's state (`Request.policy_state["eviction"]`)."""

    scored: bool = False  # its prompt was scored (and evicted) in this computation
    released_blocks: int = 0  # blocks released since the last recompute
    block_scores: dict[int, float] = field(default_factory=dict)  # h2o: physical block -> accumulated score


def block_scores(scores: np.ndarray, block_size: int, pool_kernel: int = 1) -> np.ndarray:
    """Per-token attention [kv_heads, n] -> one score per block of the table the scores index
    ([cdiv(n, block_size)]): per head normalised to sum 1, (pool_kernel > 1: each token's score the max over
    the pool_kernel tokens centred on it, SnapKV's pooling,) per block the max over its tokens, summed
    over heads.
    NOTE (no SnapKV max-pool over neighbouring tokens): SnapKV pools so that a kept token keeps its
    neighbours; a kept block already keeps its block_size neighbours, and pooling across block edges
    only made a hot block's neighbours look hot (they then crowd out other facts under a tight budget).
    Max, not sum, over a block's tokens: one needle token in a block of filler must keep the block."""
    s = np.asarray(scores, np.float64)
    s = s / np.maximum(s.sum(-1, keepdims=True), 1e-30)
    h, n = s.shape
    if pool_kernel > 1:
        r = pool_kernel // 2
        padded = np.pad(s, ((0, 0), (r, r)))
        s = np.max(np.stack([padded[:, i:i + n] for i in range(2 * r + 1)]), axis=0)
    nb = -(-n // block_size)
    blocks = np.pad(s, ((0, 0), (0, nb * block_size - n))).reshape(h, nb, block_size).max(-1)  # [kvH, nb]
    return blocks.sum(0)


def choose_blocks(scores: Sequence[float], candidates: Sequence[int], num_drop: int) -> list[int]:
    """The `num_drop` candidates (table indices) with the lowest scores (scores[i] is index i's);
    ties: the earlier block goes first. Sorted."""
    ranked = sorted(candidates, key=lambda i: (scores[i], i))
    return sorted(ranked[:max(0, num_drop)])


class ImportanceEviction(EvictionPolicy):
    """SnapKV-style prompt eviction, and with `decode` H2O-style decode eviction (the module docstring)."""

    def __init__(self, budget: ImportanceBudget):
        self.b = budget

    def new_state(self) -> ImportanceState:
        return ImportanceState()

    def budget_of(self, req: Request) -> int:
        return self.b.budget(req.num_prompt_tokens, getattr(req.params, "kv_budget_tokens", None))

    def _kept_after(self, req: Request, end: int) -> int:
        st = req.policy_state.get(self.key)
        return end - (st.released_blocks * self.b.block_size if st is not None else 0)

    def observation_len(self, req: Request, start: int, n: int) -> int:
        st = self.state(req)
        end = start + n
        if end < req.num_prompt_tokens or n < 1:
            return 0  # mid-prompt: scores wait for the chunk that completes it
        if st.scored:
            return 1 if self.b.decode else 0
        if self._kept_after(req, end) <= self.budget_of(req) and not self.b.decode:
            return 0  # fits: nothing to evict
        return min(self.b.observation_tokens, n)

    def prefix_lookup(self, req: Request) -> list[int]:
        """A sequence that will be scored computes its prompt's last w tokens whatever the prefix cache
        holds: its hit stops short of them (get_computed_blocks leaves one token more than it covers), so
        the chunk that completes the prompt holds the whole observation window, not the 1 token after a
        cached prefix."""
        tokens = self.kv_token_ids(req)
        if not self.b.decode and req.num_prompt_tokens <= self.budget_of(req):
            return tokens  # fits its budget: never scored
        return tokens[:max(req.num_prompt_tokens - self.b.observation_tokens + 1, 0)]

    def view(self, req: Request, table: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        return compact(table, self.b.block_size)

    def publish_tokens(self, req: Request) -> Sequence[int] | None:
        st = req.policy_state.get(self.key)
        return None if st is not None and st.released_blocks else req.token_ids

    def on_preempt(self, req: Request, keep_tokens: bool) -> None:
        req.policy_state[self.key] = self.new_state()  # recomputed whole, scored again

    def after_step(self, req: Request, kv: KVCacheManagerProtocol[Any], result: ModelRunnerOutput) -> None:
        if req.num_computed_tokens < req.num_prompt_tokens:
            return
        st = self.state(req)
        first = not st.scored
        st.scored = True
        scores = result.attention_scores.get(req.request_id)
        if scores is None:
            return
        bs, computed = self.b.block_size, req.num_computed_tokens
        table = kv.block_table(req.request_id)
        kept = [i for i, b in enumerate(table) if b != PAD_BLOCK_ID]  # table index of each compacted block
        per_block = block_scores(scores, bs, self.b.pool_kernel)  # by compacted block
        by_index = dict(zip(kept, per_block))
        if self.b.decode:  # H2O: accumulated attention per physical block
            for i, s in by_index.items():
                st.block_scores[table[i]] = (0.0 if first else st.block_scores.get(table[i], 0.0)) + float(s)
            by_index = {i: st.block_scores[table[i]] for i in kept}
        kept_tokens = computed - (len(table) - len(kept)) * bs
        over = kept_tokens - self.budget_of(req)
        if over <= 0:
            return
        last_free = (computed - self.b.recent_tokens) // bs  # blocks before this index lie outside the recent window
        candidates = [i for i in kept if self.b.sink_blocks <= i < last_free]
        drop = choose_blocks(by_index, candidates, -(-over // bs))
        if drop:
            kv.release_blocks(req.request_id, drop)
            st.released_blocks += len(drop)
            for i in drop:
                st.block_scores.pop(table[i], None)


def importance_budget(*, policy: str, budget_tokens: int | None, budget_fraction: float | None, sink_tokens: int,
                      recent_tokens: int | None, observation_tokens: int, block_size: int,
                      max_model_len: int) -> ImportanceBudget:
    """The budget for `--kv-eviction snapkv|h2o`. Raises ConfigError naming the setting when no budget
    is given, a budget is smaller than sinks + recent window + one block or larger than the context,
    or the window settings are out of range."""
    if policy not in IMPORTANCE_EVICTIONS:
        raise ConfigError(f"--kv-eviction {policy!r} is not an importance policy ({', '.join(IMPORTANCE_EVICTIONS)})")
    if budget_tokens is None and budget_fraction is None:
        raise ConfigError(f"--kv-eviction {policy} needs a per-sequence budget: --kv-budget-tokens N and/or "
                          f"--kv-budget-fraction F (of the prompt, e.g. 0.25)")
    if observation_tokens < 1:
        raise ConfigError(f"--kv-observation-tokens {observation_tokens} must be >= 1")
    recent = observation_tokens if recent_tokens is None else recent_tokens
    if recent < observation_tokens:
        raise ConfigError(f"--kv-recent-tokens {recent} is smaller than --kv-observation-tokens {observation_tokens}: "
                          f"the observation window is always kept; raise --kv-recent-tokens")
    b = ImportanceBudget(block_size, budget_tokens, budget_fraction, -(-sink_tokens // block_size), recent,
                         observation_tokens, policy == "h2o")
    if budget_tokens is not None:
        if budget_tokens < b.min_tokens:
            raise ConfigError(
                f"--kv-budget-tokens {budget_tokens} is smaller than the sinks ({b.sink_blocks * block_size} tokens: "
                f"--kv-sink-tokens {sink_tokens} in whole blocks of {block_size}) + --kv-recent-tokens {recent} + one "
                f"block: give at least {b.min_tokens}, or lower --kv-sink-tokens / --kv-recent-tokens")
        if budget_tokens > max_model_len:
            raise ConfigError(f"--kv-budget-tokens {budget_tokens} is larger than the context (max_model_len "
                              f"{max_model_len}): nothing would ever be evicted; give at most {max_model_len}")
    if budget_fraction is not None and not 0 < budget_fraction < 1:
        raise ConfigError(f"--kv-budget-fraction {budget_fraction} must be in (0, 1): the share of a prompt's KV kept")
    return b


def check_request_budget(value, budget: ImportanceBudget | None, max_model_len: int) -> None:
    """A request's own kv_budget_tokens: only with importance eviction, an integer in
    [budget.min_tokens, max_model_len]. Raises RequestError naming the field."""
    from ..request_checks import RequestError

    if value is None:
        return
    if budget is None:
        raise RequestError("kv_budget_tokens: this engine runs without importance eviction; start it with "
                           "--kv-eviction snapkv (or h2o) and a budget, or leave kv_budget_tokens unset",
                           "kv_budget_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or not budget.min_tokens <= value <= max_model_len:
        raise RequestError(f"kv_budget_tokens must be an integer in [{budget.min_tokens}, {max_model_len}] (sinks + "
                           f"recent window + one block, up to the context), got {value!r}", "kv_budget_tokens")


def check_build(*, scores: bool, hybrid: bool, windows: Sequence[int | None], max_model_len: int, build_dir,
                policy: str) -> None:
    """Refuse importance eviction on builds that cannot serve it: graphs without attention scores
    (built before them, or a form that does not return them), a windowed-layer KV cache group, or
    sliding-window layers shorter than the context (their window is masked by table index)."""
    if not scores:
        raise ConfigError(
            f"--kv-eviction {policy}: {build_dir} does not return attention scores (built before importance "
            f"eviction, or with --backend tensorrt, or an MLA model with --attention onnx, which do not score): "
            f"rebuild it with `kvexport build MODEL --attention plugin --force`")
    if hybrid:
        raise ConfigError(f"--kv-eviction {policy}: {build_dir} has a windowed-layer KV cache group; importance "
                          f"eviction keeps one block table per sequence: serve it with --kv-eviction none")
    short = [w for w in windows if w is not None and w < max_model_len]
    if short:
        raise ConfigError(f"--kv-eviction {policy}: this build's layers attend through a sliding window of "
                          f"{min(short)} tokens, which a compacted block table cannot mask: serve it with "
                          f"--kv-eviction none or --max-model-len <= {min(short)}")


def importance_policy(build_dir, manifest, config, max_model_len: int) -> ImportanceEviction | None:
    """The engine's importance eviction for `config` (EngineConfig) on this build, or None when
    config.kv_eviction is not an importance policy. Refuses what it cannot serve (`check_build`,
    `importance_budget`), with the setting named."""
    if config.kv_eviction not in IMPORTANCE_EVICTIONS:
        return None
    kv = manifest.kv
    check_build(scores=bool(kv.attention_scores), hybrid=manifest.layer_groups is not None,
                windows=manifest.model.layer_windows, max_model_len=max_model_len, build_dir=build_dir,
                policy=config.kv_eviction)
    return ImportanceEviction(importance_budget(
        policy=config.kv_eviction, budget_tokens=config.kv_budget_tokens, budget_fraction=config.kv_budget_fraction,
        sink_tokens=config.kv_sink_tokens, recent_tokens=config.kv_recent_tokens,
        observation_tokens=config.kv_observation_tokens, block_size=kv.block_size, max_model_len=max_model_len))


__all__ = ["IMPORTANCE_EVICTIONS", "ImportanceBudget", "ImportanceEviction", "ImportanceState", "block_scores",
           "check_build", "check_request_budget", "choose_blocks", "importance_budget", "importance_policy"]
