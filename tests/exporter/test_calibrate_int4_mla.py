"""`kvexport calibrate` of the builds whose calibrated KV constants are not int8 KV scales
(exporter/calibrate.py): an int4 build's key transform (kv_offsets.{i}.key / .key_scale /
.query_scale, paged and contiguous) and an int8 MLA build's latent scales (kv_scales.{i}.latent,
deepseek_v3). Tiny random models with a small BPE tokenizer, so `--text` is really read: built on
Hamlet, recalibrated on King Lear, their graphs' constants and manifest record equal those of a
fresh build on King Lear, validation is recorded and passes, and the build still serves. An
interrupted int4 calibrate leaves the build as it was (the shared path: rewrite_dir,
tests/exporter/test_calibrate_atomic.py has the signals), and one without validation records it
as not run (the CLI); refused, naming what to do: float KV,
an int4 build from before the key transform, and a transform that needs a constant the graphs
have no node for (the key offset of a layer built with μ = 0; channel scales always have theirs)."""

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from kvexport import LLM, SamplingParams, io
from kvexport.cli import main
from kvexport.errors import ConfigError, KvExportError
from kvexport.exporter import calibrate as cal
from kvexport.exporter import kv_int4
from kvexport.exporter.build import BuildOptions, build
from kvexport.manifest import load
from testkit.families import tiny_config
from testkit.text import byte_bpe




VOCAB = 512  # the model's; the tokenizer's 400 ids fit
INT4 = BuildOptions(kv_dtype=io.DType.INT4, attention=io.Attention.ONNX, block_size=4, max_seq_len=64,
                    calibration_tokens=256, validate_steps=4)
MLA = replace(INT4, kv_dtype=io.DType.INT8)


@pytest.fixture(scope="module")
def texts():
    return cal.default_text(cal.CALIBRATION_TEXT), cal.default_text(cal.EVALUATION_TEXT)  # Hamlet, King Lear


@pytest.fixture(scope="module")
def folders(hf_folder, texts, tmp_path_factory):
    """family -> a tiny random model folder with a BPE tokenizer trained on both texts."""
    tok = byte_bpe("".join(t.read_text()[:20_000] for t in texts))
    cache = {}

    def get(family):
        if family not in cache:
            d = tmp_path_factory.mktemp(f"{family}-tok")
            if family == "deepseek_v3":
                import torch
                from transformers import AutoModelForCausalLM

                torch.manual_seed(0)
                config = tiny_config(family, vocab_size=VOCAB)
                AutoModelForCausalLM.from_config(config).save_pretrained(d, safe_serialization=True)
            else:  # head_dim 32: int4's group
                shutil.copytree(hf_folder(family, vocab_size=VOCAB, hidden_size=128, num_attention_heads=4,
                                          num_key_value_heads=2), d, dirs_exist_ok=True)
            tok.save_pretrained(d)
            cache[family] = str(d)
        return cache[family]

    return get


def _inits(path: Path, prefix: str) -> dict:
    g = onnx.load(str(path), load_external_data=False)
    return {t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer if t.name.startswith(prefix)}


def _same_constants(a: Path, b: Path, manifest, prefix: str) -> int:
    """Every graph of build `a` holds build `b`'s `prefix`* initializers, bit for bit; returns how many."""
    for entry in manifest.graphs.values():
        x, y = _inits(a / entry.file, prefix), _inits(b / entry.file, prefix)
        assert sorted(x) == sorted(y) and x, (sorted(x), sorted(y))
        for name in x:
            np.testing.assert_array_equal(x[name], y[name], err_msg=name)
    return len(x)


def _serves(out: Path) -> None:
    got = LLM(out, kv_cache_memory="1MiB").generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(got[0].token_ids) == 4


@pytest.mark.parametrize("layout", [io.KVLayout.PAGED, io.KVLayout.CONTIGUOUS])
def test_int4_key_transform_recalibrated_is_a_fresh_builds(folders, texts, tmp_path, layout):
    hamlet, lear = texts
    src = folders("llama")
    out, old = build(src, tmp_path / "b", replace(INT4, layout=layout, calibration_text=str(hamlet), validate=False))
    fresh, new = build(src, tmp_path / "fresh", replace(INT4, layout=layout, calibration_text=str(lear),
                                                        validate=False))
    before = _inits(out / io.DECODE_GRAPH, "kv_offsets.")
    m = cal.calibrate(out, lear, tokens=256)  # the source model the manifest records
    assert m.kv.quantization == new.kv.quantization != old.kv.quantization
    entry = m.kv.quantization["key_transform"]
    assert entry["calibration"]["text"] == "lear.txt" and entry["layers_without_offset"] == []
    # μ, s and q's s of both layers, in every graph (prefill and decode)
    assert _same_constants(out, fresh, m, "kv_offsets.") == 2 * 3
    after = _inits(out / io.DECODE_GRAPH, "kv_offsets.")
    assert all(not np.array_equal(before[n], after[n]) for n in after)  # Hamlet's are gone
    assert m.validation is not None and m.validation.passed, m.validation
    assert load(out) == m and not any(cal.UNVALIDATED in n for n in m.notes)
    if layout is io.KVLayout.PAGED:
        _serves(out)
    # what a plan reserves outside the pool for them (io.kv_static_bytes) is what a graph holds
    held = sum(a.nbytes for a in after.values())
    assert held == io.kv_static_bytes(2, 2, 32, io.DType.INT4, num_heads=4) == 2 * (2 * 2 + 4) * 32 * 4


