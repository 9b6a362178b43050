"""kvexport/verify.py: a build records its weights file's sha256, and a weights file damaged
after the build (the middle zeroed, the size unchanged, so manifest.load()'s size check passes)
is refused before anything is served: by LLM, by `kvexport serve` (exit 2) and by
`kvexport inspect --verify` (exit 2), each naming the file and what to do."""

import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvexport import io
from kvexport.cli import main
from kvexport.errors import ChecksumError
from kvexport.manifest import load
from kvexport.runtime.llm import LLM
from kvexport.runtime.sampling_params import SamplingParams

SETTINGS = dict(kv_cache_memory="16MiB")


def zero_middle(path: Path, n: int = 1 << 16) -> None:
    """Overwrite `n` bytes in the middle of `path` with zeros (the size stays)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2 - n // 2)
        f.write(bytes(n))
    assert path.stat().st_size == size


@pytest.fixture
def damaged(chat_build, tmp_path) -> Path:
    """A copy of the tiny chat build whose weights file has its middle 64 KiB zeroed."""
    d = tmp_path / "damaged"
    shutil.copytree(chat_build, d)
    zero_middle(d / io.WEIGHTS_FILE)
    load(d)  # NOTE: the cheap load still passes: same size, same graphs
    return d


def _cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    return r.exit_code, " ".join(r.output.split())  # one line: the console wraps long messages


def _says_what_to_do(msg: str, d: Path) -> None:
    assert f"{d / io.WEIGHTS_FILE} does not match the sha256 its manifest records (manifest field " \
           f"'weights.sha256'" in msg, msg
    assert "damaged or replaced after the build" in msg and "kvexport build MODEL --out BUILD --force" in msg, msg


def test_a_build_records_its_weights_sha256(chat_build):
    m = load(chat_build)
    assert m.weights.sha256 == hashlib.sha256((chat_build / io.WEIGHTS_FILE).read_bytes()).hexdigest()


def test_a_zeroed_middle_is_refused_by_llm(damaged):
    with pytest.raises(ChecksumError) as e:
        LLM(damaged, **SETTINGS)
    _says_what_to_do(str(e.value), damaged)


def test_a_zeroed_middle_is_refused_by_serve(damaged):
    # NOTE: a process with a time limit: a server that did start would serve until stopped
    run = subprocess.run([sys.executable, "-m", "kvexport.cli", "serve", str(damaged), "--port", "0",
                          "--kv-cache-memory", "16MiB"], capture_output=True, text=True, timeout=120)
    out = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 2 and "serving" not in out.lower() and "Traceback" not in out, out
    _says_what_to_do(out, damaged)


def test_inspect_verify(chat_build, damaged):
    code, out = _cli("inspect", "--verify", chat_build)
    assert code == 0 and f"verified: {chat_build / io.WEIGHTS_FILE} matches its recorded sha256" in out, out
    code, out = _cli("inspect", "--verify", damaged)
    assert code == 2, out
    _says_what_to_do(out, damaged)
    code, out = _cli("inspect", damaged)  # without --verify: the cheap checks only
    assert code == 0, out


def test_a_build_without_a_recorded_sha256(chat_build, tmp_path, caplog):
    """Builds made before `weights.sha256`: served with a warning that nothing was verified;
    `inspect --verify` says it cannot verify them (exit 2)."""
    d = tmp_path / "old"
    shutil.copytree(chat_build, d)
    path = d / io.MANIFEST_NAME
    data = json.loads(path.read_text())
    del data["weights"]["sha256"]
    path.write_text(json.dumps(data))
    assert load(d).weights.sha256 is None
    code, out = _cli("inspect", "--verify", d)
    assert code == 2 and "the manifest records no sha256 for it (manifest field 'weights.sha256'" in out, out
    assert f"kvexport build MODEL --out {d} --force" in out, out
    with caplog.at_level(logging.WARNING, logger="kvexport.verify"):
        llm = LLM(d, **SETTINGS)
    assert len(llm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2
    assert any("not verified" in r.getMessage() and "records no sha256" in r.getMessage() for r in caplog.records)
