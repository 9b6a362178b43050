"""Every GPU kernel configuration (configs.all_sources()) compiles ahead of time with triton.compile
— PTX, assembled to a cubin by Triton's bundled ptxas — with no GPU: each once, for sm_80 or sm_90
in turn within each kind (configs.ci_sources(); `ptx --all` compiles each for both).
Runs `python -m kvexport.plugins.paged_attention.ptx` in a subprocess: this process's triton is
in interpreter mode (conftest.py)."""

import json
import os
import subprocess
import sys

from kvexport.plugins.paged_attention import configs


def _kind(r: dict) -> tuple:
    return r["kernel"], r["types"].get("q_ptr"), r["types"].get("kc_ptr")


def test_ci_subset_covers_every_configuration_and_both_archs_per_kind():
    ci = configs.ci_sources()
    every = configs.all_sources()
    assert [src for src, _ in ci] == every  # each configuration once, in order
    archs: dict[tuple, set] = {}
    for src, cap in ci:
        kind = (src.kernel, src.signature.get("q_ptr", src.signature.get("out_ptr")), src.signature.get("kc_ptr"))
        archs.setdefault(kind, set()).add(cap)
    counts = {k: sum(1 for s, _ in ci if (s.kernel, s.signature.get("q_ptr", s.signature.get("out_ptr")),
                                          s.signature.get("kc_ptr")) == k) for k in archs}
    assert all(archs[k] == {80, 90} for k in archs if counts[k] >= 2), archs
    assert {k[0] for k in archs} == {"prefill", "decode", "decode_split", "reduce", "scores"}


def test_every_configuration_compiles_for_sm80_or_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / "ptx.json"
    proc = subprocess.run([sys.executable, "-m", "kvexport.plugins.paged_attention.ptx", "--json", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert len(results) == len(configs.all_sources())
    assert all(r["ok"] for r in results)
    assert {r["target"] for r in results if r["arch"] == 80} == {"sm_80"}
    assert {r["target"] for r in results if r["arch"] == 90} == {"sm_90a"}  # Triton targets sm_90a on Hopper
    # the AOT launch passes no scratch buffer: the kernels must not need one
    assert all(r["global_scratch"] == 0 for r in results)
    kinds = {_kind(r) for r in results}
    for act in ("*fp16", "*bf16"):
        for pool in (act, "*i8", "*u8"):
            assert {("prefill", act, pool), ("decode", act, pool), ("decode_split", act, pool)} <= kinds
    # the attention_scores pass (importance eviction): fp16 over every pool kind, bf16 pools
    assert {("scores", "*fp16", p) for p in ("*fp16", "*i8", "*u8")} | {("scores", "*bf16", "*bf16")} <= kinds
