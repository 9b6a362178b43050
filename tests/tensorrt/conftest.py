"""Tiny factory for the TensorRT tests: a plugin-attention manifest without any graph files
(profiles and errors need only the manifest)."""

from __future__ import annotations

import pytest

from kvexport import io
from kvexport.manifest import GraphEntry, KVSpec, Manifest

LAYERS, KV_HEADS, HEAD_DIM, VOCAB, BLOCK, MAX_LEN = 2, 2, 16, 128, 16, 256


def plugin_manifest(attention: io.Attention = io.Attention.PLUGIN, dtype: str = "fp32") -> Manifest:
    graphs = {}
    for phase, file in ((io.Phase.PREFILL, io.PREFILL_GRAPH), (io.Phase.DECODE, io.DECODE_GRAPH)):
        gio = io.graph_io(layout=io.KVLayout.PAGED, phase=phase, num_layers=LAYERS, num_kv_heads=KV_HEADS,
                          head_dim=HEAD_DIM, vocab_size=VOCAB, block_size=BLOCK, act_dtype="float32",
                          kv_dtype="float32", all_logits=False, attention=attention)
        graphs[phase.value] = GraphEntry(file, [t.to_json() for t in gio.inputs], [t.to_json() for t in gio.outputs], 1)
    kv = KVSpec(io.KVLayout.PAGED.value, attention.value, dtype, BLOCK, LAYERS, KV_HEADS, HEAD_DIM,
                io.kv_bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, io.DType(dtype)), MAX_LEN)
    return Manifest(schema_version=io.SCHEMA_VERSION, kvexport_version="test", source={}, model={}, dtype=dtype,
                    kv=kv, graphs=graphs, weights={"file": io.WEIGHTS_FILE, "bytes": 0}, tokenizer=None,
                    all_logits=False, validation=None, tools={})


@pytest.fixture
def make_manifest():
    """make_manifest(attention=PLUGIN, dtype="fp32") -> Manifest of a tiny plugin build."""
    return plugin_manifest
