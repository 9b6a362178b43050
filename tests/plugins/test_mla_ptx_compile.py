"""The PagedMLA kernels compile ahead of time with triton.compile — PTX assembled to a cubin by
Triton's bundled ptxas, no GPU: the AOT mla_kernel with each pool kind (same dtype, int8) at
DeepSeek-V3's shape, the reduce kernel and the attention_scores kernel, for sm_80 and sm_90 (configs.ci_sources(); `ptx --all`
compiles every configuration, the split kernel included). Runs `python -m kvexport.plugins.paged_mla.ptx` in a subprocess:
this process's triton is in interpreter mode (conftest.py)."""

import json
import os
import subprocess
import sys


def test_mla_kernels_compile_for_sm80_and_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / "ptx.json"
    proc = subprocess.run([sys.executable, "-m", "kvexport.plugins.paged_mla.ptx", "--json", str(out)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert len(results) == 4 and all(r["ok"] for r in results)
    assert {r["target"] for r in results if r["arch"] == 80} == {"sm_80"}
    assert {r["target"] for r in results if r["arch"] == 90} == {"sm_90a"}  # Triton targets sm_90a on Hopper
    assert all(r["global_scratch"] == 0 for r in results)  # the AOT launch passes no scratch buffer
    kinds = {(r["kernel"], r["types"].get("q_ptr"), r["types"].get("cache_ptr")) for r in results}
    assert kinds == {("mla", "*fp16", "*fp16"), ("mla", "*bf16", "*i8"), ("reduce", None, None),
                     ("scores", "*fp16", "*i8")}  # the attention_scores pass (importance eviction)
    assert {r["config"].get("LORA") for r in results} == {512}  # DeepSeek's kv_lora_rank, unpadded
