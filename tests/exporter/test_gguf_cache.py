"""The GGUF conversion cache (exporter/gguf_cache.py): a GGUF file's config and float32 weights, read from the
cache on the second load, equal transformers' own load of the file bit for bit; a damaged cache is converted
again, an unwritable one is skipped, a file replaced in place never reads the old file's conversion, and
`off` writes nothing. A tiny qwen3_moe GGUF (testkit/gguf_files.py), float32 and Q8_0 experts."""

import logging

import pytest
import torch

from kvexport.exporter import gguf_cache, source

from testkit.gguf_files import CASES, write_moe_gguf

FAMILY = "qwen3_moe"


@pytest.fixture
def gguf_file(hf_folder, tmp_path):
    return write_moe_gguf(hf_folder(FAMILY, **CASES[FAMILY]), FAMILY, tmp_path / "m.gguf", "Q8_0")


def _direct(src, monkeypatch):
    monkeypatch.setenv(gguf_cache.CACHE_ENV, "off")
    try:
        return source.load_config(src), source.load_model(src)
    finally:
        monkeypatch.delenv(gguf_cache.CACHE_ENV)


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype == torch.float32, k
        assert torch.equal(sa[k], sb[k]), k


def test_second_load_reads_the_cache_and_equals_the_gguf_load(gguf_file, tmp_path, monkeypatch):
    src = source.resolve(str(gguf_file))
    ref_config, ref_model = _direct(src, monkeypatch)
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    assert gguf_cache.part(gguf_file, "model") is None
    source.load_config(src), source.load_model(src)  # converts, stores
    for name in ("config", "model"):
        assert gguf_cache.part(gguf_file, name) is not None, name
    assert not list(gguf_cache.entry(gguf_file).glob(".*")), "a temporary folder was left behind"
    # the second load comes from the cache: prove it by making the GGUF path unreadable to transformers' loader
    monkeypatch.setattr(source, "_from_pretrained", _refuse_gguf(source._from_pretrained))
    config, model = source.load_config(src), source.load_model(src)
    assert "quantization_config" not in config.to_dict() or config.to_dict()["quantization_config"] is None
    ref = {k: v for k, v in ref_config.to_dict().items() if k not in ("quantization_config", "transformers_version")}
    got = {k: v for k, v in config.to_dict().items() if k not in ("quantization_config", "transformers_version")}
    assert got == ref
    _same_weights(model, ref_model)


def _refuse_gguf(load):
    def guarded(src, directory, **kwargs):
        assert "gguf_file" not in kwargs, "converted again although the cache holds the model"
        return load(src, directory, **kwargs)
    return guarded


def test_damaged_cache_is_converted_again(gguf_file, tmp_path, monkeypatch, caplog):
    src = source.resolve(str(gguf_file))
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    first = source.load_model(src)
    weights = gguf_cache.part(gguf_file, "model") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with caplog.at_level(logging.WARNING):
        again = source.load_model(src)
    assert "could not be read" in caplog.text
    _same_weights(again, first)
    assert (gguf_cache.part(gguf_file, "model") / "model.safetensors").stat().st_size > 1000  # stored anew


def test_unwritable_cache_is_skipped(gguf_file, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(blocker))
    src = source.resolve(str(gguf_file))
    with caplog.at_level(logging.WARNING):
        model = source.load_model(src)
    assert "could not be written" in caplog.text and gguf_cache.CACHE_ENV in caplog.text
    assert model.config.model_type == FAMILY


def test_file_replaced_in_place_gets_its_own_entry(hf_folder, gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    before = gguf_cache.entry(gguf_file)
    write_moe_gguf(hf_folder(FAMILY, **CASES[FAMILY]), FAMILY, gguf_file, None)  # float32 experts now
    assert gguf_cache.entry(gguf_file) != before


def test_off_writes_nothing(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_cache.CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    source.load_model(source.resolve(str(gguf_file)))
    assert gguf_cache.entry(gguf_file) is None and not (tmp_path / "xdg").exists()
