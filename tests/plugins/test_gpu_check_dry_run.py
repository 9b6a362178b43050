"""scripts/gpu_check.sh end to end at toy sizes on CPU (--tiny: TRITON_INTERPRET=1), from a
checkout layout without installing the package: the argument handling, case factory,
reference comparison, timing, bandwidth arithmetic and JSON/summary of the GPU check, for
PagedAttention (gpu_check.json) and PagedMLA (gpu_check_mla.json)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_tiny_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--tiny"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert r["tiny"] and len(r["correctness"]) == 19
    assert sum(c["name"].startswith("qwen3.5") for c in r["correctness"]) == 2  # wide heads (head_dim 256 on a GPU)
    assert sum(c["name"].startswith("gpt-oss") for c in r["correctness"]) == 4  # attention sinks
    assert all(c["ok"] and c["pools_bit_exact"] for c in r["correctness"]), r["correctness"]
    assert r["copy_bytes_per_s"] > 0 and r["decode_b64_ctx4k_fp16"]["best"]["bytes_per_s"] > 0
    assert {v["num_splits"] for v in r["decode_b64_ctx4k_fp16"]["variants"]} == {1, 2}
    assert r["decode_b64_ctx4k_fp16"]["aot_best"]["bytes_per_s"] > 0  # TensorRT's kernel, timed too
    assert 0 < r["bandwidth_fraction_aot_kernel"]
    assert "via prefill_kernel (AOT path)" in p.stdout
    assert set(r["goals"]) == {"correctness", "bandwidth_70pct", "int8_1p6x", "int4_1p6x"}
    assert "[ok] decode b16 ctx8k int4 via prefill_kernel (AOT path)" in p.stdout and r["int4_speedup"] > 0
    assert "bandwidth fraction" in p.stdout and "[ok] decode b1 ctx8k fp16 split-auto" in p.stdout
    # the attention_scores pass (importance eviction): against the reference, and a scored step timed
    assert len(r["scores"]) == 5 and all(c["ok"] and c["pools_bit_exact"] for c in r["scores"]), r["scores"]
    assert r["scores_cost"]["scored_seconds"] > 0 and "scoring step:" in p.stdout
    # then the PagedMLA check (plugins/paged_mla/gpu_check.py): its own report
    m = json.loads((tmp_path / "out" / "gpu_check_mla.json").read_text())
    assert m["tiny"] and len(m["correctness"]) == 10 and m["goals"] == {"correctness": True}, m["correctness"]
    assert all(c["pools_bit_exact"] for c in m["correctness"])
    assert len(m["scores"]) == 2 and all(c["ok"] for c in m["scores"]) and m["scores_cost"]["ratio"] > 0
    assert m["decode_long_fp16"]["aot_best"]["bytes_per_s"] > 0 and m["int8_speedup"] > 0
    assert "PagedMLA GPU check" in p.stdout and "[ok] tp8 decode b32 ctx4k bf16 int8 AOT path" in p.stdout
    # then the GatedDeltaRule check (plugins/gated_delta/gpu_check.py)
    g = json.loads((tmp_path / "out" / "gpu_check_gated_delta.json").read_text())
    assert g["tiny"] and len(g["correctness"]) == 7 and g["goals"] == {"correctness": True}, g["correctness"]
    assert g["decode_fp16"]["best"]["bytes_per_s"] > 0 and "GatedDeltaRule GPU check" in p.stdout
