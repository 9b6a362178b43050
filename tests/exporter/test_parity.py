"""Parity of exported graphs with transformers on tiny random models of every family:
both KV layouts, MHA and GQA, fp32 — greedy tokens identical and logits within the
tolerance stated in kvexport.exporter.validate."""

import pytest

from kvexport import io
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import FAMILIES
from kvexport.exporter.validate import TOLERANCE

# family -> config variants exercised (name, overrides)
CASES = {
    "llama": [("mha", dict(num_key_value_heads=4)), ("gqa", dict(num_key_value_heads=2)),
              ("mqa", dict(num_key_value_heads=1))],
    "mistral": [("gqa-window", dict(num_key_value_heads=2, sliding_window=8)),
                ("mha", dict(num_key_value_heads=4))],
    "qwen2": [("gqa", dict(num_key_value_heads=2)), ("mha", dict(num_key_value_heads=4))],
    "phi3": [("gqa", dict(num_key_value_heads=2)), ("mha", dict(num_key_value_heads=4)),
             ("gqa-partial-rope", dict(num_key_value_heads=2, partial_rotary_factor=0.5))],
    "gpt2": [("mha", {})],
}
PARAMS = [(fam, name, ov, layout) for fam, variants in CASES.items() for name, ov in variants
          for layout in io.KVLayout]


@pytest.mark.parametrize("family,variant,overrides,layout", PARAMS,
                         ids=[f"{f}-{v}-{l.value}" for f, v, _, l in PARAMS])
def test_parity(hf_folder, tmp_path, family, variant, overrides, layout):
    src = hf_folder(family, **overrides)
    out, m = build(str(src), tmp_path / "b", BuildOptions(layout=layout, block_size=4, max_seq_len=64,
                                                                     attention=io.Attention.ONNX))
    v = m.validation
    assert v.passed, v
    assert v.greedy_identical
    assert v.max_abs_diff <= TOLERANCE["fp32"]
    assert v.steps == 16 and len(v.max_abs_diff_per_step) == 17
    assert (out / io.MANIFEST_NAME).is_file()


def test_every_family_has_a_parity_case():
    from testkit.families import PARITY_MODULES

    # the 2025-26 families, DeepSeek (MLA), the mixtures of experts and gpt-oss have their own modules
    covered = set(CASES)
    for name, (cases, _) in PARITY_MODULES.items():
        assert not covered & set(cases), name
        covered |= set(cases)
    assert covered == set(FAMILIES), f"add parity cases for every registered family: {set(FAMILIES) - covered}"


def test_sliding_window_is_shorter_than_the_test_sequence(hf_folder, tmp_path):
    """The window case only proves something if sequences outgrow the window."""
    _, m = build(str(hf_folder("mistral", num_key_value_heads=2, sliding_window=8)), tmp_path / "b",
                 BuildOptions(block_size=4, max_seq_len=64, attention=io.Attention.ONNX))
    assert m.model.sliding_window == 8
    assert max(m.validation.prompt_lengths) + m.validation.steps > 8


def test_window_changes_the_result(hf_folder, tmp_path):
    """Sanity of the test itself: a windowed and a full-attention model with the same
    weights must disagree, or the window test above would be vacuous."""
    import numpy as np

    from kvexport.exporter import source
    from kvexport.exporter.validate import prompt_ids, reference

    full = source.load_model(source.resolve(str(hf_folder("mistral", num_key_value_heads=2))))
    win = source.load_model(source.resolve(str(hf_folder("mistral", num_key_value_heads=2, sliding_window=8))))
    prompts = prompt_ids(None, 128)
    _, a = reference(full, prompts, 2)
    _, b = reference(win, prompts, 2)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) > 1e-2


@pytest.mark.parametrize("layout", list(io.KVLayout))
def test_fp16_builds_load_and_run_in_onnxruntime(hf_folder, tmp_path, layout):
    _, m = build(str(hf_folder("llama")), tmp_path / "b",
                 BuildOptions(layout=layout, dtype=io.DType.FP16, block_size=4, max_seq_len=64,
                              attention=io.Attention.ONNX))
    v = m.validation
    assert m.kv.dtype == "fp16" and v.passed, v
    assert v.max_abs_diff <= TOLERANCE["fp16"]


def test_all_logits_option(hf_folder, tmp_path):
    import numpy as np

    from kvexport.exporter.validate import session

    out, m = build(str(hf_folder("llama")), tmp_path / "b",
                   BuildOptions(layout=io.KVLayout.CONTIGUOUS, all_logits=True, block_size=4, max_seq_len=64))
    s = session(out / "prefill.onnx")
    ids = np.array([[5, 6, 7, 8, 9]], np.int64)
    logits = s.run([io.LOGITS], {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones_like(ids),
                                 io.POSITION_IDS: np.arange(5)[None]})[0]
    assert logits.shape == (1, 5, 128)