def test_int8_latent_scales_recalibrated_are_a_fresh_builds(folders, texts, tmp_path):
    hamlet, lear = texts
    src = folders("deepseek_v3")
    out, old = build(src, tmp_path / "b", replace(MLA, calibration_text=str(hamlet), validate=False))
    fresh, new = build(src, tmp_path / "fresh", replace(MLA, calibration_text=str(lear), validate=False))
    m = cal.calibrate(out, lear, tokens=256)
    assert m.kv.quantization == new.kv.quantization != old.kv.quantization
    assert m.kv.quantization["calibration"]["text"] == "lear.txt"
    assert _same_constants(out, fresh, m, "kv_scales.") == 2  # kv_scales.{0,1}.latent [L + R]
    assert m.validation is not None and m.validation.passed, m.validation
    assert cal.describe(m).startswith("int8 latent KV scales from 256 tokens of lear.txt")
    _serves(out)


def test_interrupted_int4_calibrate_leaves_the_build(folders, texts, tmp_path, snapshot, monkeypatch):
    """Stopped after the new graphs are written (in validation): the old build, whole; no temp folder."""
    from kvexport.exporter import validate

    out, _ = build(folders("llama"), tmp_path / "b", replace(INT4, calibration_text=str(texts[0]), validate=False))
    before = snapshot(out)

    def stop(build_dir, *a, **k):
        name = io.k_offset(0)  # the new graphs are written
        new, old = (_inits(d / io.DECODE_GRAPH, name)[name] for d in (build_dir, out))
        assert not np.array_equal(new, old)
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "validate", stop)
    with pytest.raises(KeyboardInterrupt):
        cal.calibrate(out, texts[1], tokens=256)
    assert snapshot(out) == before and sorted(os.listdir(tmp_path)) == ["b"]
    # run to the end without validation (the CLI): recorded as not run, with the note
    monkeypatch.undo()
    r = CliRunner().invoke(main, ["calibrate", str(out), "--text", str(texts[1]), "--tokens", "64", "--no-validate"])
    assert r.exit_code == 0, r.output
    assert "int4 KV key transform from 64 tokens of lear.txt (int4-q4_0-g32-f16-hadamard)" in r.output
    m = load(out)
    assert m.validation is None
    assert f"int4 KV key transform {cal.UNVALIDATED} (kvexport calibrate --no-validate)" in m.notes


def test_refusals(folders, texts, tmp_path, monkeypatch):
    src = folders("llama")
    f32, _ = build(src, tmp_path / "f32", BuildOptions(block_size=4, max_seq_len=64, validate=False))
    with pytest.raises(ConfigError, match=r"stores its KV cache as fp32.*--kv-dtype int8` \(or int4\)"):
        cal.calibrate(f32)
    # an int4 build from before the key transform: nothing calibrated in it
    out, m = build(src, tmp_path / "b", replace(INT4, validate=False))
    d = json.loads((out / io.MANIFEST_NAME).read_text())
    d["kv"]["quantization"].pop("key_transform")
    old = tmp_path / "old"
    shutil.copytree(out, old)
    (old / io.MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="made before the int4 key transform.*--kv-dtype int4 --force"):
        cal.calibrate(old)
    # a build whose layer 1 had μ = 0 (no Sub node; builds made before s's nodes were always
    # written also lack those where s was 1): a transform that needs one is refused
    real = kv_int4.calibrate_transform

    def flat(*a, **k):
        t = real(*a, **k)
        v = t.values.copy()
        v[1, 0] = 0.0
        v[0, 1] = 1.0  # s = 1: its nodes are written all the same (exact), so calibrate can set them
        return replace(t, values=v)

    monkeypatch.setattr(kv_int4, "calibrate_transform", flat)
    flat_out, _ = build(src, tmp_path / "flat", replace(INT4, validate=False))
    names = _inits(flat_out / io.DECODE_GRAPH, "kv_offsets.")
    assert io.k_offset(1) not in names and (names[io.k_channel_scale(0)] == 1).all()
    monkeypatch.setattr(kv_int4, "calibrate_transform", real)
    before = (flat_out / io.MANIFEST_NAME).read_bytes()
    with pytest.raises(KvExportError, match=r"needs kv_offsets\.1\.key, .*calibrate writes constants, not nodes"):
        cal.calibrate(flat_out, texts[1], tokens=64)
    assert (flat_out / io.MANIFEST_NAME).read_bytes() == before
