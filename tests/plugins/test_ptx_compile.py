"""Every GPU kernel configuration (configs.all_sources()) compiles ahead of time for sm_80 and
sm_90 with triton.compile — PTX, assembled to a cubin by Triton's bundled ptxas — with no GPU.
Runs `python -m kvexport.plugins.paged_attention.ptx` in a subprocess: this process's triton is
in interpreter mode (conftest.py)."""

import json
import os
import subprocess
import sys


def test_every_configuration_compiles_for_sm80_and_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / "ptx.json"
    proc = subprocess.run([sys.executable, "-m", "kvexport.plugins.paged_attention.ptx", "--arch", "80", "90",
                           "--json", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    from kvexport.plugins.paged_attention import configs

    assert len(results) == 2 * len(configs.all_sources())
    assert all(r["ok"] for r in results)
    assert {r["target"] for r in results if r["arch"] == 80} == {"sm_80"}
    assert {r["target"] for r in results if r["arch"] == 90} == {"sm_90a"}  # Triton targets sm_90a on Hopper
    # the AOT launch passes no scratch buffer: the kernels must not need one
    assert all(r["global_scratch"] == 0 for r in results)
    kinds = {(r["kernel"], r["types"].get("q_ptr"), r["types"].get("kc_ptr")) for r in results}
    for act in ("*fp16", "*bf16"):
        for pool in (act, "*i8"):
            assert {("prefill", act, pool), ("decode", act, pool), ("decode_split", act, pool)} <= kinds
