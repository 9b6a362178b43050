"""TensorRT end to end (needs TensorRT and an NVIDIA GPU; skipped otherwise, which is always
the case on this project's machines): build the engines of a tiny plugin build, serve it with
the TensorRT backend, and compare greedy tokens with the same model's `onnx`-attention build
on onnxruntime; then the same with decode CUDA graphs."""

from __future__ import annotations

import importlib.util

import pytest

from kvexport import io, manifest as mf
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.tensorrt_build import EngineBuildOptions, add_engines


def _tensorrt_ok() -> bool:
    if importlib.util.find_spec("tensorrt") is None:
        return False
    import tensorrt

    return hasattr(tensorrt, "Builder")  # not just the stubs' empty namespace package


def _cuda_ok() -> bool:
    import torch

    return torch.cuda.is_available()


pytestmark = [
    pytest.mark.tensorrt,
    pytest.mark.gpu,
    pytest.mark.skipif(not _tensorrt_ok(), reason="needs TensorRT (`import tensorrt` has no bindings here; it cannot "
                       "be installed on this project's machines): pip install \"kvexport[tensorrt]\" on an NVIDIA "
                       "machine, or run in the TensorRT container"),
    pytest.mark.skipif(not _cuda_ok(), reason="needs an NVIDIA GPU and a CUDA build of torch"),
]

PROMPTS = [[1, 5, 9, 23, 42], [7, 7, 3], list(range(2, 40))]
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def builds(hf_folder, tmp_path_factory):
    model = str(hf_folder("llama"))
    root = tmp_path_factory.mktemp("trt")
    fp16 = io.DType.FP16  # the plugin kernels take fp16/bf16 activations
    ref, _ = build(model, root / "onnx", BuildOptions(attention=io.Attention.ONNX, validate=False, max_seq_len=128,
                                                      dtype=fp16))
    plug, _ = build(model, root / "plugin", BuildOptions(attention=io.Attention.PLUGIN, validate=False,
                                                         max_seq_len=128, dtype=fp16))
    add_engines(plug, EngineBuildOptions(max_num_seqs=8, max_num_batched_tokens=128, max_num_blocks=NUM_BLOCKS))
    return ref, plug


def _greedy(build_dir, backend_factory) -> list[list[int]]:
    from kvexport.runtime.engine import EngineConfig, LLMEngine
    from kvexport.runtime.sampling_params import SamplingParams

    m = mf.load(build_dir)
    engine = LLMEngine(build_dir, EngineConfig(max_num_seqs=8, max_num_batched_tokens=128),
                       backend=backend_factory(build_dir, m))
    rids = [engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_output(r).token_ids for r in rids]


def test_engine_entry_and_files(builds):
    _, plug = builds
    m = mf.load(plug)
    assert m.engines is not None
    assert m.engines.plugin.id == "kvexport::PagedAttention" and m.engines.plugin.version == "1"
    for phase in ("prefill", "decode"):
        assert (plug / m.engines.engines[phase].file).is_file()
    assert (plug / m.engines.timing_cache).is_file()
    assert m.engines.limits.max_num_blocks == NUM_BLOCKS and m.engines.limits.max_num_seqs == 8


@pytest.mark.parametrize("graph_sizes", [(), (1, 2, 4, 8)], ids=["eager", "cuda-graphs"])
def test_greedy_tokens_match_onnxruntime(builds, graph_sizes):
    from kvexport.runtime.execution.ort_backends import ort_backend
    from kvexport.runtime.execution.trt_backend import TensorRTBackend

    ref, plug = builds
    expected = _greedy(ref, lambda d, m: ort_backend(d, m, NUM_BLOCKS))
    got = _greedy(plug, lambda d, m: TensorRTBackend(d, m, NUM_BLOCKS, cuda_graph_batch_sizes=graph_sizes))
    assert got == expected


def test_int4_weight_only_engines(hf_folder, tmp_path):
    """`--weights int4 --backend tensorrt`: the QDQ graphs (INT4 blocks of 64, per-channel INT8
    head) build weight-only engines whose greedy tokens follow onnxruntime on the same int4
    options (identical tokens not required: fp16 GEMMs on the GPU, int8 activations on the CPU)."""
    from kvexport.runtime.execution.ort_backends import ort_backend
    from kvexport.runtime.execution.trt_backend import TensorRTBackend

    model = str(hf_folder("llama"))
    common = dict(validate=False, max_seq_len=128, dtype=io.DType.FP16, weights="int4", weight_block_size=64)
    ref, _ = build(model, tmp_path / "onnx", BuildOptions(attention=io.Attention.ONNX, **common))
    trt, m = build(model, tmp_path / "trt", BuildOptions(backend="tensorrt", **common,
                                                         engines=EngineBuildOptions(max_num_seqs=8,
                                                                                    max_num_batched_tokens=128,
                                                                                    max_num_blocks=NUM_BLOCKS)))
    assert m.engines is not None and m.weights.precision == "int4"
    expected = _greedy(ref, lambda d, m: ort_backend(d, m, NUM_BLOCKS))
    got = _greedy(trt, lambda d, m: TensorRTBackend(d, m, NUM_BLOCKS))
    assert [g[0] for g in got] == [e[0] for e in expected]
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    assert same >= 0.75 * sum(len(e) for e in expected), (got, expected)
