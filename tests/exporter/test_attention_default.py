"""Paged builds default to `--attention plugin` (what the runtime serves fastest on CPU, the
only form TensorRT builds); where the native CPU op cannot serve the graphs (not built, fp16
activations or KV) they fall back to `onnx` with a warning and a manifest note saying why.
An explicit `--attention` is always kept."""

import logging

import pytest

from kvexport import io
from kvexport.cli import main
from kvexport.exporter.build import BuildOptions, build, default_attention
from kvexport.manifest import load
from kvexport.plugins.paged_attention import native

OPTS = dict(block_size=4, max_seq_len=32, validate=False)


@pytest.fixture
def no_native_op(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)


def test_the_default_is_decided_per_layout_and_backend():
    assert BuildOptions().attention is None  # paged: decided at build time (default_attention)
    assert BuildOptions(layout=io.KVLayout.CONTIGUOUS).attention is io.Attention.ONNX
    assert BuildOptions(backend="tensorrt", dtype=io.DType.FP16).attention is io.Attention.PLUGIN


def test_paged_build_defaults_to_the_plugin(hf_folder, tmp_path, cpu_op):
    opts, note = default_attention(BuildOptions(**OPTS))
    assert opts.attention is io.Attention.PLUGIN and note is None
    _, m = build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(**OPTS))
    assert m.kv.attention == "plugin" and not any(n.startswith("attention onnx") for n in m.notes)


def test_without_the_native_op_the_default_falls_back_to_onnx(hf_folder, tmp_path, no_native_op, caplog):
    with caplog.at_level(logging.WARNING, logger="kvexport.exporter.build"):
        _, m = build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(**OPTS))
    assert m.kv.attention == "onnx"
    note = [n for n in m.notes if n.startswith("attention onnx, not the default plugin")]
    assert len(note) == 1 and "native CPU PagedAttention op is not built" in note[0], m.notes
    assert "scripts/build_cpu_ops.sh" in note[0] and "--attention plugin" in note[0]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == note


def test_fp16_builds_fall_back_to_onnx(cpu_op):
    for kw in (dict(dtype=io.DType.FP16), dict(kv_dtype=io.DType.FP16)):
        opts, note = default_attention(BuildOptions(**kw, **OPTS))
        assert opts.attention is io.Attention.ONNX and "takes float32 activations with float32/int8/int4 KV" in note
    opts, note = default_attention(BuildOptions(kv_dtype=io.DType.INT8, **OPTS))
    assert opts.attention is io.Attention.PLUGIN and note is None


@pytest.mark.parametrize("attention", list(io.Attention))
def test_an_explicit_attention_is_kept(no_native_op, attention):
    opts, note = default_attention(BuildOptions(attention=attention, **OPTS))
    assert opts.attention is attention and note is None


def test_cli_shows_the_fallback(hf_folder, tmp_path, no_native_op):
    from click.testing import CliRunner

    out = tmp_path / "b"
    r = CliRunner().invoke(main, ["build", str(hf_folder("llama")), "--out", str(out), "--no-validate",
                                  "--max-seq-len", "32", "--block-size", "4"])
    assert r.exit_code == 0, r.output
    assert load(out).kv.attention == "onnx"
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert "attention onnx" in r.output and "note: attention onnx, not the default plugin" in r.output


def test_plugin_without_the_native_op_validates_with_the_reference_op(hf_folder, tmp_path, no_native_op):
    _, m = build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(attention=io.Attention.PLUGIN, block_size=4,
                                                                        max_seq_len=64))
    v = m.validation
    assert v.passed and v.op == "reference" and v.cross_check is None and (v.prompts, v.steps) == (4, 16), v
