"""`kvexport calibrate` writes the way builds do (exporter/calibrate.py, kvexport/outputs.py
rewrite_dir): a real `kvexport calibrate` subprocess stopped by SIGINT or SIGTERM after it
wrote a new graph leaves the build byte for byte as it was, and no temporary folder; a run
to the end swaps in graphs and manifest that agree, and the weights are shared, not copied (a
build named by a symbolic link: the folder it names is rewritten, the link kept). A
calibrate without validation records it as not run (and `kvexport inspect` says so), never the
old PASS. `--text` on a huge or sparse file reads only what the token budget needs."""

import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from kvexport import io
from kvexport.cli import main
from testkit.text import byte_bpe
from kvexport.exporter import calibrate as cal
from kvexport.exporter.build import BuildOptions, build
from kvexport.manifest import load


@pytest.fixture(scope="module")
def int8(hf_folder, tmp_path_factory):
    """(source folder, validated int8 build) of a tiny random llama."""
    src = str(hf_folder("llama"))
    out, m = build(src, tmp_path_factory.mktemp("cal") / "int8",
                   BuildOptions(kv_dtype=io.DType.INT8, max_seq_len=64, calibration_tokens=256, validate_steps=1))
    assert m.validation.passed
    return src, out


def _graph_scales(path):
    g = onnx.load(str(path), load_external_data=False)
    return onnx.numpy_helper.to_array(next(t for t in g.graph.initializer if t.name == io.v_scale(0)))


def _new_graph_in_temp(out):
    """A temporary sibling of the build holding a rewritten prefill graph (a new file, one link)."""
    for e in os.scandir(out.parent):
        if e.name.startswith(f".{out.name}.tmp-"):
            p = os.path.join(e.path, io.PREFILL_GRAPH)
            try:
                if os.stat(p).st_nlink == 1:
                    return True
            except FileNotFoundError:
                pass
    return False


def test_interrupted_calibrate_leaves_the_build_as_it_was(int8, tmp_path, snapshot):
    """SIGINT and SIGTERM, each to its own `kvexport calibrate` (run side by side: most of their
    time is starting Python and loading the model)."""
    import shutil

    src, built = int8
    runs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        out = tmp_path / sig.name / "b"
        shutil.copytree(built, out)
        proc = subprocess.Popen([sys.executable, "-m", "kvexport.cli", "calibrate", str(out), "--tokens", "128",
                                 "--model", src], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        runs[sig] = (out, snapshot(out), proc)
    deadline = time.monotonic() + 300
    waiting = dict(runs)
    while waiting:
        for sig, (out, _, proc) in list(waiting.items()):
            if _new_graph_in_temp(out):  # NOTE: the hook: the new graph is written, validation follows
                proc.send_signal(sig)
                del waiting[sig]
            else:
                assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "calibrate never started rewriting"
        time.sleep(0.002)
    for sig, (out, before, proc) in runs.items():
        log = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 128 + sig, log
        assert snapshot(out) == before  # the old graphs, manifest and scales, untouched
        assert sorted(os.listdir(out.parent)) == ["b"]  # no temporary folder left
        assert os.stat(out / io.WEIGHTS_FILE).st_nlink == 1


def test_calibrate_swaps_in_a_whole_new_build(int8, tmp_path):
    import shutil

    src, built = int8
    out = tmp_path / "b"
    shutil.copytree(built, out)
    old = np.array(load(out).kv.quantization["scales"], np.float32)
    weights = os.stat(out / io.WEIGHTS_FILE).st_ino
    r = CliRunner().invoke(main, ["calibrate", str(out), "--tokens", "64", "--model", src, "--no-validate"])
    assert r.exit_code == 0, r.output
    m = load(out)
    new = np.array(m.kv.quantization["scales"], np.float32)
    assert not np.array_equal(old, new)
    for graph in (io.PREFILL_GRAPH, io.DECODE_GRAPH):  # graphs and manifest from the same run
        np.testing.assert_array_equal(_graph_scales(out / graph), new[0, 1])
    assert os.stat(out / io.WEIGHTS_FILE).st_ino == weights  # linked into the new build, not copied
    assert os.stat(out / io.WEIGHTS_FILE).st_nlink == 1 and sorted(os.listdir(tmp_path)) == ["b"]
    # (b) validation not run for these scales: no verdict of the old ones, a note, inspect says so
    assert m.validation is None and any(n.startswith(cal.UNVALIDATED_NOTE) for n in m.notes)
    shown = CliRunner().invoke(main, ["inspect", str(out)])
    assert shown.exit_code == 0 and "validation: not run" in shown.output and "PASS" not in shown.output
    assert "recalibrated without validation" in shown.output
    link = tmp_path / "link"  # a build named by a symbolic link: the folder is rewritten, the link kept
    link.symlink_to(out)
    m = cal.calibrate(link, tokens=32, model_source=src, validate=False)
    assert link.is_symlink() and m.kv.quantization["calibration"]["tokens"] == 32
    assert load(out).kv.quantization["calibration"]["tokens"] == 32 and sorted(os.listdir(tmp_path)) == ["b", "link"]


def test_text_reads_only_what_the_budget_needs(tmp_path):
    hamlet = cal.default_text()
    tok = byte_bpe(hamlet.read_text()[:30_000])
    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as f:  # 64 GiB, a few KiB of it real text
        f.truncate(64 << 30)
        f.seek(int((64 << 30) * 0.05))
        f.write(("To be, or not to be, that is the question.\n" * 200).encode())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.monotonic()
    ids = cal.calibration_ids(tok, 400, sparse, 512)
    assert len(ids) == 512 and time.monotonic() - t < 60
    assert tok.decode(ids[:11]) == "To be, or not to be, that is the question."[:len(tok.decode(ids[:11]))]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 512 << 10  # KiB: far below the file
    big = tmp_path / "big.txt"  # over READ_CHARS: read in pieces, the same leading ids as the whole text
    big.write_text(hamlet.read_text().encode("ascii", "ignore").decode() * 12)  # ASCII: bytes = characters
    assert big.stat().st_size > cal.READ_CHARS
    whole = tok(cal.read_text(big)[:300_000], add_special_tokens=False)["input_ids"]  # far past the budget
    assert cal.calibration_ids(tok, 400, big, 2048) == whole[:2048]
    # a text that fits one read: exactly the ids (so the scales) of before
    assert cal.calibration_ids(tok, 400, hamlet, 2048) == \
        tok(cal.read_text(hamlet), add_special_tokens=False)["input_ids"][:2048]
