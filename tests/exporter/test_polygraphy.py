"""Every produced graph works with polygraphy: `inspect model` reads it and
`run --onnxrt` executes it on the sample inputs the build ships."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvexport import io
from kvexport.exporter.build import BuildOptions, build

POLYGRAPHY = str(Path(sys.executable).with_name("polygraphy"))


def _polygraphy(*args: str) -> str:
    r = subprocess.run([POLYGRAPHY, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


@pytest.mark.parametrize("layout", list(io.KVLayout))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_polygraphy_inspect_and_run(hf_folder, tmp_path, family, layout):
    out, m = build(str(hf_folder(family)), tmp_path / "b",
                   BuildOptions(layout=layout, block_size=4, max_seq_len=64, validate=False,
                                attention=io.Attention.ONNX))  # polygraphy has no kvexport op
    for phase, entry in m.graphs.items():
        text = _polygraphy("inspect", "model", str(out / entry.file))
        assert io.INPUT_IDS in text and io.LOGITS in text
        text = _polygraphy("run", str(out / entry.file), "--onnxrt", "--load-inputs", str(out / m.samples[phase]))
        assert "PASSED" in text
