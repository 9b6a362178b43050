"""The model runner: one step's `SchedulerOutput` in, sampled tokens (and prompt scores) out.

    SchedulerOutput ──pack()──▶ ModelInput ──Backend.execute()──▶ logits ──sample()──▶ ModelRunnerOutput
                                                          (speculation: then the Drafter's drafts, proposers.py)

This module owns the one packing function (`pack`: scheduled chunks -> the paged graphs'
inputs), the split of a step into backend calls, sampling, scoring prompt tokens
(prompt_logprobs.py: from every token's logits, on --all-logits builds), and the isolation
of a failing request. Everything that drives paged graphs — the engine, build validation
(exporter/validate.py), the polygraphy samples (exporter/samples.py), the bench scripts —
packs through `pack()`. It imports no torch.

NOTE: the runner never mutates scheduler state; it reads the `ScheduledRequest`s and
draws from each request's `SamplerState` (the RNG and penalty counts it owns for sampling).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from kvexport import io

from ..core.outputs import ModelRunnerOutput, SampledToken, ScheduledRequest, SchedulerOutput
from ..core.state_pool import StateStep
from .attention_scores import take_scores
from .kv_offload import KVOffload
from .model_input import Backend, ModelInput
from .state_store import restore_checkpoints, save_checkpoints
from .prompt_logprobs import score
from .proposers import Drafter
from .sampling import mask_grammars, plain_greedy, sample, sample_greedy
from .spec_sampling import verify_drafts

log = logging.getLogger(__name__)

QUERY_PAD_SLACK = 1.25  # `onnx` attention: a call's padded size stays within 25% of its real size


def chunk(request_id: str, token_ids: Sequence[int], start_pos: int, block_table: Sequence[int], block_size: int,
          samples: bool = True) -> ScheduledRequest:
    """A ScheduledRequest for callers without a scheduler (validation, benches): the tokens
    at positions start_pos.. of a sequence whose KV lives in `block_table`."""
    slots = tuple(block_table[p // block_size] * block_size + p % block_size
                  for p in range(start_pos, start_pos + len(token_ids)))
    return ScheduledRequest(request_id, tuple(token_ids), start_pos, tuple(block_table), slots, samples)


def pack(chunks: Sequence[ScheduledRequest], block_size: int, full_tables: bool,
         groups: Sequence[str] = ()) -> ModelInput:
    """Scheduled chunks -> the graphs' packed inputs. Block tables become a padded int64
    tensor only here, padded with io.PAD_BLOCK_ID. `groups`: the other KV cache groups the
    graphs take (kvexport/io.py); each gets its tables and slots from the chunk's
    `group_blocks`, or, for a chunk without them (validation, samples: callers that keep one
    table per sequence), the chunk's own, which the group's pools must then be large enough for.

    NOTE: the `onnx` attention reads from the pool only the KV of tokens computed in earlier
    steps (this step's keys come from the step itself), so its tables are cut to the blocks
    holding those: a fresh prompt passes a table of width 0 and attends to nothing stale.
    The `plugin` attention stores this step's KV first and reads it back (`full_tables`):
    its tables cover every block up to seq_lens.

    NOTE: streaming eviction (`kv_gap`): the table leaves out released blocks, so seq_lens and the
    table's extent count kept tokens (start_pos - kv_gap + ...) while positions stay the tokens' own;
    the graphs mask cached keys by their index in the table, never by position."""
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    end = ((lambda s: s.start_pos - s.kv_gap + len(s.token_ids)) if full_tables
           else (lambda s: s.start_pos - s.kv_gap))
    width = max(-(-end(s) // block_size) for s in chunks)
    tables = np.full((len(chunks), width), io.PAD_BLOCK_ID, np.int64)  # [S, max_blocks]
    for r, s in enumerate(chunks):
        ids.extend(s.token_ids)
        pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        slots.extend(s.slot_mapping)
        qsl.append(qsl[-1] + len(s.token_ids))
        lens.append(s.start_pos - s.kv_gap + len(s.token_ids))
        used = -(-end(s) // block_size)
        assert len(s.block_table) >= used, "a block table must cover the blocks the step reads"
        tables[r, :used] = s.block_table[:used]
    a = lambda x: np.asarray(x, np.int64)  # noqa: E731
    extra = []
    for g in groups:
        g_tables = np.full((len(chunks), width), io.PAD_BLOCK_ID, np.int64)  # [S, max_blocks]
        g_slots: list[int] = []
        for r, s in enumerate(chunks):
            gb = next((x for x in s.group_blocks if x.group == g), None)
            table, slot = (gb.block_table, gb.slot_mapping) if gb is not None else (s.block_table, s.slot_mapping)
            used = -(-end(s) // block_size)
            g_tables[r, :used] = table[:used]
            g_slots.extend(slot)
        extra.append((g, g_tables, a(g_slots)))
    obs = [s.observation_len for s in chunks]  # importance eviction (core/importance.py)
    states = [s.state.slot if s.state is not None else None for s in chunks]  # hybrids (core/state_pool.py)
    loras = [s.lora_slot for s in chunks]  # LoRA adapters (runtime/lora.py): each token its sequence's slot
    return ModelInput(a(ids), a(pos), a(qsl), a(lens), tables, a(slots), tuple(extra),
                      observation_lens=a(obs) if any(obs) else None,
                      state_slots=a(states) if None not in states else None,
                      lora_index=np.repeat(a(loras), np.diff(a(qsl))) if any(x >= 0 for x in loras) else None)


def _groups(q_len: list[int], slack: float) -> list[list[int]]:
    """Row indices split into backend calls for a backend that pads queries: 1-token decodes
    in one call, prompt chunks grouped so that (rows x longest chunk) stays within `slack`
    of their real size."""
    single = [i for i, n in enumerate(q_len) if n == 1]
    groups: list[list[int]] = []
    for i in sorted((i for i, n in enumerate(q_len) if n > 1), key=lambda i: -q_len[i]):
        g = groups[-1] if groups else None
        if g is not None and (len(g) + 1) * q_len[g[0]] <= slack * (sum(q_len[j] for j in g) + q_len[i]):
            g.append(i)
        else:
            groups.append([i])
    return groups + ([single] if single else [])


class ModelRunner:
    """Owns the backend: packs a step, runs it, samples."""

    def __init__(self, backend: Backend, block_size: int, eos_token_ids: tuple[int, ...] = (),
                 offload: KVOffload | None = None, drafter: Drafter | None = None):
        self.backend, self.block_size, self.eos_token_ids = backend, block_size, tuple(eos_token_ids)
        self.offload = offload  # the KV tiers' copier (kv_offload.py); None: no tiers
        self.drafter = drafter  # speculation's proposer, drafting after each step (proposers.py); None: off
        self._scores: dict[str, np.ndarray] = {}  # this step's attention scores by request (take_scores)

    def logits(self, chunks: Sequence[ScheduledRequest], all_tokens: bool = False) -> np.ndarray:
        """Run the chunks (storing their K/V in the pool); logits [len(chunks), vocab] float32,
        one row per chunk (its last token), or [tokens, vocab] with `all_tokens` (an
        --all-logits build), chunk after chunk.

        A backend whose attention works on the packed tokens (the PagedAttention op) runs the
        step as one call. NOTE: the `onnx` attention pads every sequence of a call to the
        call's longest query chunk. So there a step runs as several calls: 1-token decodes
        apart from prompt chunks, and prompt chunks of very different lengths apart
        (padding <= 25%). Each extra call re-reads the weights (~20 ms here) but computes no
        extra tokens; on the mixed-64 trace this cut prefill time from 32.6 s to ~25-29 s.
        Splitting decodes by context length the same way measured no better."""
        b = self.backend
        if getattr(b, "state", None) is not None and any(s.state is None for s in chunks):
            # NOTE: callers without a scheduler (validation, benches) run the same sequences in the same
            # order every step: row r keeps slot r (a scheduler gives each request its own: core/state_pool.py)
            chunks = [s if s.state is not None else dataclasses.replace(s, state=StateStep(r))
                      for r, s in enumerate(chunks)]
        kv_groups = b.groups
        groups = _groups([len(s.token_ids) for s in chunks], QUERY_PAD_SLACK) if b.pads_queries else []

        def packed(part: Sequence[ScheduledRequest]):
            return _with_rows(pack(part, self.block_size, b.full_block_tables, kv_groups), part, all_tokens)

        if len(groups) <= 1:
            out = b.execute(packed(chunks), all_tokens=all_tokens)
            self._scores.update(take_scores(b, chunks))
            assert out.shape[0] == _rows(chunks, all_tokens)[-1], "the backend returned one row per chunk/token"
            return out
        spans = _rows(chunks, all_tokens)  # chunk i's rows are out[spans[i]:spans[i + 1]]
        out = None
        for g in groups:
            part = b.execute(packed([chunks[i] for i in g]), all_tokens=all_tokens)
            self._scores.update(take_scores(b, [chunks[i] for i in g]))
            if out is None:
                out = np.empty((spans[-1], part.shape[1]), part.dtype)
            at = 0
            for i in g:
                n = spans[i + 1] - spans[i]
                out[spans[i]:spans[i + 1]] = part[at:at + n]
                at += n
        return out

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and sample a token for every chunk that reaches the end of
        its sequence; score the prompt tokens of chunks that ask (`prompt_targets`: then the
        step returns every token's logits, which an --all-logits build computes anyway). A
        request whose part of the step fails (in the backend, in scoring or in sampling) is
        reported in `failed`; the others' tokens are still sampled. With a drafter, the drafts of
        the step's draft_plan follow (ModelRunnerOutput.draft_token_ids)."""
        return self._drafted(out, self._execute(out))

    def _drafted(self, out: SchedulerOutput, result: ModelRunnerOutput) -> ModelRunnerOutput:
        """`result` with the drafter's drafts after the step (proposers.py); a drafter failing costs
        the step its drafts only."""
        if self.drafter is None:
            return result
        try:
            drafts = self.drafter.after_step(out, result)
        except Exception:  # noqa: BLE001 - drafts only speed decoding up: the step's tokens stand without them
            log.exception("drafting after the step failed; the next step decodes without drafts")
            return result
        return dataclasses.replace(result, draft_token_ids=drafts) if drafts else result

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.offload is not None:  # NOTE: before the compute: evicted blocks are saved, tier hits loaded
            self.offload.run(out.kv_ops)
        rows = list(out.scheduled)
        self._scores = {}  # request id -> attention scores of its observation queries (importance eviction)
        if not rows:  # only transfers (a request waits for a disk read): wait a little for it
            events = self.offload.poll(wait_s=0.005) if self.offload is not None else None
            return ModelRunnerOutput({}, {}, tier_events=events)
        all_tokens = False  # NOTE: each chunk's rows are `wanted_rows` (io.LOGITS_INDICES, or cut from all rows)
        state = getattr(self.backend, "state", None)  # hybrids: prefix-cache checkpoints (execution/state_store.py)
        restore_checkpoints(state, rows)
        logits, failed = self._isolating(rows, all_tokens)
        save_checkpoints(state, rows, failed)
        spans = _rows(rows, all_tokens)
        scored = {}
        for r, s in enumerate(rows):
            if not s.prompt_targets or s.request_id in failed:
                continue
            try:
                first = spans[r + 1] - len(s.token_ids)  # where the chunk's token 0 would be (its rows are the last)
                lo = first + s.prompt_target_start - 1 - s.start_pos  # the row predicting the first target
                scored[s.request_id] = score(logits[lo:lo + len(s.prompt_targets)], s.prompt_targets,
                                             s.prompt_target_start, s.prompt_top_k)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                log.exception("scoring the prompt of request %s failed", s.request_id)
                failed[s.request_id] = f"computing prompt logprobs failed: {e}"
        sampled: dict[str, SampledToken] = {}
        accepted: dict[str, tuple[SampledToken, ...]] = {}
        self._mask_grammars(logits, rows, spans, failed)
        greedy = self._greedy_tokens(logits, rows, spans, failed)  # request id -> token (plain greedy, all at once)
        for r, s in enumerate(rows):
            if not s.samples or s.request_id in failed:
                continue
            if greedy.get(s.request_id) is not None:
                sampled[s.request_id] = SampledToken(greedy[s.request_id], None, None)
                continue
            try:
                assert s.sampler is not None, "a sampling chunk carries its sampler"
                if s.num_draft_tokens:  # the target's verdict on the drafts (spec_sampling.py)
                    k = s.num_draft_tokens
                    toks = verify_drafts(logits[spans[r + 1] - 1 - k:spans[r + 1]], s.token_ids[-k:], s.sampler,
                                         s.num_output_tokens, self.eos_token_ids)
                    accepted[s.request_id] = tuple(toks[:-1])
                    sampled[s.request_id] = toks[-1]
                    continue
                tok, lp, top = sample(logits[spans[r + 1] - 1], s.sampler, s.sampler.prompt_tokens,
                                      s.num_output_tokens, self.eos_token_ids)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                log.exception("sampling request %s failed", s.request_id)
                failed[s.request_id] = f"sampling failed: {e}"
                continue
            sampled[s.request_id] = SampledToken(tok, lp, tuple(top) if top is not None else None)
        return ModelRunnerOutput(sampled, failed, scored, self.offload.poll() if self.offload is not None else None,
                                 accepted=accepted, attention_scores=self._scores)

    @staticmethod
    def _greedy_tokens(logits: np.ndarray | None, rows: list[ScheduledRequest], spans: list[int],
                       failed: dict[str, str]) -> dict[str, int | None]:
        """The tokens of every sampling row that is plain greedy (sampling.plain_greedy: no drafts, penalties,
        logprobs or grammar), from one argmax over those rows (sampling.sample_greedy); None where sample() must
        look at the row itself (NaN, nothing finite)."""
        at = [(spans[r + 1] - 1, s) for r, s in enumerate(rows)
              if s.samples and s.sampler is not None and not s.num_draft_tokens and s.request_id not in failed
              and plain_greedy(s.sampler, s.num_output_tokens)]
        if not at or logits is None:
            return {}
        toks = sample_greedy(logits, [r for r, _ in at], [s.sampler for _, s in at])
        return {s.request_id: t for (_, s), t in zip(at, toks)}

    @staticmethod
    def _mask_grammars(logits: np.ndarray | None, rows: list[ScheduledRequest], spans: list[int],
                       failed: dict[str, str]) -> None:
        """Structured output: the grammar masks of every sampling row without drafts, in one pass
        (sampling.mask_grammars); a failure fails those requests alone."""
        at = [(spans[r + 1] - 1, s) for r, s in enumerate(rows)
              if s.samples and s.sampler is not None and s.sampler.grammar is not None and not s.num_draft_tokens
              and s.request_id not in failed]
        if not at or logits is None:
            return
        try:
            for i in mask_grammars(logits, [r for r, _ in at], [s.sampler for _, s in at]):
                failed[at[i][1].request_id] = ("structured output: the grammar allows no token at this point of the "
                                               "output (no token of this model continues it); fix the grammar")
        except Exception as e:  # noqa: BLE001 - the grammar's requests fail, the rest go on
            log.exception("filling grammar masks failed")
            failed.update({s.request_id: f"structured output failed: {e}" for _, s in at})

    def _isolating(self, rows: list[ScheduledRequest],
                   all_tokens: bool = False) -> tuple[np.ndarray | None, dict[str, str]]:
        """Logits of the rows (`logits()`); when the backend call fails, the rows are run again
        in halves until the failing request(s) are found, so the others still get their logits.

        NOTE: re-running a chunk is safe: a backend stores K/V only for a call that succeeds
        (the `onnx` attention stores after the run; the PagedAttention op checks all metadata
        before writing), and storing the same tokens at the same slots again writes the same
        values."""
        try:
            return self.logits(rows, all_tokens), {}
        except Exception as e:  # noqa: BLE001 - find who caused it, keep serving the rest
            if len(rows) == 1:
                log.warning("request %s failed in the backend: %s", rows[0].request_id, e)
                return None, {rows[0].request_id: f"the backend failed on this request: {e}"}
            log.warning("a step of %d requests failed in the backend (%s); isolating the cause", len(rows), e)
        half = len(rows) // 2
        spans = _rows(rows, all_tokens)
        out, failed = None, {}
        for lo, hi in ((0, half), (half, len(rows))):
            part, bad = self._isolating(rows[lo:hi], all_tokens)
            failed.update(bad)
            if part is not None:
                if out is None:
                    out = np.full((spans[-1], part.shape[1]), np.nan, np.float32)
                out[spans[lo]:spans[hi]] = part
        return out, failed


def wanted_rows(s: ScheduledRequest) -> int:
    """How many of a chunk's last tokens the step needs logits of: 1 (its last token), 1 + k for
    a chunk carrying k drafts (the target's verdict on each), or from the row predicting its first
    prompt target (prompt logprobs) to its end."""
    n = 1 + s.num_draft_tokens
    if s.prompt_targets:
        n = max(n, len(s.token_ids) - (s.prompt_target_start - 1 - s.start_pos))
    return n


def _with_rows(inp: ModelInput, chunks: Sequence[ScheduledRequest], all_tokens: bool) -> ModelInput:
    """`inp` asking for each chunk's `wanted_rows` (io.LOGITS_INDICES; every row with all_tokens)."""
    if all_tokens:
        return inp
    ends = inp.query_start_loc[1:]
    idx = np.concatenate([np.arange(e - wanted_rows(s), e, dtype=np.int64) for e, s in zip(ends, chunks)])
    return dataclasses.replace(inp, logits_indices=idx)


def _rows(chunks: Sequence[ScheduledRequest], all_tokens: bool) -> list[int]:
    """Where each chunk's logits rows start in a step's output (and, last, how many rows):
    `wanted_rows` per chunk, or with `all_tokens` one per token."""
    offsets = [0]
    for s in chunks:
        offsets.append(offsets[-1] + (len(s.token_ids) if all_tokens else wanted_rows(s)))
    return offsets
