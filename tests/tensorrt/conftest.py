"""Tiny factories for the TensorRT tests: a plugin-attention manifest without any graph files
(profiles and errors need only the manifest), and an `engines` entry for it."""

from __future__ import annotations

import pytest

from kvexport import io
from kvexport.manifest import (EngineBuildOptions, EngineFile, EngineLimits, EnginesEntry, GpuInfo, GraphEntry, KVSpec,
                               Manifest, ModelEntry, PluginInfo, WeightsEntry)

LAYERS, KV_HEADS, HEAD_DIM, VOCAB, BLOCK, MAX_LEN = 2, 2, 16, 128, 16, 256
GPU = GpuInfo("NVIDIA H200", "9.0")


def model_entry() -> ModelEntry:
    """The fields of a ModelSpec.to_json() the manifest reads, for a tiny llama."""
    return ModelEntry({"family": "llama", "model_type": "llama", "num_layers": LAYERS, "hidden_size": 64,
                       "num_heads": 4, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
                       "max_positions": MAX_LEN, "sliding_window": None, "tie_embeddings": False,
                       "bos_token_id": 1, "eos_token_ids": [2]})


def engines_entry(files: dict[str, EngineFile] | None = None, **limits) -> EnginesEntry:
    """An `engines` entry with limits 8 sequences, 64 tokens, 256-token context, 100 blocks
    (override with keyword arguments)."""
    files = files or {p: EngineFile(f"engines/{p}.plan", 4, "0" * 64, {}) for p in ("prefill", "decode")}
    lim = dict(max_num_seqs=8, max_num_batched_tokens=64, max_seq_len=256, max_blocks_per_seq=16,
               max_num_blocks=100) | limits
    opts = EngineBuildOptions(max_num_seqs=lim["max_num_seqs"], max_num_batched_tokens=lim["max_num_batched_tokens"],
                              max_num_blocks=lim["max_num_blocks"])
    return EnginesEntry(backend="tensorrt", tensorrt_version="10.13.0.35", gpu=GPU, precision="fp16",
                        strongly_typed=True, tf32=False, engines=files, timing_cache="engines/timing.cache",
                        limits=EngineLimits(**lim), plugin=PluginInfo(f"{io.PLUGIN_DOMAIN}::{io.PLUGIN_OP}",
                                                                      io.PLUGIN_VERSION, None),
                        options=opts)


def plugin_manifest(attention: io.Attention = io.Attention.PLUGIN, dtype: str = "fp32") -> Manifest:
    graphs = {}
    for phase, file in ((io.Phase.PREFILL, io.PREFILL_GRAPH), (io.Phase.DECODE, io.DECODE_GRAPH)):
        gio = io.graph_io(layout=io.KVLayout.PAGED, phase=phase, num_layers=LAYERS, num_kv_heads=KV_HEADS,
                          head_dim=HEAD_DIM, vocab_size=VOCAB, block_size=BLOCK, act_dtype="float32",
                          kv_dtype="float32", all_logits=False, attention=attention)
        graphs[phase.value] = GraphEntry(file, gio.inputs, gio.outputs, 1)
    kv = KVSpec(layout=io.KVLayout.PAGED.value, attention=attention.value, dtype=dtype, block_size=BLOCK,
                num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                bytes_per_token=io.kv_bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, io.DType(dtype)), max_seq_len=MAX_LEN)
    return Manifest(schema_version=io.SCHEMA_VERSION, kvexport_version="test", source={}, model=model_entry(),
                    dtype=dtype, kv=kv, graphs=graphs, weights=WeightsEntry(io.WEIGHTS_FILE, 0, 0), tokenizer=None,
                    all_logits=False, validation=None, tools={})


@pytest.fixture
def make_manifest():
    """make_manifest(attention=PLUGIN, dtype="fp32") -> Manifest of a tiny plugin build."""
    return plugin_manifest


@pytest.fixture
def make_engines():
    """make_engines(files=None, **limits) -> EnginesEntry built on GPU (an H200, sm 9.0)."""
    return engines_entry
