"""Validation reports one verdict per check, with the bound it was held to (an int8 build no
longer prints "greedy identical: no (98.5%)" next to "native op: yes"); plugin graphs are
checked in full with the native op and on a cut-down run with the float64 reference op; the
manifest records which op ran and round-trips it; progress names each stage."""

import contextlib
import dataclasses
import json

import pytest

from kvexport import io
from kvexport.errors import ManifestError, ValidationError
from kvexport.exporter import validate as val
from kvexport.exporter.build import BuildOptions, build
from kvexport.manifest import Manifest, NativeOpValidation, OpCheck, ValidationEntry, load

OPTS = dict(block_size=4, max_seq_len=64)


@pytest.fixture(scope="module")
def unvalidated(hf_folder, tmp_path_factory):
    """A tiny plugin build's manifest (no validation) to attach validation entries to."""
    _, m = build(str(hf_folder("llama")), tmp_path_factory.mktemp("v") / "b",
                 BuildOptions(attention=io.Attention.PLUGIN, validate=False, **OPTS))
    return m


def entry(**kw) -> ValidationEntry:
    base = dict(prompts=4, prompt_lengths=(5, 17, 9, 30), steps=16, max_abs_diff_per_step=(1.9,) * 17,
                max_abs_diff=1.9, tolerance=3.0, greedy_identical=False, token_agreement=0.985, passed=True,
                op="native", cross_check=OpCheck("reference", 2, 2, 1.2, False, 5 / 6, True))
    return ValidationEntry(**{**base, **kw})


def test_int8_verdicts_read_as_one_pass_per_check(unvalidated):
    kv = dataclasses.replace(unvalidated.kv, dtype="int8")
    m = dataclasses.replace(unvalidated, kv=kv, validation=entry())
    assert val.verdicts(m) == [
        "validation (native CPU op, 4 prompts, 16 steps): PASS (int8 KV bound: |Δ| ≤ 3, agreement ≥ 75%): "
        "max |Δ| 1.9, 98.5% greedy agreement",
        "validation (reference op, 2 prompts, 2 steps): PASS (int8 KV bound: |Δ| ≤ 3): max |Δ| 1.2, "
        "83.3% greedy agreement"]


def test_fp32_and_fp16_bounds_and_a_failing_check(unvalidated):
    v = entry(max_abs_diff=0.02, tolerance=5e-3, greedy_identical=True, token_agreement=1.0, passed=False,
              cross_check=None, op="onnx")
    (line,) = val.verdicts(dataclasses.replace(unvalidated, validation=v))
    assert line == ("validation (onnx attention, 4 prompts, 16 steps): FAIL (fp32 bound: |Δ| ≤ 0.005, greedy "
                    "identical): max |Δ| 0.02, 100.0% greedy agreement")
    assert val.bound("fp16") == "fp16 bound: |Δ| ≤ 0.5"


def test_manifests_written_before_the_op_field_still_read(unvalidated):
    """Old plugin builds: the reference op ran the full check, the native op a second full one."""
    v = entry(op=None, cross_check=None, max_abs_diff=9e-5, tolerance=5e-3, greedy_identical=True, token_agreement=1.0,
              native_op=NativeOpValidation(6.8e-5, True, 1.0, True))
    lines = val.verdicts(dataclasses.replace(unvalidated, validation=v))
    assert [l.split(":")[0] for l in lines] == ["validation (reference op, 4 prompts, 16 steps)",
                                                "validation (native CPU op, 4 prompts, 16 steps)"]
    assert all(": PASS (fp32 bound" in l for l in lines)


def test_manifest_round_trips_the_op_and_the_cross_check(unvalidated):
    m = dataclasses.replace(unvalidated, validation=entry())
    assert Manifest.from_json(json.loads(json.dumps(m.to_json()))) == m
    bad = m.to_json()
    bad["validation"]["cross_check"]["op"] = "cuda"
    with pytest.raises(ManifestError, match="'validation.cross_check.op' is 'cuda', not one of"):
        Manifest.from_json(bad)


