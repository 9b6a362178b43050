"""Attention scores of a step's observation queries (importance eviction, runtime/core/importance.py),
from the backend to the scheduler: the graphs return one `attention_scores.{i}` per KV layer
([num_seqs, kv_heads, score_len], kvexport/io.py); the runner sums them over layers and cuts each
observing sequence's row to its KV length.

    ScheduledRequest.observation_len ─pack()─▶ io.OBSERVATION_LENS ─graph─▶ attention_scores.{i}
      ─take_scores()─▶ {request id: [kv_heads, seq_len]} ─▶ ModelRunnerOutput.attention_scores

NOTE (summed over layers): the paged pool evicts a block from every layer at once (one block table
per sequence), so a per-layer score has no use here; per-layer budgets (PyramidKV) would need one
table per layer.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.outputs import ScheduledRequest


def take_scores(backend, chunks: Sequence[ScheduledRequest]) -> dict[str, np.ndarray]:
    """The scores the backend's last `execute` of `chunks` returned (its `take_scores()`: per KV
    layer [S, kv_heads, score_len], or None), by request id: [kv_heads, seq_len] float32 summed over
    layers, for each chunk with observation_len > 0. Backends that do not score return {}."""
    if not any(s.observation_len for s in chunks):
        return {}
    take = getattr(backend, "take_scores", None)
    layers = take() if take is not None else None
    if not layers:
        return {}
    total = np.sum(layers, axis=0, dtype=np.float32)  # [S, kvH, score_len]
    out = {}
    for r, s in enumerate(chunks):
        if s.observation_len:
            seq_len = s.start_pos - s.kv_gap + len(s.token_ids)
            out[s.request_id] = total[r, :, :seq_len].copy()
    return out
