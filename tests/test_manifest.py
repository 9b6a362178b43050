"""kvexport.manifest.load: a complete build loads and saves back byte for byte; a missing,
corrupt, incompatible, mistyped or incomplete build directory, or a manifest that does not
describe its graphs, raises ManifestError naming the file or field and saying how to rebuild."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from kvexport import io
from kvexport.errors import KvExportError, ManifestError
from kvexport.exporter.build import BuildOptions, build
from kvexport.manifest import Manifest, ModelEntry, ValidationEntry, WeightsEntry, load


@pytest.fixture(scope="module")
def tiny_build(hf_folder, tmp_path_factory):
    out, m = build(str(hf_folder("llama")), tmp_path_factory.mktemp("manifest") / "b",
                   BuildOptions(block_size=4, max_seq_len=64, attention=io.Attention.ONNX))
    return out, m


@pytest.fixture
def build_copy(tiny_build, tmp_path) -> Path:
    """A private copy of the tiny build, safe to damage."""
    d = tmp_path / "b"
    shutil.copytree(tiny_build[0], d)
    return d


def edit_manifest(d: Path, edit) -> None:
    path = d / io.MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_valid_build_loads(tiny_build):
    out, built = tiny_build
    m = load(out)
    assert isinstance(m, Manifest)
    assert m.to_json() == json.loads(json.dumps(built.to_json()))
    assert m.schema_version == io.SCHEMA_VERSION
    assert set(m.graphs) == {"prefill", "decode"}
    assert m.kv.block_size == 4 and m.kv.max_seq_len == 64 and m.kv.layout == io.KVLayout.PAGED.value
    assert isinstance(m.validation, ValidationEntry) and m.validation.passed
    assert isinstance(m.weights, WeightsEntry) and m.weights.bytes == (out / m.weights.file).stat().st_size
    assert isinstance(m.model, ModelEntry)
    model = m.model
    assert (model.family, model.vocab_size, model.eos_token_ids, model.sliding_window) == ("llama", 128, (2,), None)
    assert model.rotary_dim == model.head_dim  # full RoPE; partial and none below
    for rope, rot in (({"partial_rotary_factor": 0.5}, model.head_dim // 2), (None, 0)):
        assert ModelEntry({**model.spec, "rope": rope}).rotary_dim == rot
    assert m.graphs["decode"].inputs[0] == io.TensorSpec(io.INPUT_IDS, "int64", (io.NUM_SEQS,))
    assert load(str(out)) == m  # str paths too


def test_missing_manifest(build_copy):
    (build_copy / io.MANIFEST_NAME).unlink()
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert str(build_copy) in msg and io.MANIFEST_NAME in msg
    assert "not a (complete) kvexport build" in msg and "kvexport build" in msg


def test_directory_that_does_not_exist(tmp_path):
    with pytest.raises(ManifestError, match=re.escape(io.MANIFEST_NAME)):
        load(tmp_path / "nowhere")


@pytest.mark.parametrize("content", [b'{"schema_version": 1, ', b"\xff\xfe garbage", b""],
                         ids=["truncated-json", "not-utf8", "empty"])
def test_corrupt_manifest(build_copy, content):
    path = build_copy / io.MANIFEST_NAME
    path.write_bytes(content)
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert str(path) in msg and "corrupt" in msg and "kvexport build --force" in msg


def test_manifest_not_an_object(build_copy):
    (build_copy / io.MANIFEST_NAME).write_text("[1, 2]")
    with pytest.raises(ManifestError, match=r"corrupt \(not a JSON object\).*kvexport build --force"):
        load(build_copy)


@pytest.mark.parametrize("version", [io.SCHEMA_VERSION + 1, 0, "1", None])
def test_wrong_schema_version(build_copy, version):
    edit_manifest(build_copy, lambda d: d.update(schema_version=version))
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert io.MANIFEST_NAME in msg and "'schema_version'" in msg and repr(version) in msg
    assert f"reads {io.SCHEMA_VERSION}" in msg and "kvexport build --force" in msg


@pytest.mark.parametrize("edit,what", [
    (lambda d: d.pop("kv"), "'kv' is missing"),
    (lambda d: d.pop("weights"), "'weights' is missing"),
    (lambda d: d["kv"].pop("block_size"), "'kv.block_size' is missing"),
    (lambda d: d["kv"].update(surprise=1), "'kv.surprise' is not a field this kvexport knows"),
    (lambda d: d.update(graphs=["prefill.onnx"]), "'graphs' must be an object, got ['prefill.onnx']"),
    (lambda d: d.update(weights={"bytes": 1}), "'weights.file' is missing"),
    (lambda d: d.update(weights=[]), "'weights' must be an object, got []"),
    (lambda d: d.update(unknown_field=1), "'unknown_field' is not a field this kvexport knows"),
    (lambda d: d["kv"].update(block_size="4"), "'kv.block_size' must be an int, got '4'"),
    (lambda d: d["kv"].update(num_layers=True), "'kv.num_layers' must be an int, got True"),
    (lambda d: d["weights"].update(bytes=1.5), "'weights.bytes' must be an int, got 1.5"),
    (lambda d: d["validation"].update(passed="yes"), "'validation.passed' must be a boolean, got 'yes'"),
    (lambda d: d["validation"].update(prompt_lengths=[5, "x"]), "'validation.prompt_lengths[1]' must be an int"),
    (lambda d: d["validation"].update(native_op={"passed": True}), "'validation.native_op.max_abs_diff' is missing"),
    (lambda d: d["graphs"]["decode"]["inputs"][0].pop("dtype"), "'graphs.decode.inputs[0].dtype' is missing"),
    (lambda d: d["graphs"]["decode"]["inputs"][0].update(shape=[1.5]),
     "'graphs.decode.inputs[0].shape[0]' must be an int or a string, got 1.5"),
    (lambda d: d["model"].update(vocab_size="128"), "'model.vocab_size' must be an int, got '128'"),
    (lambda d: d["model"].update(eos_token_ids=2), "'model.eos_token_ids' must be a list of ints, got 2"),
    (lambda d: d["model"].pop("sliding_window"), "'model.sliding_window' is missing"),
    (lambda d: d.update(tokenizer=3), "'tokenizer' must be a string or null, got 3"),
    (lambda d: d.update(notes="one note"), "'notes' must be a list of strings, got 'one note'"),
    (lambda d: d.update(dtype="fp8"), "'dtype' is 'fp8', not one of ['fp32', 'fp16', 'bf16', 'int8', 'int4']"),
    (lambda d: d["kv"].update(layout="ring"), "'kv.layout' is 'ring', not one of ['contiguous', 'paged']"),
    (lambda d: d["kv"].update(num_layers=3), "'kv.num_layers' is 3, but 'model.num_layers' is 2"),
    (lambda d: d["kv"].update(bytes_per_token=1), "'kv.bytes_per_token' is 1, but the kv spec gives 512"),
    (lambda d: d["graphs"].pop("decode"), "'graphs' has ['prefill'], not the graphs ['decode', 'prefill']"),
], ids=["no-kv", "no-weights", "kv-no-block-size", "kv-extra", "graphs-list", "weights-no-file",
        "weights-list", "extra-field", "str-for-int", "bool-for-int", "float-for-int", "str-for-bool",
        "bad-list-item", "nested-missing", "tensor-no-dtype", "float-axis", "model-type", "model-eos-int",
        "model-missing", "optional-str", "tuple-of-str", "dtype-enum", "layout-enum", "model-vs-kv",
        "kv-bytes-formula", "graphs-missing-phase"])
def test_malformed_manifest(build_copy, edit, what):
    edit_manifest(build_copy, edit)
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert msg.startswith(f"{build_copy / io.MANIFEST_NAME}: manifest field '")
    assert what in msg and "kvexport build --force" in msg


@pytest.mark.parametrize("name", [io.DECODE_GRAPH, io.PREFILL_GRAPH])
def test_listed_graph_deleted(build_copy, name):
    (build_copy / name).unlink()
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert str(build_copy / name) in msg and "missing" in msg and "kvexport build --force" in msg


def test_weights_deleted(build_copy):
    (build_copy / io.WEIGHTS_FILE).unlink()
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert str(build_copy / io.WEIGHTS_FILE) in msg and "missing" in msg and "kvexport build --force" in msg


def test_truncated_weights(build_copy):
    f = build_copy / io.WEIGHTS_FILE
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert str(f) in msg and "truncated" in msg and "kvexport build --force" in msg
    assert str(len(data) // 2) in msg and str(len(data)) in msg


def test_manifest_error_is_a_kvexport_error():
    assert issubclass(ManifestError, KvExportError)


def test_cli_inspect_of_a_broken_build(build_copy):
    from click.testing import CliRunner

    from kvexport.cli import main

    (build_copy / io.DECODE_GRAPH).unlink()
    r = CliRunner().invoke(main, ["inspect", str(build_copy)])
    assert r.exit_code == 2, r.output
    text = re.sub(r"\s+", " ", r.output)
    assert text.startswith("error: ") and "missing" in text
    assert str(build_copy / io.DECODE_GRAPH) in re.sub(r"\s+", "", r.output)  # rich folds long paths
    assert "Traceback" not in r.output


# ---- round trip -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plugin_int8_build(hf_folder, tmp_path_factory):
    """A tiny plugin-attention build with an int8 KV cache (quantization record, native op run)."""
    from kvexport.exporter.build import BuildOptions, build

    out, _ = build(str(hf_folder("llama")), tmp_path_factory.mktemp("manifest-plugin") / "b",
                   BuildOptions(block_size=4, max_seq_len=64, attention=io.Attention.PLUGIN, kv_dtype=io.DType.INT8,
                                calibration_tokens=64))
    return out


@pytest.mark.parametrize("which", ["tiny_build", "plugin_int8_build"])
def test_manifest_written_by_the_exporter_saves_back_byte_for_byte(request, which, tmp_path):
    fixture = request.getfixturevalue(which)
    out = fixture[0] if isinstance(fixture, tuple) else fixture
    text = (out / io.MANIFEST_NAME).read_text()
    m = Manifest.from_json(json.loads(text))
    assert json.dumps(m.to_json(), indent=2) + "\n" == text
    d = tmp_path / "copy"
    shutil.copytree(out, d)
    load(d).save(d)
    assert (d / io.MANIFEST_NAME).read_text() == text


def test_engines_entry_round_trips_and_is_typed(build_copy):
    from kvexport.manifest import EngineBuildOptions, EngineFile, EngineLimits, EnginesEntry, GpuInfo, PluginInfo, \
        ShapeRange

    m = load(build_copy)
    prof = {io.INPUT_IDS: ShapeRange((1,), (8,), (8,))}
    engines = EnginesEntry(
        backend="tensorrt", tensorrt_version="10.13.0.35", gpu=GpuInfo("NVIDIA H200", "9.0"), precision="fp16",
        strongly_typed=True, tf32=False,
        engines={p: EngineFile(f"engines/{p}.plan", 4, "0" * 64, prof) for p in ("prefill", "decode")},
        timing_cache="engines/timing.cache",
        limits=EngineLimits(max_num_seqs=8, max_num_batched_tokens=64, max_seq_len=64, max_blocks_per_seq=16,
                            max_num_blocks=100),
        plugin=PluginInfo("kvexport::PagedAttention", "1", {"decode": [{"tactic": 1}]}),
        options=EngineBuildOptions(max_num_seqs=8, max_num_batched_tokens=64, max_num_blocks=100))
    dataclasses.replace(m, engines=engines).save(build_copy)
    back = load(build_copy)
    assert back.engines == engines
    assert back.engines.limits.max_num_seqs == 8 and back.engines.engines["decode"].profile[io.INPUT_IDS].max == (8,)
    written = json.loads((build_copy / io.MANIFEST_NAME).read_text())["engines"]
    profile = {"input_ids": {"min": [1], "opt": [8], "max": [8]}}
    assert list(written.items()) == list({  # the format (and key order) tensorrt_build has always written
        "backend": "tensorrt", "tensorrt_version": "10.13.0.35",
        "gpu": {"name": "NVIDIA H200", "compute_capability": "9.0"}, "precision": "fp16", "strongly_typed": True,
        "tf32": False,
        "engines": {p: {"file": f"engines/{p}.plan", "bytes": 4, "sha256": "0" * 64, "profile": profile}
                    for p in ("prefill", "decode")},
        "timing_cache": "engines/timing.cache",
        "limits": {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_seq_len": 64, "max_blocks_per_seq": 16,
                   "max_num_blocks": 100},
        "plugin": {"id": "kvexport::PagedAttention", "version": "1", "kernel_configs": {"decode": [{"tactic": 1}]}},
        "options": {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_seq_len": None, "opt_seq_len": None,
                    "max_num_blocks": 100, "precision": None, "tf32": False, "optimization_level": 3,
                    "workspace_bytes": None, "device": 0}}.items())


@pytest.mark.parametrize("edit,what", [
    (lambda e: e["limits"].update(max_num_seqs="x"), "'engines.limits.max_num_seqs' must be an int, got 'x'"),
    (lambda e: e["limits"].pop("max_num_blocks"), "'engines.limits.max_num_blocks' is missing"),
    (lambda e: e["gpu"].update(sm=90), "'engines.gpu.sm' is not a field this kvexport knows"),
    (lambda e: e["engines"]["decode"]["profile"]["input_ids"].update(max=[8, "y"]),
     "'engines.engines.decode.profile.input_ids.max[1]' must be an int, got 'y'"),
    (lambda e: e["options"].update(max_num_blocks=1), "'engines.options' is invalid: engine option max_num_blocks"),
    (lambda e: e["limits"].update(max_seq_len=65), "'engines.limits.max_seq_len' is 65, longer than the graphs'"),
], ids=["limit-type", "limit-missing", "gpu-extra", "profile-type", "options-invalid", "limit-too-long"])
def test_malformed_engines_entry(build_copy, edit, what):
    test_engines_entry_round_trips_and_is_typed(build_copy)
    edit_manifest(build_copy, lambda d: edit(d["engines"]))
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert what in msg and "rebuild the engines with `kvexport engines" in msg


# ---- the manifest against its graphs ------------------------------------------------------------


def claim(**kv):
    """An edit that makes the manifest claim other kv sizes, consistently (model entry and
    bytes per token too), so only the graphs can tell."""
    def edit(d):
        d["kv"].update(kv)
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            d["model"][name] = d["kv"][name]
        k = d["kv"]
        d["kv"]["bytes_per_token"] = io.kv_bytes_per_token(k["num_layers"], k["num_kv_heads"], k["head_dim"],
                                                           io.DType(k["dtype"]))
    return edit


@pytest.mark.parametrize("edit,what", [
    (claim(num_layers=3), "manifest field 'kv.num_layers' is 3, but prefill.onnx has KV tensors of 2 layers"),
    (claim(num_layers=1), "manifest field 'kv.num_layers' is 1, but prefill.onnx has KV tensors of 2 layers"),
    (claim(num_kv_heads=4), "manifest field 'kv.num_kv_heads' is 4, but prefill.onnx's input 'key_cache.0' "
                            "float32 [2, num_blocks, 4, 16] has 2 on that axis (0)"),
    (claim(head_dim=8), "manifest field 'kv.head_dim' is 8, but prefill.onnx's input 'key_cache.0' "
                        "float32 [2, num_blocks, 4, 16] has 16 on that axis (3)"),
    (claim(block_size=8), "manifest field 'kv.block_size' is 8, but prefill.onnx's input 'key_cache.0' "
                          "float32 [2, num_blocks, 4, 16] has 4 on that axis (2)"),
    (claim(dtype="fp16"), "manifest field 'kv.dtype' says float16, but prefill.onnx's input 'key_cache.0'"),
    (lambda d: d.update(dtype="fp16"), "manifest field 'dtype' says float16, but prefill.onnx's output 'logits'"),
    (lambda d: d["model"].update(vocab_size=100), "manifest field 'model.vocab_size' is 100, but prefill.onnx's "
                                                  "output 'logits' float32 [num_logits, 128] has 128 on that axis (1)"),
    (claim(layout="contiguous", block_size=0), "prefill.onnx has no input 'attention_mask', which a contiguous build"),
    (lambda d: d["kv"].update(attention="plugin"), "prefill.onnx has no output 'key_cache_out.0', which a paged "
                                                   "build with plugin attention has"),
    (lambda d: d["graphs"]["decode"]["inputs"][3].update(shape=["num_tokens"]),
     "manifest field 'graphs.decode.inputs' disagrees with decode.onnx at input 3: the graph has 'seq_lens' int64 "
     "[num_seqs], the manifest lists 'seq_lens' int64 [num_tokens]"),
    (lambda d: d["graphs"]["prefill"]["outputs"].pop(),
     "manifest field 'graphs.prefill.outputs' disagrees with prefill.onnx at output 6: the graph has "
     "'attention_scores.1'"),  # the last output: a paged build's attention scores (kvexport/io.py)
], ids=["3-layers", "1-layer", "4-kv-heads", "head-dim", "block-size", "kv-dtype", "act-dtype", "vocab",
        "layout", "attention", "listed-shape", "listed-missing"])
def test_manifest_that_does_not_describe_its_graphs_is_refused(build_copy, edit, what):
    edit_manifest(build_copy, edit)
    Manifest.from_json(json.loads((build_copy / io.MANIFEST_NAME).read_text()))  # consistent on its own
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert what in msg, msg
    assert "kvexport build --force" in msg
    load(build_copy, check_graphs=False)  # the cheap path still reads it


@pytest.mark.parametrize("content", [b"\x08\x07garbage\xff\xff\xff", b"", None],
                         ids=["garbage", "empty", "truncated"])
def test_corrupt_graph_file_is_a_manifest_error(build_copy, content):
    path = build_copy / io.DECODE_GRAPH
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3] if content is None else content)
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert io.DECODE_GRAPH in msg and "kvexport build --force" in msg


def test_cli_refuses_a_build_whose_manifest_lies_without_a_traceback(build_copy):
    from click.testing import CliRunner

    from kvexport.cli import main

    edit_manifest(build_copy, claim(num_kv_heads=4))
    r = CliRunner().invoke(main, ["inspect", str(build_copy)])
    assert r.exit_code == 2, r.output
    assert "'kv.num_kv_heads' is 4" in re.sub(r"\s+", " ", r.output) and "Traceback" not in r.output
