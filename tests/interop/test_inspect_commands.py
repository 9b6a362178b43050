"""`kvexport inspect --json` and the polygraphy / trtexec command lines `kvexport inspect` prints:
the onnxruntime ones are run here exactly as printed; TensorRT's cannot be (no TensorRT)."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvexport import io
from kvexport import manifest as mf
from kvexport.cli import main
from kvexport.exporter.build import BuildOptions, build
from kvexport.cli.inspect import tool_commands

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def tiny_builds(hf_folder, tmp_path_factory):
    d = tmp_path_factory.mktemp("cmds")
    contig, _ = build(str(hf_folder("llama")), d / "contig",
                      BuildOptions(layout=io.KVLayout.CONTIGUOUS, max_seq_len=64, validate=False))
    plugin, _ = build(str(hf_folder("llama")), d / "plugin",
                      BuildOptions(attention=io.Attention.PLUGIN, block_size=4, max_seq_len=64, validate=False))
    return contig, plugin


def test_inspect_json_summarises_the_build(tiny_builds):
    contig, _ = tiny_builds
    r = CliRunner().invoke(main, ["inspect", "--json", str(contig)])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["kv"]["layout"] == "contiguous" and s["kv"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert s["model"]["num_layers"] == 2 and s["validation"] is None
    dec = s["graphs"]["decode"]
    assert [t["name"] for t in dec["inputs"]][:3] == [io.INPUT_IDS, io.ATTENTION_MASK, io.POSITION_IDS]
    assert dec["profile"][io.INPUT_IDS] == {"min": [1, 1], "opt": [1, 1], "max": [8, 64]}
    assert dec["profile"][io.past_key(1)] == {"min": [1, 2, 0, 16], "opt": [1, 2, 64, 16], "max": [8, 2, 63, 16]}
    assert s["interop_files"] == [io.HF_CONFIG, io.GENERATION_CONFIG, io.GENAI_CONFIG]
    assert s["commands"]["trtexec"][1].startswith(f"trtexec --onnx={contig}/decode.onnx --minShapes=input_ids:1x1,")


def test_printed_polygraphy_commands_run(tiny_builds, tmp_path):
    contig, _ = tiny_builds
    r = CliRunner().invoke(main, ["inspect", str(contig)])
    assert r.exit_code == 0, r.output
    printed = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith(("polygraphy ", "trtexec "))]
    cmds = tool_commands(str(contig), mf.load(contig))
    assert printed == cmds["polygraphy"] + cmds["trtexec"]
    ran = 0
    for line in cmds["polygraphy"]:
        if " --trt " in line:  # TensorRT: not installable here
            continue
        argv = shlex.split(line)
        p = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, cwd=tmp_path,
                           timeout=300, env={**os.environ, "POLYGRAPHY_AUTOINSTALL_DEPS": "0"})
        assert p.returncode == 0, (line, p.stdout[-2000:], p.stderr[-2000:])
        if " run " in line:
            assert "PASSED" in p.stdout + p.stderr
        ran += 1
    assert ran == 6  # inspect, run --save-outputs, run --load-outputs (compare) for each graph
    assert (tmp_path / "decode_onnxrt_outputs.json").is_file()


def test_plugin_build_commands_say_what_cannot_run(tiny_builds):
    _, plugin = tiny_builds
    s = json.loads(CliRunner().invoke(main, ["inspect", "--json", str(plugin)]).stdout)
    c = s["commands"]
    assert all(line.startswith("polygraphy inspect model") for line in c["polygraphy"])
    assert c["trtexec"] == []  # no engines built
    assert any("--staticPlugins" in n and f"kvexport engines {plugin}" in n for n in c["notes"])
    assert s["graphs"]["decode"]["profile"][io.BLOCK_TABLES] == {"min": [1, 1], "opt": [64, 8], "max": [64, 16]}
    assert io.GENAI_CONFIG not in s["interop_files"] and io.HF_CONFIG in s["interop_files"]
