"""kvexport.manifest.load: a complete build loads; a missing, corrupt, incompatible or
incomplete build directory raises ManifestError naming the file and saying how to rebuild."""

import json
import re
import shutil
from pathlib import Path

import pytest

from kvexport import io
from kvexport.errors import KvExportError, ManifestError
from kvexport.exporter.build import BuildOptions, build
from kvexport.manifest import Manifest, load


@pytest.fixture(scope="module")
def tiny_build(hf_folder, tmp_path_factory):
    out, m = build(str(hf_folder("llama")), tmp_path_factory.mktemp("manifest") / "b",
                   BuildOptions(block_size=4, max_seq_len=64))
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
    assert m.validation["passed"]
    assert m.weights["bytes"] == (out / m.weights["file"]).stat().st_size
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
    (lambda d: d.pop("kv"), "missing field 'kv'"),
    (lambda d: d.pop("weights"), "missing field 'weights'"),
    (lambda d: d["kv"].pop("block_size"), "block_size"),
    (lambda d: d["kv"].update(surprise=1), "surprise"),
    (lambda d: d.update(graphs=["prefill.onnx"]), "list"),
    (lambda d: d.update(weights={"bytes": 1}), "'weights'"),
    (lambda d: d.update(weights=[]), "list"),
    (lambda d: d.update(unknown_field=1), "unknown_field"),
], ids=["no-kv", "no-weights", "kv-no-block-size", "kv-extra", "graphs-list", "weights-no-file",
        "weights-list", "extra-field"])
def test_malformed_manifest(build_copy, edit, what):
    edit_manifest(build_copy, edit)
    with pytest.raises(ManifestError) as e:
        load(build_copy)
    msg = str(e.value)
    assert io.MANIFEST_NAME in msg and "malformed" in msg and what in msg
    assert "kvexport build --force" in msg


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
