"""The onnxruntime backends and the one factory: each kind of attention gets its own small
backend class; a plugin build gives the same logits and the same pools with the native
op and with the float64 reference op; the wrong kind for a build, a too-small pool and a
TensorRT request for a build without engines are clear errors; profiling writes files."""

from pathlib import Path

import numpy as np
import pytest

from kvexport import io
from kvexport import manifest as mf
from kvexport.errors import KvExportError
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.execution.backends import create_backend
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.execution.model_runner import chunk, pack
from kvexport.runtime.execution.ort_backends import NativeOpBackend, OnnxAttentionBackend, ReferenceOpBackend, ort_backend

BS = 4


@pytest.fixture(scope="module")
def builds(hf_folder, tmp_path_factory):
    src = str(hf_folder("llama", num_key_value_heads=2))
    root = tmp_path_factory.mktemp("ortb")
    onnx, _ = build(src, root / "onnx", BuildOptions(block_size=BS, max_seq_len=64, validate=False,
                                                   attention=io.Attention.ONNX))
    plug, _ = build(src, root / "plugin", BuildOptions(block_size=BS, max_seq_len=64, validate=False,
                                                       attention=io.Attention.PLUGIN))
    return onnx, plug


def _steps(full_tables):
    tables = [[1, 2, 3], [4, 5, 6]]
    prefill = [chunk("a", [5, 6, 7, 8, 9], 0, tables[0], BS), chunk("b", [10, 11, 12], 0, tables[1], BS)]
    decode = [chunk("a", [13], 5, tables[0], BS), chunk("b", [14], 3, tables[1], BS)]
    return [pack(prefill, BS, full_tables), pack(decode, BS, full_tables)]


def test_onnx_build_gets_the_onnx_attention_backend(builds):
    onnx, _ = builds
    m = mf.load(onnx)
    be = ort_backend(onnx, m, 8)
    assert isinstance(be, OnnxAttentionBackend) and be.pads_queries and not be.full_block_tables
    assert be.attention_impl == "onnx"
    with pytest.raises(KvExportError, match="plugin"):
        ort_backend(onnx, m, 8, kind="native")
    with pytest.raises(KvExportError, match="2 blocks"):
        ort_backend(onnx, m, 1)


def test_native_and_reference_op_agree(builds, cpu_op):
    _, plug = builds
    m = mf.load(plug)
    native, ref = ort_backend(plug, m, 8), ort_backend(plug, m, 8, kind="reference")
    assert isinstance(native, NativeOpBackend) and isinstance(ref, ReferenceOpBackend)
    assert native.full_block_tables and not native.pads_queries
    for inp in _steps(full_tables=True):
        np.testing.assert_allclose(native.execute(inp), ref.execute(inp), atol=1e-4)
    for a, b in zip(native.pools, ref.pools):  # stored in place vs returned copies: the same K/V
        np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(KvExportError, match="native or the reference"):
        ort_backend(plug, m, 8, kind="onnx")


def test_onnx_attention_stores_the_same_kv_as_the_plugin(builds, cpu_op):
    onnx, plug = builds
    a, b = ort_backend(onnx, mf.load(onnx), 8), ort_backend(plug, mf.load(plug), 8)
    for ia, ib in zip(_steps(False), _steps(True)):
        np.testing.assert_allclose(a.execute(ia), b.execute(ib), atol=1e-4)
    for pa, pb in zip(a.pools, b.pools):
        np.testing.assert_allclose(pa, pb, atol=1e-5)


def test_one_session_serves_both_phases_and_profiling_writes_its_file(builds, tmp_path):
    """Serving opens one session (the prefill graph runs decode steps too: onnxruntime
    pre-packs weights per session); validation's both_graphs opens the decode graph too,
    and both give the same logits."""
    onnx, _ = builds
    m = mf.load(onnx)
    be = ort_backend(onnx, m, 8, profile_prefix=str(tmp_path / "prof"))
    assert be.sessions["prefill"] is be.sessions["decode"]
    two = ort_backend(onnx, m, 8, both_graphs=True)
    assert two.sessions["prefill"] is not two.sessions["decode"]
    for inp in _steps(False):
        np.testing.assert_allclose(be.execute(inp), two.execute(inp), atol=1e-5)
    files = be.end_profiling()
    assert len(files) == 1 and all(Path(f).is_file() for f in files)


def test_tensorrt_without_engines_is_a_clear_error(builds):
    _, plug = builds
    with pytest.raises(KvExportError, match="no TensorRT engines"):
        create_backend(plug, mf.load(plug), EngineConfig(backend="tensorrt"), 8)
