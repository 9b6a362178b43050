"""`kvexport calibrate` / `build --kv-dtype int8|int4` on hostile calibration texts and sources
(exporter/calibrate.py; issue 31 §7): a FIFO or a device (/dev/zero: endless) as the text is
refused at once naming the option (it waited forever on the FIFO, and read /dev/zero until memory
ran out), a directory, a missing or unreadable path too (bare IsADirectoryError / FileNotFoundError
from the Python API before); a text with too few tokens names --tokens and the most it can give;
a source model whose activations overflow (inf / NaN keys) is refused before anything is written
(NaN scales were written into the graphs). Real tokenizers (a byte-level BPE), a real int8 build
and calibrate run; bench/hostile_trial.py runs the whole trial."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import onnx
import pytest
import torch

from kvexport import io
from kvexport.errors import ConfigError, KvExportError
from kvexport.exporter import calibrate as cal
from testkit.text import byte_bpe

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n" * 20


@pytest.fixture(scope="module")
def tok():
    return byte_bpe(TEXT)


def _ids(tok, path, tokens=32, option="--text"):
    """calibration_ids in a thread: a hang is a failure, not a stuck test run."""
    out: dict = {}

    def run():
        try:
            out["ids"] = cal.calibration_ids(tok, 400, path, tokens, option=option)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # let the reader of a FIFO go
        os.close(fd)
        pytest.fail(f"reading {path} did not return in 30 s")
    if "e" in out:
        raise out["e"]
    return out["ids"]


def test_texts_that_are_not_regular_files_are_refused_by_option(tok, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"--text .*fifo is a FIFO, not a text file.*give a UTF-8 text file"):
        _ids(tok, fifo)
    with pytest.raises(ConfigError, match=r"--calibration-text /dev/zero is a device"):
        _ids(tok, "/dev/zero", option="--calibration-text")
    with pytest.raises(ConfigError, match=r"--text .* is a directory"):
        _ids(tok, tmp_path)
    with pytest.raises(ConfigError, match=r"--text .*missing.txt cannot be read \(No such file or directory\)"):
        _ids(tok, tmp_path / "missing.txt")
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "gone.txt")
    with pytest.raises(ConfigError, match=r"--text .*dangling.txt cannot be read"):
        _ids(tok, dangling)
    good = tmp_path / "good.txt"
    good.write_text(TEXT)
    link = tmp_path / "link.txt"
    link.symlink_to(good)
    assert _ids(tok, link) == _ids(tok, good)  # a symlink to a text is a text


def test_too_few_tokens_names_the_fix(tok, tmp_path):
    empty, one = tmp_path / "empty.txt", tmp_path / "one.txt"
    empty.write_bytes(b"")
    one.write_text("x" * 3)
    with pytest.raises(ConfigError, match=r"--text .*empty.txt has 0 tokens .*fewer than the 32 --tokens asks for: "
                                          r"give a longer text$"):
        _ids(tok, empty)
    n = len(cal.leading_ids(tok, one, 1000))
    with pytest.raises(ConfigError, match=rf"fewer than the 32 --calibration-tokens .*lower --calibration-tokens "
                                          rf"to <= {n}"):
        _ids(tok, one, option="--calibration-text")


def test_binary_and_invalid_utf8_texts_calibrate(tok, tmp_path):
    """Not text, but readable: replacement characters, tokenized like any other text."""
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)) + b"\x80\xbf" * 100)
    assert len(_ids(tok, junk)) == 32


@pytest.fixture(scope="module")
def int8_build(hf_folder, tmp_path_factory):
    from kvexport.exporter.build import BuildOptions, build

    src = hf_folder("llama")
    out, _ = build(str(src), tmp_path_factory.mktemp("hostile") / "int8",
                   BuildOptions(kv_dtype=io.DType.INT8, max_seq_len=32, validate=False, calibration_tokens=64))
    return src, out


def test_a_source_whose_activations_overflow_is_refused_before_writing(int8_build, tmp_path):
    from safetensors.torch import load_file, save_file

    src, out = int8_build
    poisoned = tmp_path / "poisoned"
    shutil.copytree(src, poisoned)
    weights = poisoned / "model.safetensors"
    w = load_file(str(weights))
    emb = next(k for k in w if k.endswith("embed_tokens.weight"))
    w[emb] = torch.full_like(w[emb], torch.inf)  # every hidden state inf: NaN keys (inf * rsqrt(inf) = inf * 0)
    save_file(w, str(weights), metadata={"format": "pt"})
    before = (out / io.PREFILL_GRAPH).read_bytes(), (out / io.MANIFEST_NAME).read_bytes()
    with pytest.raises(KvExportError, match=r"int8 KV scales calibrated on random-ids are not finite "
                                            r"\(kv_scales\.0\.key.*--model.*nothing was written"):
        cal.calibrate(out, tokens=64, model_source=str(poisoned), validate=False)
    assert ((out / io.PREFILL_GRAPH).read_bytes(), (out / io.MANIFEST_NAME).read_bytes()) == before
    g = onnx.load(str(out / io.PREFILL_GRAPH), load_external_data=False)
    scales = [onnx.numpy_helper.to_array(t) for t in g.graph.initializer if t.name.startswith("kv_scales.")]
    assert scales and all(np.isfinite(s).all() for s in scales)


def test_calibrate_checks_the_text_before_loading_the_model(int8_build, tmp_path):
    """A --text that cannot be read fails at once: the source named here does not exist, so reaching
    the model load would raise a different error."""
    _, out = int8_build
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"^--text .*fifo is a FIFO"):
        cal.calibrate(out, fifo, tokens=64, model_source=str(tmp_path / "no-such-model"), validate=False)
