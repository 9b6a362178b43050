"""exporter/tensorrt_build.py without TensorRT: optimization profiles from the options (exact
shapes), refusals before TensorRT is touched, the errors when TensorRT or a GPU is missing,
and the atomic write of engines/.

NOTE: TensorRT cannot be installed on this project's machines, so the "missing" tests make
`import tensorrt` fail (or find an empty module) with monkeypatch: they are mocks of the
environment, not of TensorRT's behaviour."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from kvexport import io
from kvexport.errors import ConfigError, KvExportError
from kvexport.exporter import tensorrt_build as tb
from kvexport.exporter.tensorrt_build import EngineBuildOptions, ShapeRange, TensorRTUnavailableError
from kvexport.manifest import GraphEntry

OPTS = EngineBuildOptions(max_num_seqs=8, max_num_batched_tokens=64, max_num_blocks=100)


def test_axis_ranges_prefill_and_decode(make_manifest):
    m = make_manifest()  # block 16, max_seq_len 256
    assert tb.axis_ranges(m, OPTS, io.Phase.PREFILL) == {
        io.NUM_TOKENS: (1, 64, 64), io.NUM_SEQS: (1, 8, 8), io.NUM_SEQS_PLUS_1: (2, 9, 9),
        io.MAX_BLOCKS: (1, 8, 16), io.NUM_BLOCKS: (2, 100, 100),
        io.NUM_LOGITS: (1, 8, 64)}  # logits_indices: a row per sequence usually, every token at most
    assert tb.axis_ranges(m, OPTS, io.Phase.DECODE) == {
        io.NUM_SEQS: (1, 8, 8), io.NUM_SEQS_PLUS_1: (2, 9, 9), io.MAX_BLOCKS: (1, 8, 16),
        io.NUM_BLOCKS: (2, 100, 100)}


def test_axis_ranges_prefill_sequences_capped_by_tokens_and_explicit_lengths(make_manifest):
    opts = EngineBuildOptions(max_num_seqs=64, max_num_batched_tokens=32, max_seq_len=100, opt_seq_len=40,
                              max_num_blocks=10)
    r = tb.axis_ranges(make_manifest(), opts, io.Phase.PREFILL)
    assert r[io.NUM_SEQS] == (1, 32, 32) and r[io.NUM_SEQS_PLUS_1] == (2, 33, 33)
    assert r[io.MAX_BLOCKS] == (1, 3, 7)  # ceil(40/16), ceil(100/16)
    assert tb.axis_ranges(make_manifest(), opts, io.Phase.DECODE)[io.NUM_SEQS] == (1, 64, 64)


def test_profile_shapes_cover_every_input_exactly(make_manifest):
    m = make_manifest()
    shapes = tb.profile_shapes(m, OPTS)
    assert set(shapes) == {"prefill", "decode"}
    for phase in ("prefill", "decode"):
        assert list(shapes[phase]) == [t.name for t in m.graphs[phase].inputs]
    p, d = shapes["prefill"], shapes["decode"]
    assert p[io.INPUT_IDS] == ShapeRange((1,), (64,), (64,))
    assert p[io.SLOT_MAPPING] == p[io.POSITIONS] == p[io.INPUT_IDS]
    assert p[io.QUERY_START_LOC] == ShapeRange((2,), (9,), (9,))
    assert p[io.SEQ_LENS] == ShapeRange((1,), (8,), (8,))
    assert p[io.BLOCK_TABLES] == ShapeRange((1, 1), (8, 8), (8, 16))
    assert p[io.key_cache(1)] == ShapeRange((2, 2, 16, 16), (2, 100, 16, 16), (2, 100, 16, 16))
    assert d[io.INPUT_IDS] == d[io.SEQ_LENS] == ShapeRange((1,), (8,), (8,))
    assert d[io.BLOCK_TABLES] == ShapeRange((1, 1), (8, 8), (8, 16))
    assert d[io.value_cache(0)] == p[io.value_cache(0)]
    assert p[io.BLOCK_TABLES].to_json() == {"min": [1, 1], "opt": [8, 8], "max": [8, 16]}


def test_profile_shapes_of_a_build_with_a_local_kv_group(make_manifest):
    """Layer 0 windowed, layer 1 full (kvexport/io.py KV cache groups): the local group's tables,
    slots and pools get profiles too; the one-group manifest's axes are unchanged."""
    import dataclasses

    m = make_manifest()
    groups = ("local", "full")
    graphs = {}
    for phase, g in m.graphs.items():
        gio = io.graph_io(layout=io.KVLayout.PAGED, phase=io.Phase(phase), num_layers=2, num_kv_heads=2, head_dim=16,
                          vocab_size=128, block_size=16, act_dtype="float32", kv_dtype="float32", all_logits=False,
                          attention=io.Attention.PLUGIN, layer_groups=groups)
        graphs[phase] = dataclasses.replace(g, inputs=gio.inputs, outputs=gio.outputs)
    model = type(m.model)({**m.model.spec, "sliding_window": 8, "layer_windows": [8, None]})
    hybrid = dataclasses.replace(m, model=model, kv=dataclasses.replace(m.kv, local_window=8), graphs=graphs)
    assert hybrid.layer_groups == groups and make_manifest().layer_groups is None
    p = tb.profile_shapes(hybrid, OPTS)["prefill"]
    assert p[io.block_tables("local")] == p[io.BLOCK_TABLES] and p[io.slot_mapping("local")] == p[io.SLOT_MAPPING]
    assert p[io.key_cache(0)] == p[io.key_cache(1)] == ShapeRange((2, 2, 16, 16), (2, 100, 16, 16), (2, 100, 16, 16))
    assert "num_blocks.local" not in tb.axis_ranges(make_manifest(), OPTS, io.Phase.PREFILL)


