"""The native CPU op built for x86-64-v3 (AVX2/FMA: the level docker/Dockerfile.cpu compiles it
for) against the float64 reference, in real onnxruntime sessions. The library the other tests load
is compiled for this CPU (-march=native: AVX-512 on the project's machines), so without this test
the AVX2 code paths (kvexport_simd::vreg of 8 lanes, the int4 kernel's AVX2 decode) would run
nowhere before an image does. Every case of test_cpu_op, test_int4_kv and test_attention_sinks'
kinds, at the head sizes the op specialises (32, 64, 96, 128, 256, 512) and one it does not (80): outputs
within the fp32 tolerance, pools bit for bit. And the x86-64-v4 variant the image adds: taken at
run time where the CPU has AVX-512, not elsewhere."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from kvexport.plugins.paged_attention import native
from kvexport.plugins.paged_attention.native import one_node_model
from kvexport.plugins.paged_attention.reference import make_case
from kvexport.plugins.paged_attention.spec import TOLERANCE

from .test_cpu_op import CASES, PER_LAYER, PER_LAYER_CASES, feeds_of, reference, session
from .test_int4_kv import CASES as INT4_CASES

AVX2 = ("avx2", "fma", "f16c", "bmi2")  # what -march=x86-64-v3 code needs
INCLUDE = Path(sys.prefix) / "share" / "kvexport" / "onnxruntime-include"  # scripts/build_cpu_ops.sh's

ISA_CASES = {f"plain-{n}": c for n, c in CASES.items()}
ISA_CASES.update({f"int4-{n}": dict(c, kv_dtype="int4") for n, c in INT4_CASES.items()})
for _n, _c in PER_LAYER_CASES.items():
    for _kv in ("float32", "int8", "int4"):
        ISA_CASES[f"layer-{_n}-{_kv}"] = dict(PER_LAYER, **_c, kv_dtype=_kv)
for _d in (32, 64, 96, 128, 256, 512, 80):  # decode rows (1 token), prompt tiles (37, 20 tokens), GQA 4:1
    for _kv in ("float32", "int8", "int4"):
        if _kv != "int4" or _d % 32 == 0:
            ISA_CASES[f"d{_d}-{_kv}"] = dict(num_heads=8, num_kv_heads=2, head_dim=_d, block_size=16,
                                             q_lens=[1, 37, 1, 20], ctx_lens=[70, 0, 33, 50], kv_dtype=_kv)
ISA_CASES["sinks-window-int4"] = dict(num_heads=6, num_kv_heads=2, head_dim=32, block_size=4, q_lens=[1, 9, 1],
                                      ctx_lens=[20, 3, 0], kv_dtype="int4", sliding_window=5,
                                      attention_sinks=[0.5, -1.0, 2.0, 0.0, 1.5, -0.5])
ISA_CASES["sinks-float32"] = dict(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, q_lens=[1, 30],
                                  ctx_lens=[40, 8], attention_sinks=[0.5, -1.0, 2.0, 0.0, 1.5, -0.5])


@pytest.fixture(scope="module")
def avx2_lib(tmp_path_factory) -> Path:
    """The op library compiled with -march=x86-64-v3 (native.build, as the Docker image does)."""
    if not set(AVX2) <= native.cpu_flags():
        pytest.skip("this CPU cannot run -march=x86-64-v3 code")
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    if not (INCLUDE / "onnxruntime_cxx_api.h").is_file():
        pytest.skip(f"no onnxruntime headers at {INCLUDE} (scripts/build_cpu_ops.sh fetches them)")
    return native.build(INCLUDE, tmp_path_factory.mktemp("avx2") / native.LIB_NAME, march="x86-64-v3")


@pytest.mark.parametrize("name", sorted(ISA_CASES))
def test_avx2_build_matches_reference(avx2_lib, name):
    case, attrs = make_case(**ISA_CASES[name], seed=sum(map(ord, name)))
    want_out, want_k, want_v = reference(case, attrs)
    out, k, v = session(str(avx2_lib), one_node_model(attrs, attrs.kv_dtype)).run(None, feeds_of(case))
    assert np.abs(out - want_out).max() <= TOLERANCE["float32"]
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)


def test_avx2_and_native_builds_agree(avx2_lib, cpu_op):
    """The same inputs through both builds: outputs equal up to rounding (the compiler fuses
    multiply-adds per target: up to ~1e-6 apart), pools bit for bit."""
    for name in ("d64-float32", "d128-int8", "d64-int4", "layer-all-float32"):
        case, attrs = make_case(**ISA_CASES[name], seed=7)
        model = one_node_model(attrs, attrs.kv_dtype)
        a = session(str(avx2_lib), model).run(None, feeds_of(case))
        b = session(str(cpu_op), model).run(None, feeds_of(case))
        assert np.abs(a[0] - b[0]).max() <= 1e-5, name
        for x, y in zip(a[1:], b[1:]):
            np.testing.assert_array_equal(x, y)


AVX512 = dict(native.VARIANTS)["x86-64-v4"]


@pytest.fixture(scope="module")
def v4_variant(avx2_lib) -> Path:
    """The x86-64-v4 variant beside the x86-64-v3 library, as docker/Dockerfile.cpu writes it."""
    if not set(AVX512) <= native.cpu_flags():
        pytest.skip("this CPU cannot run -march=x86-64-v4 code")
    native.main(["--include", str(INCLUDE), "--out", str(avx2_lib), "--march", "x86-64-v4", "--variant"])
    path = native.variant_path(avx2_lib, "x86-64-v4")
    assert path.is_file() and path.parent == avx2_lib.parent
    return path


def test_the_avx512_variant_is_taken_where_the_cpu_has_it(avx2_lib, v4_variant, monkeypatch):
    assert native.best_variant(avx2_lib) == v4_variant
    assert native.best_variant(avx2_lib, flags=set(AVX2)) == avx2_lib  # an AVX2-only host
    assert native.best_variant(avx2_lib, flags=set(AVX2) | set(AVX512) - {"avx512vl"}) == avx2_lib
    # the run-time lookup: the environment's library, or its variant (NOTE: default_library is
    # pointed at the test's folder; the lookup's other paths are the real ones)
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setattr(native, "default_library", lambda: avx2_lib)
    native.library.cache_clear()
    try:
        assert native.library() == v4_variant
        monkeypatch.setattr(native, "cpu_flags", lambda: set(AVX2))
        native.library.cache_clear()
        assert native.library() == avx2_lib
    finally:
        native.library.cache_clear()
    for name in ("d64-float32", "d64-int4", "layer-all-int8"):
        case, attrs = make_case(**ISA_CASES[name], seed=3)
        out, k, v = session(str(v4_variant), one_node_model(attrs, attrs.kv_dtype)).run(None, feeds_of(case))
        want_out, want_k, want_v = reference(case, attrs)
        assert np.abs(out - want_out).max() <= TOLERANCE["float32"], name
        np.testing.assert_array_equal(k, want_k)


def test_a_plain_build_removes_the_variants_that_would_shadow_it(tmp_path, monkeypatch):
    """`python -m ...native` without --variant (scripts/build_cpu_ops.sh) deletes variants left
    beside its library by an earlier build. NOTE: the compiler is replaced by a stub writing the
    file (the compile itself is what avx2_lib exercises)."""
    lib = tmp_path / native.LIB_NAME
    stale = native.variant_path(lib, "x86-64-v4")
    stale.write_bytes(b"an earlier image's library")
    monkeypatch.setattr(native, "build", lambda include, out, march: (Path(out).write_bytes(b"new"), Path(out))[1])
    native.main(["--include", str(tmp_path), "--out", str(lib)])
    assert lib.read_bytes() == b"new" and not stale.exists()
    with pytest.raises(SystemExit):
        native.main(["--include", str(tmp_path), "--out", str(lib), "--variant"])  # --march native: no variant
