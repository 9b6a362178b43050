"""The draft-model proposer of speculative decoding (`--speculative draft --draft-model BUILD`): a
second kvexport build with the target's vocabulary drafts greedily, with its own small KV pool,
stepped on the target runner's side after each step's forward (execution/proposers.py's Drafter
calls it with the step's planned requests).

    propose_many([(id, tokens, k), ..]):  per request: the draft's KV tokens vs the target's tokens
                      ─▶ keep the common prefix (rollback)
                   ─▶ ONE call: every request's tokens the draft has not seen ─▶ argmax d_1 each
                   ─▶ k - 1 calls, each one token for every request still drafting ─▶ d_2 .. d_k

NOTE: drafts are the draft model's argmax, so the proposal is a point mass and the target's
verification (execution/spec_sampling.py) keeps the output distribution exactly the target's
at any temperature. Rollback is the common-prefix rule: whatever the target rejected differs
from the target's tokens, so the draft's KV past the common prefix is simply rewritten next time
(its slots stay reserved, never published: the draft's pool has no prefix cache).
NOTE: batched across the step's drafting requests: k draft calls per target step whatever the
batch (before: k per request), measured in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from kvexport import io
from kvexport import manifest as mf
from kvexport.errors import ConfigError

from .config import EngineConfig
from .core.block_pool import BlockPool
from .core.kv_cache_manager import ComputedBlocks, KVCacheManager
from .core.memory import kv_pool_sizes, parse_budget
from .core.outputs import ScheduledRequest
from .execution.backends import create_backend
from .execution.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _DraftSeq:
    tokens: list[int] = field(default_factory=list)  # the tokens whose KV the draft's pool holds, in order


@dataclass(slots=True)
class _Job:
    """One request's drafting in a propose_many call."""

    rid: str
    tokens: list[int]  # the target's tokens (the last: the step's next token)
    k: int  # drafts wanted
    done: int  # tokens of `tokens` whose KV the draft holds
    drafts: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy drafts from another build (module docstring)."""

    runs_model = True  # the speculation policy allots drafts before asking (core/speculation.py)

    def __init__(self, build_dir: Path, manifest: mf.Manifest, runner: ModelRunner, kv: KVCacheManager,
                 max_chunk: int):
        self.build_dir, self.manifest, self.runner, self.kv = build_dir, manifest, runner, kv
        self.max_chunk = max_chunk  # tokens per catch-up call (the target's max_num_batched_tokens)
        self._seqs: dict[str, _DraftSeq] = {}

    @classmethod
    def open(cls, draft_dir: str, target_dir: Path, target: mf.Manifest, config: EngineConfig) -> "DraftModelProposer":
        """The draft build at `draft_dir`, checked against the target build (its manifest `target`);
        its pool takes the same kv_cache_memory budget as the target's. ConfigError names draft_model."""
        path = Path(draft_dir).expanduser()
        if not (path / io.MANIFEST_NAME).is_file():
            raise ConfigError(f"draft_model {draft_dir!r} is not a kvexport build (no {io.MANIFEST_NAME}): give the "
                              f"folder `kvexport build` wrote for the draft model")
        m = mf.load(path)
        problems = []
        if m.kv.layout != io.KVLayout.PAGED.value:
            problems.append(f"its layout is {m.kv.layout!r} (paged builds only)")
        if m.model.vocab_size != target.model.vocab_size:
            problems.append(f"its vocabulary has {m.model.vocab_size} tokens, the target's {target.model.vocab_size}")
        if m.kv.max_seq_len < target.kv.max_seq_len:
            problems.append(f"its max_seq_len {m.kv.max_seq_len} is below the target's {target.kv.max_seq_len}")
        mine, theirs = (_tokenizer_file(path, m), _tokenizer_file(Path(target_dir), target))
        if mine != theirs:
            problems.append("its tokenizer differs from the target's (tokenizer.json)")
        if m.layer_groups is not None:
            problems.append("it has a windowed-layer KV cache group (not supported for drafts)")
        if io.state_dims(m.model.spec) is not None:
            problems.append("it is a hybrid model with recurrent state (not supported for drafts)")
        if problems:
            raise ConfigError(f"draft_model {draft_dir}: " + "; ".join(problems) + ": give a paged build of a model "
                              "with the target's tokenizer and vocabulary and at least its context")
        budget = parse_budget(config.kv_cache_memory)
        per_token = {io.FULL_GROUP: io.kv_bytes_per_token(m.kv.num_layers, m.kv.num_kv_heads, m.kv.head_dim,
                                                          io.DType(m.kv.dtype), m.kv.latent)}
        sizes = kv_pool_sizes(budget, m.kv.block_size, per_token, None, config.max_num_seqs,
                              config.max_num_batched_tokens)
        backend, _ = create_backend(path, m, config, sizes.num_blocks)
        pool = BlockPool(backend.num_blocks, m.kv.block_size, enable_prefix_caching=False)
        return cls(path, m, ModelRunner(backend, m.kv.block_size), KVCacheManager(pool),
                   config.max_num_batched_tokens)

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        if request_id in self.kv:
            self.kv.free(request_id)

    def propose_many(self, wanted: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, tuple[int, ...]]:
        """Drafts for several requests at once ((request id, the target's tokens, k) -> up to k tokens
        following them; () where the draft's pool is full or the draft failed): one catch-up call for
        the tokens each has not seen (max_chunk tokens per call), then one call per draft position for
        every request still drafting — the draft build's decode steps batched like the target's."""
        out: dict[str, tuple[int, ...]] = {}
        jobs: list[_Job] = []
        for rid, target_tokens, k in wanted:
            tokens = list(target_tokens)
            seq = self._seqs.setdefault(rid, _DraftSeq())
            # the last token is always run: its logits give the first draft
            n = min(_common_prefix(seq.tokens, tokens), len(tokens) - 1)
            if k < 1 or not self._reserve(rid, len(tokens) + k - 1):  # every token, and the drafts fed back but the last
                out[rid] = ()  # NOTE: the draft's pool is full: no drafts this step (the target decodes plainly)
                continue
            del seq.tokens[n:]
            jobs.append(_Job(rid, tokens, k, n))
        try:
            pending = jobs
            while pending:  # the catch-up (a prompt: in chunks), as many requests per call as max_chunk allows
                budget, call = self.max_chunk, []
                for j in pending:
                    if budget <= 0:
                        break
                    take = min(len(j.tokens) - j.done, budget)
                    call.append((j, j.done, take))
                    budget -= take
                rows = self.runner.logits([self._chunk(j.rid, j.tokens[a:a + t], a) for j, a, t in call])
                for (j, a, t), row in zip(call, rows):
                    j.done = a + t
                    self._seqs[j.rid].tokens[:] = j.tokens[:j.done]
                    if j.done == len(j.tokens):
                        j.drafts.append(self._next(row))
                pending = [j for j in pending if j.done < len(j.tokens)]
            while True:  # draft position 2..k: one call for every request still drafting
                live = [j for j in jobs if len(j.drafts) < j.k]
                if not live:
                    break
                rows = self.runner.logits([self._chunk(j.rid, j.drafts[-1:], len(j.tokens) + len(j.drafts) - 1)
                                           for j in live])
                for j, row in zip(live, rows):
                    self._seqs[j.rid].tokens.append(j.drafts[-1])
                    j.drafts.append(self._next(row))
        except Exception:  # noqa: BLE001 - the draft failing must not fail the requests: no drafts
            log.exception("draft model %s failed on requests %s; decoding them without drafts", self.build_dir,
                          [j.rid for j in jobs])
            for j in jobs:
                self.release(j.rid)
                out[j.rid] = ()
            return out
        out.update((j.rid, tuple(j.drafts)) for j in jobs)
        return out

    def _reserve(self, rid: str, need: int) -> bool:
        """The draft's pool holds `need` slots for the request (False: it is full)."""
        if rid not in self.kv:
            return self.kv.allocate_slots(rid, need, ComputedBlocks.empty()) is not None
        have = self.kv.num_slots(rid)
        return need <= have or self.kv.allocate_slots(rid, need - have) is not None

    def _chunk(self, rid: str, token_ids, start: int) -> ScheduledRequest:
        """The KV of `token_ids` at positions start.. of the draft's sequence (its last token's logits)."""
        return ScheduledRequest(rid, tuple(token_ids), start, tuple(self.kv.block_table(rid)),
                                tuple(self.kv.slot_mapping(rid, start, len(token_ids))), samples=True)

    @staticmethod
    def _next(row: np.ndarray) -> int:
        return int(np.argmax(row))


def _tokenizer_file(build_dir: Path, m: mf.Manifest) -> bytes | None:
    """The build's tokenizer.json bytes (None: no tokenizer)."""
    f = build_dir / m.tokenizer / "tokenizer.json" if m.tokenizer else None
    return f.read_bytes() if f is not None and f.is_file() else None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


__all__ = ["DraftModelProposer"]