def test_profile_refuses_longer_context_than_the_graphs(make_manifest):
    with pytest.raises(ConfigError, match="max_seq_len 512 exceeds the graphs' 256"):
        tb.profile_shapes(make_manifest(), EngineBuildOptions(max_seq_len=512))


def test_profile_refuses_an_axis_it_does_not_know(make_manifest):
    m = make_manifest()
    g = m.graphs["decode"]
    m.graphs["decode"] = GraphEntry(g.file, (io.TensorSpec(io.INPUT_IDS, "int64", ("mystery",)),) + g.inputs[1:],
                                    g.outputs, g.bytes)
    with pytest.raises(KvExportError, match="axis 'mystery'"):
        tb.profile_shapes(m, OPTS)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (dict(max_num_blocks=1), "max_num_blocks must be >= 2"),
    (dict(opt_seq_len=0), "opt_seq_len must be >= 1"),
    (dict(precision="int8"), "precision 'int8'"),
    (dict(optimization_level=6), "optimization_level must be in 0..5"),
    (dict(workspace_bytes=0), "workspace_bytes must be >= 1"),
])
def test_options_are_validated(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineBuildOptions(**kwargs)


def test_refuses_onnx_attention_builds_before_tensorrt(make_manifest, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(ConfigError, match="--attention plugin"):
        tb.build_engines(tmp_path, make_manifest(io.Attention.ONNX))


def test_precision_must_match_the_graph_dtype(make_manifest):
    assert tb.check_buildable(make_manifest(dtype="fp16"), EngineBuildOptions()) == "fp16"
    with pytest.raises(ConfigError, match="fp16/bf16 activations.*--dtype fp16"):
        tb.check_buildable(make_manifest(dtype="fp32"), EngineBuildOptions(precision="fp16"))
    with pytest.raises(ConfigError, match="fp16/bf16 activations"):
        tb.check_buildable(make_manifest(dtype="fp32"), EngineBuildOptions())
    with pytest.raises(ConfigError, match="--dtype bf16"):
        tb.check_buildable(make_manifest(dtype="fp16"), EngineBuildOptions(precision="bf16"))


def _assert_nothing_written(build_dir: Path) -> None:
    assert sorted(p.name for p in build_dir.iterdir()) == []


def test_missing_tensorrt_says_what_to_install(make_manifest, tmp_path, monkeypatch):
    """Mock: `import tensorrt` raises ImportError, as on every machine of this project."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(TensorRTUnavailableError) as e:
        tb.build_engines(tmp_path, make_manifest(dtype="fp16"))
    msg = str(e.value)
    assert "TensorRT is not installed" in msg
    assert 'pip install "kvexport[tensorrt]"' in msg and "NVIDIA GPU" in msg and "docker/" in msg
    assert "ONNX build is complete and usable with onnxruntime" in msg
    assert isinstance(e.value, KvExportError)
    _assert_nothing_written(tmp_path)


def test_stub_only_tensorrt_is_not_mistaken_for_tensorrt(make_manifest, tmp_path, monkeypatch):
    """Mock: `import tensorrt` finds an empty namespace package (what `tensorrt-stubs`
    installed into site-packages looks like at run time)."""
    fake = types.ModuleType("tensorrt")
    fake.__path__ = ["/site-packages/tensorrt"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with pytest.raises(TensorRTUnavailableError, match="without the TensorRT bindings.*stubs"):
        tb.build_engines(tmp_path, make_manifest(dtype="fp16"))
    _assert_nothing_written(tmp_path)


def test_missing_gpu_says_what_is_missing(make_manifest, tmp_path, monkeypatch):
    """Mock: a module that passes for TensorRT, on this machine without a CUDA GPU."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    fake = types.ModuleType("tensorrt")
    fake.Builder = object  # type: ignore[attr-defined]
    fake.__version__ = "10.13.0.35"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with pytest.raises(TensorRTUnavailableError) as e:
        tb.build_engines(tmp_path, make_manifest(dtype="fp16"))
    msg = str(e.value)
    assert "need a CUDA GPU" in msg and "CPU-only build" in msg
    assert "ONNX build is complete and usable with onnxruntime" in msg
    _assert_nothing_written(tmp_path)


# ---- engines/ is replaced atomically ---------------------------------------------------------


def test_write_atomically_publishes_only_complete_results(tmp_path):
    def produce(tmp: Path) -> dict:
        assert tmp.parent == tmp_path and tmp.name.startswith(".engines.tmp-")
        (tmp / "prefill.plan").write_bytes(b"p")
        (tmp / "decode.plan").write_bytes(b"d")
        return {"ok": True}

    assert tb.write_atomically(tmp_path, produce) == {"ok": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines"]
    assert sorted(p.name for p in (tmp_path / "engines").iterdir()) == ["decode.plan", "prefill.plan"]


def test_write_atomically_failure_keeps_old_engines_and_leaves_no_temp(tmp_path):
    old = tmp_path / "engines"
    old.mkdir()
    (old / "prefill.plan").write_bytes(b"old")
    (old / "timing.cache").write_bytes(b"cache-v1")
    seen = {}

    def fail(tmp: Path) -> dict:
        seen["cache"] = (tmp / "timing.cache").read_bytes()  # the old cache is reused
        (tmp / "prefill.plan").write_bytes(b"half")
        raise KeyboardInterrupt  # also BaseException: an interrupted build

    with pytest.raises(KeyboardInterrupt):
        tb.write_atomically(tmp_path, fail)
    assert seen["cache"] == b"cache-v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines"]
    assert (old / "prefill.plan").read_bytes() == b"old"

    def ok(tmp: Path) -> dict:
        (tmp / "prefill.plan").write_bytes(b"new")
        (tmp / "timing.cache").write_bytes(b"cache-v2")
        return {}

    tb.write_atomically(tmp_path, ok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines"]
    assert (old / "prefill.plan").read_bytes() == b"new" and (old / "timing.cache").read_bytes() == b"cache-v2"


def test_kernel_configs_recorded_from_the_plugin_tile_lists():
    configs = tb._kernel_configs()
    if configs is None:
        pytest.skip("plugins/paged_attention/configs.py is not in this tree")
    assert set(configs) == {"prefill", "decode", "aot_targets"}
    tactics = [c["tactic"] for c in configs["prefill"] + configs["decode"]]
    assert tactics == list(range(1, len(tactics) + 1))
