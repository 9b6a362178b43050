"""The draft-model proposer of speculative decoding (`--speculative draft --draft-model BUILD`): a
second kvexport build with the target's vocabulary drafts greedily, with its own small KV pool,
stepped inside the target's engine loop (core/speculation.py calls `propose` while scheduling).

    propose(req, k):  the draft's KV tokens vs req.token_ids ─▶ keep the common prefix (rollback)
                      ─▶ one chunk for the tokens it has not seen ─▶ argmax d_1
                      ─▶ k - 1 one-token steps ─▶ argmax d_2 .. d_k

NOTE: drafts are the draft model's argmax, so the proposal is a point mass and the target's
verification (execution/spec_sampling.py) keeps the output distribution exactly the target's
at any temperature. Rollback is the common-prefix rule: whatever the target rejected differs
from req.token_ids, so the draft's KV past the common prefix is simply rewritten next time
(its slots stay reserved, never published: the draft's pool has no prefix cache).
NOTE: one request at a time (k backend calls per request per step, not batched across the
running requests): simple, and measured in docs/BENCHMARKS.md; batching the draft steps of a
step's requests is the next improvement.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvexport import io
from kvexport import manifest as mf
from kvexport.errors import ConfigError

from .config import EngineConfig
from .core.block_pool import BlockPool
from .core.kv_cache_manager import ComputedBlocks, KVCacheManager
from .core.memory import kv_pool_sizes, parse_budget
from .core.outputs import ScheduledRequest
from .core.request import Request
from .execution.backends import create_backend
from .execution.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _DraftSeq:
    tokens: list[int] = field(default_factory=list)  # the tokens whose KV the draft's pool holds, in order


class DraftModelProposer:
    """Greedy drafts from another build (module docstring)."""

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

    def propose(self, req: Request, k: int) -> tuple[int, ...]:
        rid, tokens = req.request_id, req.token_ids
        seq = self._seqs.setdefault(rid, _DraftSeq())
        n = _common_prefix(seq.tokens, tokens)
        n = min(n, len(tokens) - 1)  # the last token is always run: its logits give the first draft
        need = len(tokens) + k - 1  # slots: every token, and the drafts fed back but the last
        if rid not in self.kv:
            if self.kv.allocate_slots(rid, need, ComputedBlocks.empty()) is None:
                return ()
        elif need > self.kv.num_slots(rid) and self.kv.allocate_slots(rid, need - self.kv.num_slots(rid)) is None:
            return ()  # NOTE: the draft's pool is full: no drafts this step (the target decodes plainly)
        del seq.tokens[n:]
        try:
            while len(tokens) - n > self.max_chunk:  # a long catch-up (the prompt) in chunks
                self._run(rid, tokens[n:n + self.max_chunk], n)
                n += self.max_chunk
            seq.tokens[:] = tokens[:n]
            drafts = [self._next(self._run(rid, tokens[n:], n))]
            seq.tokens[:] = tokens
            for _ in range(k - 1):
                drafts.append(self._next(self._run(rid, drafts[-1:], len(seq.tokens))))
                seq.tokens.append(drafts[-2])
        except Exception:  # noqa: BLE001 - the draft failing must not fail the request: no drafts
            log.exception("draft model %s failed on request %s; decoding it without drafts", self.build_dir, rid)
            self.release(rid)
            return ()
        return tuple(drafts)

    def _run(self, rid: str, token_ids, start: int) -> np.ndarray:
        """Store the KV of `token_ids` at positions start.. of the draft's sequence; the last one's logits."""
        chunk = ScheduledRequest(rid, tuple(token_ids), start, tuple(self.kv.block_table(rid)),
                                 tuple(self.kv.slot_mapping(rid, start, len(token_ids))), samples=True)
        return self.runner.logits([chunk])[-1]

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
