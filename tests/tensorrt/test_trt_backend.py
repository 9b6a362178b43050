"""runtime/execution/trt_backend.py without TensorRT: refusals of builds without (usable) engines,
engines built for another TensorRT or GPU, pools the engines cannot take, and the padding of
decode batches for CUDA graphs (exact arrays).

NOTE: TensorRT cannot be installed here; where a test needs `import tensorrt` to fail it
makes it fail with monkeypatch (a mock of the environment)."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvexport
from kvexport import io
from kvexport.errors import KvExportError, TensorRTUnavailableError
from kvexport.manifest import EngineFile, GpuInfo
from kvexport.runtime.execution import trt_backend as tbk
from kvexport.runtime.execution.model_input import ModelInput

GPU = GpuInfo("NVIDIA H200", "9.0")  # what make_engines() records


@pytest.fixture
def with_engines(make_manifest, make_engines, tmp_path):
    """with_engines(**limits) -> a plugin manifest whose engines/*.plan exist in tmp_path (4 bytes each)."""
    def make(**limits):
        (tmp_path / "engines").mkdir()
        files = {}
        for phase in ("prefill", "decode"):
            (tmp_path / "engines" / f"{phase}.plan").write_bytes(b"plan")
            files[phase] = EngineFile(f"engines/{phase}.plan", 4, "0" * 64, {})
        return dataclasses.replace(make_manifest(), engines=make_engines(files, **limits))

    return make


def test_refuses_onnx_attention_builds(make_manifest, tmp_path):
    with pytest.raises(KvExportError, match="runs `--attention plugin` builds"):
        tbk.engines_entry(make_manifest(io.Attention.ONNX), tmp_path)


def test_refuses_builds_without_engines(make_manifest, tmp_path):
    with pytest.raises(KvExportError, match="has no TensorRT engines; build them with"):
        tbk.TensorRTBackend(tmp_path, make_manifest(), num_blocks=16)


def test_refuses_missing_or_truncated_engine_files(with_engines, tmp_path):
    m = with_engines()
    (tmp_path / "engines" / "decode.plan").write_bytes(b"pl")
    with pytest.raises(KvExportError, match="decode.plan has 2 bytes, the manifest says 4"):
        tbk.engines_entry(m, tmp_path)
    (tmp_path / "engines" / "decode.plan").unlink()
    with pytest.raises(KvExportError, match="decode.plan listed in the manifest is missing"):
        tbk.engines_entry(m, tmp_path)


def test_refuses_a_pool_or_graph_sizes_the_engines_cannot_take(with_engines, tmp_path):
    m = with_engines()
    with pytest.raises(KvExportError, match="101 blocks does not fit the engines"):
        tbk.TensorRTBackend(tmp_path, m, num_blocks=101)
    with pytest.raises(KvExportError, match=r"CUDA graph batch sizes \[9\]"):
        tbk.TensorRTBackend(tmp_path, m, num_blocks=16, cuda_graph_batch_sizes=(1, 9))


def test_missing_tensorrt_is_a_clear_error(with_engines, tmp_path, monkeypatch):
    """Mock: `import tensorrt` fails, as on every machine of this project."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    m = with_engines()
    with pytest.raises(TensorRTUnavailableError, match='pip install "kvexport\\[tensorrt\\]"'):
        tbk.TensorRTBackend(tmp_path, m, num_blocks=16)


def test_engines_for_another_tensorrt_or_gpu_are_refused(make_engines, caplog):
    entry = make_engines()
    tbk.check_engine_target(entry, "10.13.0.35", GPU)
    with pytest.raises(KvExportError, match="built with TensorRT 10.13.0.35, this is TensorRT 10.14.1"):
        tbk.check_engine_target(entry, "10.14.1", GPU)
    a100 = GpuInfo("NVIDIA A100-SXM4-80GB", "8.0")
    with pytest.raises(KvExportError, match=r"built for NVIDIA H200 \(compute capability 9.0\), this GPU is "
                                            r"NVIDIA A100-SXM4-80GB \(compute capability 8.0\)"):
        tbk.check_engine_target(entry, "10.13.0.35", a100)
    with caplog.at_level(logging.WARNING):
        tbk.check_engine_target(entry, "10.13.0.35", GpuInfo("NVIDIA H100 80GB HBM3", "9.0"))
    assert "tactics were timed on the other GPU" in caplog.text


def test_pad_decode_exact():
    a = lambda *x: np.array(x, np.int64)  # noqa: E731
    inp = ModelInput(token_ids=a(11, 12), positions=a(5, 20), query_start_loc=a(0, 1, 2), seq_lens=a(6, 21),
                     block_tables=np.array([[3, 0], [4, 7]], np.int64), slot_mapping=a(53, 116))
    p = tbk.pad_decode(inp, batch=4, width=3)
    assert p.is_decode
    np.testing.assert_array_equal(p.token_ids, a(11, 12, 0, 0))
    np.testing.assert_array_equal(p.positions, a(5, 20, 0, 0))
    np.testing.assert_array_equal(p.query_start_loc, a(0, 1, 2, 3, 4))
    np.testing.assert_array_equal(p.seq_lens, a(6, 21, 1, 1))
    np.testing.assert_array_equal(p.slot_mapping, a(53, 116, -1, -1))
    np.testing.assert_array_equal(p.block_tables, np.array([[3, 0, 0], [4, 7, 0], [0, 0, 0], [0, 0, 0]]))
    assert p.block_tables.dtype == np.int64
    local = dataclasses.replace(inp, groups=(("local", np.array([[5, 0], [0, 9]], np.int64), a(21, 37)),))
    (g, tables, slots), = tbk.pad_decode(local, batch=4, width=3).groups
    assert g == "local" and tables.dtype == np.int64
    np.testing.assert_array_equal(tables, np.array([[5, 0, 0], [0, 9, 0], [0, 0, 0], [0, 0, 0]]))
    np.testing.assert_array_equal(slots, a(21, 37, -1, -1))


def test_serving_does_not_import_the_exporter(tmp_path):
    """The TensorRT backend needs kvexport/ (manifest, tensorrt_env) and the runtime, never
    the exporter (a serving image may ship without it)."""
    code = ("import sys, kvexport.runtime.execution.trt_backend\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvexport.exporter')))")
    env = dict(os.environ, PYTHONPATH=str(Path(kvexport.__file__).parents[1]))  # this kvexport
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
