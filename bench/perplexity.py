"""Perplexity scoring shared by bench/kv_quality.py and bench/weight_quality.py: the same text
windows scored through the runtime's own model runner (`nll_paged`) and through transformers
(`nll_transformers`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def nll_paged(build_dir: Path, ids: list[int], window: int, chunk: int,
              accuracy: str | None = None) -> tuple[float, int]:
    """Sum of next-token negative log-likelihoods over windows of the text, and the count.
    Runs the runtime's own backend and model runner (all-token logits of each chunk), with
    weight_matmul_accuracy `accuracy` (None: the build's)."""
    from kvexport import manifest as mf
    from kvexport.runtime.execution.model_runner import ModelRunner, chunk as scheduled_chunk
    from kvexport.runtime.execution.ort_backends import ort_backend

    m = mf.load(build_dir)
    bs = m.kv.block_size
    table = list(range(1, 1 + -(-window // bs)))
    # one pool reused by every window: a window's reads are bounded by its tables and seq_lens
    runner = ModelRunner(ort_backend(build_dir, m, num_blocks=1 + len(table), accuracy=accuracy), bs)
    total, count = 0.0, 0
    for w0 in range(0, len(ids) - 1, window):
        win = ids[w0:w0 + window]
        if len(win) < 2:
            break
        for c0 in range(0, len(win), chunk):
            part = win[c0:c0 + chunk]
            logits = runner.logits([scheduled_chunk("w", part, c0, table, bs)], all_tokens=True).astype(np.float64)
            targets = win[c0 + 1:c0 + len(part) + 1]
            logits = logits[:len(targets)]  # [len(targets), vocab]
            lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
            total += float((lse - logits[np.arange(len(targets)), targets]).sum())
            count += len(targets)
    return total, count


def nll_transformers(model, ids: list[int], window: int) -> tuple[float, int]:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for w0 in range(0, len(ids) - 1, window):
            win = ids[w0:w0 + window]
            if len(win) < 2:
                break
            logits = model(torch.tensor([win]), use_cache=False).logits[0].double()
            lp = torch.log_softmax(logits[:-1], -1)
            total += float(-lp[torch.arange(len(win) - 1), torch.tensor(win[1:])].sum())
            count += len(win) - 1
    return total, count
