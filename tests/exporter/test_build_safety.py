"""`kvexport build` never deletes what is not an earlier build of its own: refusals through
the library and the CLI (everything byte-identical after), SIGTERM and SIGKILL of a real
`kvexport build` process, and the permissions of everything a build writes. The rule's own
cases (links, fifos, names, stale folders): tests/test_outputs.py."""

import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvexport import outputs
from kvexport.cli import main
from kvexport.errors import BuildExistsError, OutputError
from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.manifest import load

FAST = BuildOptions(block_size=4, max_seq_len=64, validate=False)
FORCE = dataclasses.replace(FAST, force=True)


@pytest.fixture(scope="module")
def model(hf_folder, tmp_path_factory) -> Path:
    """A tiny llama with a word-level tokenizer (so builds write tokenizer/ too), in a folder
    of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("src") / "model"
    shutil.copytree(hf_folder("llama"), d)
    tok = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(3, 128)}, "<unk>": 0, "<s>": 1, "</s>": 2},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(d)
    return d


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# ---- refused, with or without --force -----------------------------------------------------------


def _foreign(ws: Path, model: Path) -> Path:
    (ws / "out").mkdir()
    (ws / "out" / "thesis.tex").write_text("years of work")
    return ws / "out"


def _file(ws: Path, model: Path) -> Path:
    (ws / "out").write_bytes(b"\x00data")
    return ws / "out"


def _source(ws: Path, model: Path) -> Path:
    return model


def _source_parent(ws: Path, model: Path) -> Path:
    return model.parent


def _source_link(ws: Path, model: Path) -> Path:
    (ws / "link").symlink_to(model)
    return ws / "link"


def _source_subfolder(ws: Path, model: Path) -> Path:
    (model / "extra").mkdir(exist_ok=True)
    (model / "extra" / "README").write_text("notes")
    return model / "extra"


REFUSED = {
    "folder-with-files": (_foreign, "a folder holding 'thesis.tex', not a kvexport build"),
    "file": (_file, "a file (5 bytes), not a kvexport build"),
    "the-source": (_source, "is the model source"),
    "the-source's-parent": (_source_parent, "is a folder containing the model source"),
    "a-link-to-the-source": (_source_link, "is the model source"),
    "a-folder-inside-the-source": (_source_subfolder, "a folder holding 'README'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_even_with_force(model, tmp_path, snapshot, case):
    make, words = REFUSED[case]
    out = make(tmp_path, model)
    before, src_before = snapshot(tmp_path), snapshot(model.parent)
    with pytest.raises(OutputError) as e:
        build(str(model), out, FORCE)
    assert words in str(e.value) and "choose another --out" in str(e.value)
    assert snapshot(tmp_path) == before and snapshot(model.parent) == src_before
    r = CliRunner().invoke(main, ["build", str(model), "--out", str(out), "--force", "--no-validate"])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "error:" in r.output and "Traceback" not in r.output
    assert snapshot(tmp_path) == before and snapshot(model.parent) == src_before


def test_the_alias_models_own_files_are_refused(tmp_path):
    import importlib.metadata

    package, rel, _ = source.ALIASES["smollm2-135m"]
    try:
        gguf = Path(str(importlib.metadata.distribution(package).locate_file(rel)))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{package} is not installed")
    before = (sorted(os.listdir(gguf.parent)), gguf.stat().st_size, gguf.stat().st_mtime_ns)
    # its folder, the installed package (a source file at --out: tests/test_outputs.py's "file")
    with pytest.raises(OutputError, match="is the model source"):
        build("smollm2-135m", gguf.parent, FORCE)
    assert (sorted(os.listdir(gguf.parent)), gguf.stat().st_size, gguf.stat().st_mtime_ns) == before


def test_markup_characters_in_the_message(model, tmp_path):
    out = tmp_path / "a[" / "x] [bold]"  # the path reads ".../a[/x] [bold]": rich markup, if not escaped
    out.mkdir(parents=True)
    (out / "[red]").write_text("x")
    r = CliRunner().invoke(main, ["build", str(model), "--out", str(out), "--force", "--no-validate"])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "a[/x] [bold]" in r.output and "'[red]'" in r.output


# ---- replaced -------------------------------------------------------------------------------------


def test_an_earlier_build_is_replaced_with_force(model, tmp_path):
    out = tmp_path / "out"
    build(str(model), out, FAST)
    with pytest.raises(BuildExistsError, match="--force"):
        build(str(model), out, dataclasses.replace(FAST, max_seq_len=32))
    r = CliRunner().invoke(main, ["build", str(model), "--out", str(out), "--force", "--no-validate",
                                  "--max-seq-len", "32", "--block-size", "4"])
    assert r.exit_code == 0, r.output
    assert load(out).kv.max_seq_len == 32 and leftovers(out) == []


# ---- signals ----------------------------------------------------------------------------------------


def _start(model: Path, out: Path) -> subprocess.Popen:
    """`kvexport build` as its own process, validating (so it runs for seconds)."""
    return subprocess.Popen([sys.executable, "-m", "kvexport.cli", "build", str(model), "--out", str(out), "--force",
                             "--max-seq-len", "64", "--block-size", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _owned(out: Path) -> bool:
    """Whether a temporary folder of `out` exists with its owner file written. NOTE: the folder
    exists a moment before the file (mkdir, then the write): a SIGKILL in between leaves a folder
    no later run may remove (nothing says whose it is): a full test run once killed in between."""
    for name in leftovers(out):
        try:
            json.loads((out.parent / name / outputs.OWNER_FILE).read_text())
            return True
        except (OSError, ValueError):
            continue
    return False


def _wait_for_temp(p: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 120
    while not _owned(out):
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "the build never made its temporary folder"
        time.sleep(0.01)


def test_sigterm_removes_the_temp_folder_and_keeps_the_old_build(model, tmp_path, snapshot):
    out = tmp_path / "out"
    build(str(model), out, FAST)
    before = snapshot(tmp_path)
    p = _start(model, out)
    try:
        _wait_for_temp(p, out)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "terminated" in err and "Traceback" not in err
    assert leftovers(out) == [] and snapshot(tmp_path) == before


def test_after_sigkill_the_next_build_removes_the_temp_folder(model, tmp_path):
    out = tmp_path / "out"
    p = _start(model, out)
    try:
        _wait_for_temp(p, out)
        p.kill()
    finally:
        p.communicate(timeout=60)
    assert len(leftovers(out)) == 1 and not out.exists()  # SIGKILL cannot be caught
    build(str(model), out, FAST)
    assert leftovers(out) == [] and load(out).tokenizer == "tokenizer"


# ---- permissions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mask, dirs, files", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)], ids=["022", "077"])
def test_everything_a_build_writes_follows_the_umask(model, tmp_path, mask, dirs, files):
    saved = os.umask(mask)
    try:
        out, _ = build(str(model), tmp_path / "new" / "out", FAST)
    finally:
        os.umask(saved)
    modes = {}
    for d, subdirs, names in os.walk(tmp_path / "new"):
        modes[d] = stat.S_IMODE(os.stat(d).st_mode)
        modes.update({f"{d}/{n}": stat.S_IMODE(os.stat(f"{d}/{n}").st_mode) for n in names})
    assert {"tokenizer", "samples", "kvexport.json", "weights.data"} <= set(os.listdir(out))
    wrong = {p: oct(m) for p, m in modes.items() if m != (dirs if os.path.isdir(p) else files)}
    assert wrong == {}
