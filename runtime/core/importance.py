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

Speculative decoding: snapkv scores only the chunk that completes a prompt, which never carries drafts
(drafts ride only on a step of one token, the sequence's last, once it has an output: that token lies
past the prompt, so a recomputed sequence's scoring chunk is never such a step), so its greedy text is
the same with and without speculation. h2o is refused with it (runtime/config.py EngineConfig): a
plain decode scores each token's own row and may release a block before the next one attends, while a
speculative step computes the token and its drafts against one table and the op returns its observed
rows' attention summed (plugins/paged_attention/spec.py "Attention scores"): a rejected draft's row
cannot be left out nor the per-row block maxima recovered. NOTE (what would make it exact, not done):
per-row scores from the op ([num_seqs, rows, kv_heads, score_len]), each accepted row accumulated in
order, and drafts cut so that no step crosses a release (a block released between two of its rows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from kvexport.errors import ConfigError
from kvexport.io import PAD_BLOCK_ID

from .kv_cache_interface import KVCacheManagerProtocol
from .outputs import ModelRunnerOutput
from .policies import EvictionPolicy
from .request import Request
from .streaming import compact

IMPORTANCE_EVICTIONS = ("snapkv", "h2o")  # --kv-eviction values this module serves
Fix = tuple[tuple[str, str, int], ...]  # a refusal's suggested settings: (option, "<=" or ">=", bound), ...


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
    is given, a budget is larger than the context, the window settings are out of range, or the sinks +
    recent window + one block do not fit the context or the budget (`_fit_refusal`: it names the option
    at fault first, each with a bound that is accepted)."""
    if policy not in IMPORTANCE_EVICTIONS:
        raise ConfigError(f"--kv-eviction {policy!r} is not an importance policy ({', '.join(IMPORTANCE_EVICTIONS)})")
    if budget_tokens is None and budget_fraction is None:
        raise ConfigError(f"--kv-eviction {policy} needs a per-sequence budget: --kv-budget-tokens N and/or "
                          f"--kv-budget-fraction F (of the prompt, e.g. 0.25)")
    if observation_tokens < 1:
        raise ConfigError(f"--kv-observation-tokens {observation_tokens} must be >= 1")
    if budget_fraction is not None and not 0 < budget_fraction < 1:
        raise ConfigError(f"--kv-budget-fraction {budget_fraction} must be in (0, 1): the share of a prompt's KV kept")
    settings = _Window(sink_tokens, recent_tokens, observation_tokens, budget_tokens)
    if not settings.fits(block_size, max_model_len):
        raise ConfigError(_fit_refusal(settings, block_size, max_model_len))
    recent = observation_tokens if recent_tokens is None else recent_tokens
    return ImportanceBudget(block_size, budget_tokens, budget_fraction, -(-sink_tokens // block_size), recent,
                            observation_tokens, policy == "h2o")


@dataclass(frozen=True, slots=True)
class _Window:
    """The settings `importance_budget` checks against each other: what a sequence always keeps."""

    sink_tokens: int  # --kv-sink-tokens
    recent_tokens: int | None  # --kv-recent-tokens; None: the observation window
    observation_tokens: int  # --kv-observation-tokens
    budget_tokens: int | None  # --kv-budget-tokens; None: only a fraction (bounded by the context)

    OPTIONS: ClassVar[dict[str, str]] = {  # option -> field
        "--kv-sink-tokens": "sink_tokens", "--kv-recent-tokens": "recent_tokens",
        "--kv-observation-tokens": "observation_tokens", "--kv-budget-tokens": "budget_tokens"}

    @property
    def recent(self) -> int:
        return self.observation_tokens if self.recent_tokens is None else self.recent_tokens

    def sinks(self, bs: int) -> int:
        return -(-self.sink_tokens // bs) * bs

    def need(self, bs: int) -> int:
        """The smallest budget that leaves room to evict (ImportanceBudget.min_tokens)."""
        return self.sinks(bs) + self.recent + bs

    def fits(self, bs: int, max_model_len: int) -> bool:
        cap = max_model_len if self.budget_tokens is None else self.budget_tokens
        return (self.observation_tokens >= 1 and self.recent >= self.observation_tokens and self.sink_tokens >= 0
                and cap <= max_model_len and self.need(bs) <= cap)

    def applied(self, fix: Fix) -> "_Window":
        return replace(self, **{self.OPTIONS[option]: value for option, _, value in fix})


def _fit_refusal(w: _Window, bs: int, max_model_len: int) -> str:
    """The message for settings `_Window.fits` refuses: a budget larger than the context, a recent
    window shorter than the observation window, or sinks + recent window + one block that do not fit
    the context or the budget. It leads with the option at fault — the budget, the one that alone does
    not fit the context, else the budget that is too small, else sinks and window together — and names
    fixes: one option's bound each, or where none suffices alone, bounds for those at fault together;
    each kept only where the settings with it applied are accepted, so no suggestion is refused in turn."""
    M, obs, recent, sinks = max_model_len, w.observation_tokens, w.recent, w.sinks(bs)
    window = "--kv-observation-tokens" if w.recent_tokens is None else "--kv-recent-tokens"
    cap = M if w.budget_tokens is None else min(w.budget_tokens, M)
    kept = (f"the sinks ({sinks} tokens: --kv-sink-tokens {w.sink_tokens} in whole blocks of {bs}) + {window} "
            f"{recent} + one block to evict ({w.need(bs)} tokens)")
    sink_fix: Fix = (("--kv-sink-tokens", "<=", (cap - bs - recent) // bs * bs),)  # the most sinks beside the window
    room = cap - bs - sinks  # the most recent tokens the cap leaves beside the sinks and one block
    single: list[Fix]
    if w.budget_tokens is not None and w.budget_tokens > M:
        lead = (f"--kv-budget-tokens {w.budget_tokens} is larger than the context (max_model_len {M}): nothing "
                f"would ever be evicted")
        single = [(("--kv-budget-tokens", "<=", M),)]
    elif w.recent_tokens is not None and recent < obs and obs + bs <= M:
        lead = (f"--kv-recent-tokens {recent} is smaller than --kv-observation-tokens {obs}: the observation window "
                f"is always kept")
        single = [(("--kv-recent-tokens", ">=", obs),), (("--kv-observation-tokens", "<=", recent),)]
    elif max(obs, recent) + bs > M:  # the window alone does not fit the context: the option given is at fault
        big = "--kv-observation-tokens" if obs > recent else window
        what = "the recent window" if big == "--kv-recent-tokens" else "the observation window"
        lead = (f"{big} {max(obs, recent)} ({what}, always kept) + one block to evict is more than the context "
                f"(max_model_len {M})")
        single = [((big, "<=", room if big == window else min(room, recent)),)]
    elif sinks + bs + 1 > M:  # the sinks alone leave no room for any window
        lead = (f"--kv-sink-tokens {w.sink_tokens} ({sinks} tokens in whole blocks of {bs}) + one block to evict "
                f"leaves no room in the context (max_model_len {M}) for {window} {recent}")
        single = [sink_fix]
    elif w.budget_tokens is not None and w.need(bs) <= M:
        lead = f"--kv-budget-tokens {w.budget_tokens} is smaller than {kept}"
        single = [(("--kv-budget-tokens", ">=", w.need(bs)),), sink_fix, ((window, "<=", room),)]
    else:
        lead = f"{kept} are more than the context (max_model_len {M})"
        single = [sink_fix, ((window, "<=", room),)]
    fixes = [f for f in single if w.applied(f).fits(bs, M)]
    if not fixes:  # several settings at fault: bounds for them together
        fixes = [f for f in (_together(w, bs, M, cap), _together(w, bs, M, M)) if f and w.applied(f).fits(bs, M)][:1]
    if not fixes:  # nothing fits beside one block: the context itself is too small
        return (f"{lead}: importance eviction keeps at least one recent token and one block of {bs} to evict; raise "
                f"--max-model-len above {bs}, or serve it with --kv-eviction none")
    if cap < M and not lead.startswith("--kv-budget-tokens") and not any(o == "--kv-budget-tokens"
                                                                          for f in fixes for o, _, _ in f):
        lead += f" (the bounds below keep it within --kv-budget-tokens {cap})"
    return f"{lead}: {', or '.join(_say(f) for f in fixes)}"


def _say(fix: Fix) -> str:
    """("--kv-sink-tokens", "<=", 16), ... -> "lower --kv-sink-tokens to <= 16 and ..." (a verb where it changes)."""
    words, verb = [], None
    for opt, op, v in fix:
        now = "lower" if op == "<=" else "raise"
        words.append(f"{now + ' ' if now != verb else ''}{opt} to {op} {v}")
        verb = now
    return " and ".join(words)


def _together(w: _Window, bs: int, max_model_len: int, cap: int) -> Fix:
    """Bounds for every setting at fault at once, within `cap` tokens (the budget, or the context and
    the budget raised to what is kept): the sinks get at most half of what one block to evict leaves,
    the recent window the rest; only the settings that change are named."""
    room = cap - bs  # sinks + recent window
    if room < 1:
        return ()
    sinks = min(w.sinks(bs), room // 2 // bs * bs)
    recent = min(w.recent, room - sinks)
    obs = min(w.observation_tokens, recent)
    fix: list[tuple[str, str, int]] = []
    if sinks < w.sinks(bs):
        fix.append(("--kv-sink-tokens", "<=", sinks))
    if obs < w.observation_tokens:
        fix.append(("--kv-observation-tokens", "<=", obs))
    if w.recent_tokens is not None and recent < w.recent_tokens:
        fix.append(("--kv-recent-tokens", "<=", recent))
    if w.budget_tokens is not None and w.budget_tokens > max_model_len:
        fix.append(("--kv-budget-tokens", "<=", max_model_len))
    elif w.budget_tokens is not None and w.budget_tokens < sinks + recent + bs:
        fix.append(("--kv-budget-tokens", ">=", sinks + recent + bs))
    return tuple(fix)


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


def check_build(*, scores: bool, windowed_group: bool, windows: Sequence[int | None], max_model_len: int, build_dir,
                policy: str) -> None:
    """Refuse importance eviction on builds that cannot serve it: graphs without attention scores
    (built before them, or a form that does not return them), a windowed-layer KV cache group, or
    sliding-window layers shorter than the context (their window is masked by table index)."""
    if not scores:
        raise ConfigError(
            f"--kv-eviction {policy}: {build_dir} does not return attention scores (built before importance "
            f"eviction, or with --backend tensorrt, or an MLA model with --attention onnx, which do not score): "
            f"rebuild it with `kvexport build MODEL --attention plugin --force`")
    if windowed_group:
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
    check_build(scores=bool(kv.attention_scores), windowed_group=manifest.layer_groups is not None,
                windows=manifest.model.layer_windows, max_model_len=max_model_len, build_dir=build_dir,
                policy=config.kv_eviction)
    return ImportanceEviction(importance_budget(
        policy=config.kv_eviction, budget_tokens=config.kv_budget_tokens, budget_fraction=config.kv_budget_fraction,
        sink_tokens=config.kv_sink_tokens, recent_tokens=config.kv_recent_tokens,
        observation_tokens=config.kv_observation_tokens, block_size=kv.block_size, max_model_len=max_model_len))


__all__ = ["IMPORTANCE_EVICTIONS", "ImportanceBudget", "ImportanceEviction", "ImportanceState", "block_scores",
           "check_build", "check_request_budget", "choose_blocks", "importance_budget", "importance_policy"]