def test_plugin_build_checks_native_then_reference_with_progress(hf_folder, tmp_path, cpu_op):
    stages = []

    @contextlib.contextmanager
    def progress(name):
        stages.append(name)
        yield

    _, m = build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(**OPTS), progress=progress)
    v = m.validation
    assert m.kv.attention == "plugin" and v.op == "native" and v.passed
    assert (v.cross_check.op, v.cross_check.prompts, v.cross_check.steps) == ("reference", val.CROSS_CHECK_PROMPTS,
                                                                             val.CROSS_CHECK_STEPS)
    assert [s for s in stages if s.startswith("validation")] == [
        "validation: transformers' reference (4 prompts, 16 steps)", "validation: graphs with the native CPU op",
        "validation: graphs with the reference op (2 prompts, 2 steps)"]
    assert load(tmp_path / "b").validation == v  # as recorded


def test_failed_validation_names_each_check(hf_folder, tmp_path, monkeypatch, cpu_op):
    monkeypatch.setitem(val.TOLERANCE, "fp32", 1e-12)
    with pytest.raises(ValidationError) as e:
        build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(**OPTS))
    lines = str(e.value).splitlines()
    assert lines[1].startswith("validation (native CPU op, 4 prompts, 16 steps): FAIL (fp32 bound: |Δ| ≤ 1e-12")
    assert lines[2].startswith("validation (reference op, 2 prompts, 2 steps): FAIL")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("max_len,steps,expected", [(64, 16, ([5, 17, 9, 30], 16)), (32, 16, ([5, 17, 9, 30], 2)),
                                                    (16, 16, ([5, 15, 9, 15], 1)), (2, 16, ([1, 1, 1, 1], 1))])
def test_validation_fits_the_prompts_into_a_short_context(max_len, steps, expected):
    prompts, n = val.fit_prompts(val.prompt_ids(None, 128), max_len, steps)
    assert ([len(p) for p in prompts], n) == expected
    assert all(len(p) + n <= max_len for p in prompts)


def test_a_two_token_context_still_validates(hf_folder, tmp_path):
    _, m = build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(block_size=4, max_seq_len=2,
                                                                        attention=io.Attention.ONNX))
    assert m.validation.passed and m.validation.prompt_lengths == (1, 1, 1, 1) and m.validation.steps == 1


def test_int8_activations_of_7_bits_double_the_weights_bound(hf_folder, tmp_path, monkeypatch):
    """Where u8 x s8 saturates the runtime gives int8 x int8 activations 7 bits (ort_quant.ACT_QMAX):
    a quantized paged build served that way (per-channel int8; weight_matmul_accuracy "int8") is
    held to twice the bound, recorded in the manifest, and its verdicts print the recorded bound;
    the int8 pairs (~exact) and the contiguous layout (stored graphs) keep the bound."""
    from kvexport.runtime.execution import ort_quant

    src = str(hf_folder("llama", num_key_value_heads=2))
    common = dict(validate=False, **OPTS)
    _, ch = build(src, tmp_path / "ch", BuildOptions(weights="int8", calibration_tokens=64, **common))
    _, b32 = build(src, tmp_path / "b32", BuildOptions(weights="int8", weight_block_size=32, **common))
    _, fast = build(src, tmp_path / "fast", BuildOptions(weights="int4", weight_matmul_accuracy="int8", **common))
    _, cont = build(src, tmp_path / "cont", BuildOptions(weights="int8", calibration_tokens=64,
                                                         layout=io.KVLayout.CONTIGUOUS, **common))
    for qmax, factor in ((127, 1), (63, 2)):
        monkeypatch.setattr(ort_quant, "ACT_QMAX", qmax)
        assert val.tolerance(ch) == factor * val.TOLERANCE["int8_weights"]
        assert val.tolerance(fast) == factor * val.TOLERANCE["int4_weights"]
        assert val.tolerance(b32) == val.TOLERANCE["int8_weights"]
        assert val.tolerance(cont) == val.TOLERANCE["int8_weights"]
    v = entry(max_abs_diff=6.0, tolerance=8.0, token_agreement=0.941, cross_check=None)
    (line,) = val.verdicts(dataclasses.replace(ch, validation=v))
    assert line == ("validation (native CPU op, 4 prompts, 16 steps): PASS (int8 weights bound: |Δ| ≤ 8, agreement "
                    "≥ 70%): max |Δ| 6, 94.1% greedy agreement")
