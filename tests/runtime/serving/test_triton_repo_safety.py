"""`kvexport triton --force` replaces only a repository kvexport wrote (its marker,
kvexport-triton.json): never the build it serves, a folder containing it, another build or
anyone's files (byte-identical after); and a repository gets the umask's permissions. The
rule's own cases: tests/test_outputs.py; the repository's content: test_triton_server.py."""

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("tritonclient.grpc")

from kvexport.cli import main  # noqa: E402
from kvexport.errors import BuildExistsError, ConfigError, OutputError  # noqa: E402
from kvexport.exporter.build import BuildOptions, build  # noqa: E402
from kvexport.outputs import TRITON_MARKER  # noqa: E402
from kvexport.runtime.serving.triton_repo import TritonRepoOptions, check_repository, write_repository  # noqa: E402

FORCE = TritonRepoOptions(name="m", force=True)


@pytest.fixture(scope="module")
def tiny_build(hf_folder, tmp_path_factory) -> Path:
    out, _ = build(str(hf_folder("llama")), tmp_path_factory.mktemp("tb") / "ws" / "tiny",
                   BuildOptions(max_seq_len=64, block_size=4, validate=False))
    return out


def _the_build(ws: Path, b: Path) -> Path:
    return b


def _its_parent(ws: Path, b: Path) -> Path:
    return b.parent


def _another_build(ws: Path, b: Path) -> Path:
    out, _ = build(str(Path(json.loads((b / "kvexport.json").read_text())["source"]["path"])), ws / "other",
                   BuildOptions(max_seq_len=32, block_size=4, validate=False))
    return out


def _folder_with_files(ws: Path, b: Path) -> Path:
    (ws / "models").mkdir()
    (ws / "models" / "llama-70b").mkdir()
    (ws / "models" / "llama-70b" / "model.plan").write_bytes(b"engine")
    return ws / "models"


def _repo_with_a_users_env(ws: Path, b: Path) -> Path:
    write_repository(b, ws / "repo", TritonRepoOptions(name="m"))
    (ws / "repo" / "m" / "python_env.tar.gz").write_bytes(b"conda-pack")  # what Triton's docs put there
    return ws / "repo"


def _file(ws: Path, b: Path) -> Path:
    (ws / "repo").write_text("not a folder")
    return ws / "repo"


REFUSED = {
    "the-build": (_the_build, "is the build"),
    "a-folder-containing-the-build": (_its_parent, "is a folder containing the build"),
    "another-build": (_another_build, "is a kvexport build, not a Triton model repository"),
    "a-folder-with-files": (_folder_with_files, "a folder holding 'llama-70b'"),
    "a-repo-holding-a-users-file": (_repo_with_a_users_env, "'m/python_env.tar.gz'"),
    "a-file": (_file, "a file (12 bytes)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_even_with_force(tiny_build, tmp_path, snapshot, case):
    make, words = REFUSED[case]
    out = make(tmp_path, tiny_build)
    before, build_before = snapshot(tmp_path), snapshot(tiny_build.parent)
    for copy in (False, True):
        with pytest.raises(OutputError) as e:
            write_repository(tiny_build, out, TritonRepoOptions(name="m", force=True, copy_build=copy))
        assert words in str(e.value) and "--out" in str(e.value)
    r = CliRunner().invoke(main, ["triton", str(tiny_build), "--out", str(out), "--force"])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert snapshot(tmp_path) == before and snapshot(tiny_build.parent) == build_before


def test_an_earlier_repository_is_replaced_with_force(tiny_build, tmp_path):
    repo = tmp_path / "repo"
    write_repository(tiny_build, repo, TritonRepoOptions(name="a", copy_build=True))
    weights = [p for p in (repo / "a").rglob("weights.data")]
    assert weights and all(p.stat().st_nlink == 1 for p in weights)  # copies: onnx's checker refuses hard links
    (repo / "a" / "1" / "__pycache__").mkdir()  # Python's, after Triton imported model.py
    with pytest.raises(BuildExistsError, match="--force"):
        write_repository(tiny_build, repo, TritonRepoOptions(name="b"))
    write_repository(tiny_build, repo, TritonRepoOptions(name="b", force=True))
    assert check_repository(repo) == ["b"] and sorted(p.name for p in repo.iterdir()) == ["b", TRITON_MARKER]
    marker = json.loads((repo / TRITON_MARKER).read_text())
    assert marker["models"] == ["b"] and marker["entries"] == {"b": "dir", "b/1": "dir", "b/1/model.py": "file",
                                                                 "b/config.pbtxt": "file"}


def test_inside_the_build_is_fine_and_replaced_with_force(tiny_build, tmp_path):
    """A repository inside the build, BUILD/triton/; the build is then still replaceable by `build --force`."""
    import shutil

    b = tmp_path / "b"
    shutil.copytree(tiny_build, b)
    write_repository(b, b / "triton", TritonRepoOptions(name="m", copy_build=True))
    write_repository(b, b / "triton", TritonRepoOptions(name="m", copy_build=True, force=True))
    assert check_repository(b / "triton") == ["m"]
    source = json.loads((b / "kvexport.json").read_text())["source"]["path"]
    build(source, b, BuildOptions(max_seq_len=32, block_size=4, validate=False, force=True))
    assert not (b / "triton").exists()


@pytest.mark.parametrize("mask, dirs, files", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)], ids=["022", "077"])
def test_permissions_follow_the_umask(tiny_build, tmp_path, mask, dirs, files):
    saved = os.umask(mask)
    try:
        write_repository(tiny_build, tmp_path / "new" / "repo", TritonRepoOptions(name="m"))
    finally:
        os.umask(saved)
    wrong = {}
    for d, _, names in os.walk(tmp_path / "new"):
        for p in [d] + [f"{d}/{n}" for n in names]:
            if stat.S_IMODE(os.stat(p).st_mode) != (dirs if os.path.isdir(p) else files):
                wrong[p] = oct(stat.S_IMODE(os.stat(p).st_mode))
    assert wrong == {}
    assert {"config.pbtxt", "1"} <= set(os.listdir(tmp_path / "new" / "repo" / "m"))


def test_without_tritonclient_the_error_names_the_extra(tiny_build, tmp_path, monkeypatch):
    """`pip install .` without the triton extra: a ConfigError saying what to install, nothing written."""
    import sys

    monkeypatch.setitem(sys.modules, "tritonclient.grpc", None)  # import now raises ImportError
    with pytest.raises(ConfigError, match=r"kvexport\[triton\]"):
        write_repository(tiny_build, tmp_path / "repo", TritonRepoOptions())
    assert not (tmp_path / "repo").exists()
