"""The GatedDeltaRule kernel compiles ahead of time with triton.compile — PTX assembled to a cubin by
Triton's bundled ptxas, no GPU: Qwen3.5-0.8B's shape (16 heads of 128), fp16 for sm_90 and bf16 for
sm_80 (configs.ci_sources(); `ptx --all` compiles every configuration). Runs
`python -m kvexport.plugins.gated_delta.ptx` in a subprocess: this process's triton is in interpreter
mode (conftest.py)."""

import json
import os
import subprocess
import sys


def test_gated_delta_kernel_compiles_for_sm80_and_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / "ptx.json"
    proc = subprocess.run([sys.executable, "-m", "kvexport.plugins.gated_delta.ptx", "--json", str(out)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert len(results) == 2 and all(r["ok"] for r in results)
    assert {(r["arch"], r["target"], r["types"]["q_ptr"]) for r in results} == {(90, "sm_90a", "*fp16"),
                                                                                (80, "sm_80", "*bf16")}
    assert all(r["global_scratch"] == 0 for r in results)  # the AOT launch passes no scratch buffer
    assert {(r["config"]["DK"], r["config"]["BLOCK_K"]) for r in results} == {(128, 128)}
