"""Small, valid example inputs for each graph, saved in the build so any ONNX tool can run
the graphs at once (`polygraphy run decode.onnx --onnxrt --load-inputs samples/decode_inputs.json`).
Random values would not do: block tables, offsets and masks must be consistent. The pools are the
build's own (io.kv_layout: only the layers that hold KV, each its own heads × head_dim; a hybrid's
linear layers none) and a hybrid's recurrent state pools (io.state_dims) are fed too."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from kvexport import io


def sample_feeds(manifest, phase: io.Phase, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    kv, vocab = manifest.kv, manifest.model.vocab_size
    kv_np = np.dtype(io.DType(kv.dtype).pool_dtype)
    ids = lambda *shape: rng.integers(0, vocab, size=shape, dtype=np.int64)  # noqa: E731
    if kv.layout == io.KVLayout.CONTIGUOUS.value:
        batch, seq, past = 2, (5 if phase is io.Phase.PREFILL else 1), (0 if phase is io.Phase.PREFILL else 5)
        mask = np.ones((batch, past + seq), np.int64)
        mask[0, :2] = 0  # row 0 is left-padded by two tokens
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)[:, past:]
        feeds = {io.INPUT_IDS: ids(batch, seq), io.ATTENTION_MASK: mask, io.POSITION_IDS: pos}
        if phase is io.Phase.DECODE:
            for i in range(kv.num_layers):
                for name in (io.past_key(i), io.past_value(i)):
                    row = io.kv_row_width(kv.head_dim, io.DType(kv.dtype).numpy_name)
                    feeds[name] = rng.standard_normal((batch, kv.num_kv_heads, past, row)).astype(kv_np)
        return feeds
    # paged: two sequences; in prefill the second already has 4 tokens cached (chunked
    # prefill). Packed by the runtime's own pack() (runtime/execution/model_runner.py).
    from kvexport.runtime.execution.model_runner import chunk, pack

    q_lens, ctx = ([3, 5], [0, 4]) if phase is io.Phase.PREFILL else ([1, 1], [3, 6])
    bs = kv.block_size
    per_seq = max(math.ceil((c + q) / bs) for c, q in zip(ctx, q_lens))
    chunks = [chunk(str(s), ids(q).tolist(), c, [1 + s * per_seq + j for j in range(per_seq)], bs)
              for s, (c, q) in enumerate(zip(ctx, q_lens))]
    # a build with a local KV cache group: its tables mirror the full group's (pools of equal size)
    groups = sorted(set(manifest.layer_groups or ()) - {io.FULL_GROUP})
    feeds = pack(chunks, bs, full_tables=kv.attention == io.Attention.PLUGIN.value, groups=groups).feeds()
    if io.LOGITS_INDICES not in {t.name for t in manifest.graphs[phase.value].inputs}:
        del feeds[io.LOGITS_INDICES]  # the decode graph, builds made before it
    if io.OBSERVATION_LENS not in {t.name for t in manifest.graphs[phase.value].inputs}:
        del feeds[io.OBSERVATION_LENS]  # builds without attention scores
    # K/V pools (or MLA's latent pools) of the layers holding KV, each its own shape (Gemma 4, hybrids)
    kv_layers, dims = io.kv_layout(manifest.model.spec, kv.num_kv_heads, kv.head_dim)
    for name, i in zip(io.pool_names(kv.num_layers, kv.latent, kv_layers),
                       io.pool_layers(kv.num_layers, kv.latent, kv_layers)):
        heads, width = (kv.num_kv_heads, kv.head_dim) if kv.latent else dims[i]
        shape = io.paged_pool_shape(1 + 2 * per_seq, heads, bs, width, io.DType(kv.dtype).numpy_name)
        feeds[name] = rng.standard_normal(shape).astype(kv_np)
    if (found := io.state_dims(manifest.model.spec)) is not None:  # a hybrid: slots 0, 1 of two-slot state pools
        num_linear, sd = found
        feeds[io.STATE_SLOTS] = np.arange(2, dtype=np.int64)
        for name, shape in zip(io.state_names(num_linear, sd.recurrent), sd.shapes * num_linear):
            feeds[name] = (0.1 * rng.standard_normal((2, *shape))).astype(np.float32)
    return feeds


def write_samples(build_dir: Path, manifest) -> dict[str, str]:
    """Write samples/<phase>_inputs.json in polygraphy's input format; returns phase -> path."""
    from polygraphy.json import save_json

    out = {}
    (build_dir / "samples").mkdir(exist_ok=True)
    for phase in io.Phase:
        rel = f"samples/{phase.value}_inputs.json"
        save_json([sample_feeds(manifest, phase)], str(build_dir / rel))
        out[phase.value] = rel
    return out
