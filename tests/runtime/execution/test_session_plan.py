"""runtime/execution/session_plan.py: the sessions every (weights form x dtype x accuracy) opens,
each with its step range, rewrites and MatMulNBits level; which accuracy applies (the setting, the
build's recorded one, the default for builds before); and the words `inspect` prints."""

import itertools

import pytest

from kvexport.manifest import QuantizedMatrices, QuantizedTable, WeightQuantizationEntry
from kvexport.runtime.execution.session_plan import (DEFAULT_ACCURACY, LARGE_STEP_TOKENS, WEIGHT_MATMUL_ACCURACY,
                                                     Rewrite, SessionPlan, describe, plan_sessions, resolve_accuracy)

CH8, DYN, PAIR, HEAD = (Rewrite.BLOCKS_TO_INT8_CHANNEL, Rewrite.INT8_DYNAMIC, Rewrite.BLOCKS_TO_INT8_PAIR,
                        Rewrite.INT8_BLOCKS_TO_MATMULNBITS)


def weights(form: str, matmul_accuracy: str | None = None) -> WeightQuantizationEntry | None:
    """A manifest record of `form`: "float" (None), "int8-channel", "int4-channel", "int8-blocks",
    "int4-blocks"."""
    if form == "float":
        return None
    precision, layout = form.split("-")
    return WeightQuantizationEntry(
        precision=precision, bits=8 if precision == "int8" else 4,
        block_size="channel" if layout == "channel" else 32, axis="input (K)", method="rtn", symmetric=True,
        block_offsets=False, scales_dtype="float32", code_dtype="int8", format="onnx QDQ",
        quantized=QuantizedMatrices(9, {"rtn": 9}, "model.layers.*"), kept={}, requantized_from=None,
        lm_head=QuantizedTable(8, 32, "rtn"), matmul_accuracy=matmul_accuracy)


ONE = lambda rewrites, level, form="stored": ((1, None, rewrites, level, form),)  # noqa: E731
SPLIT = lambda form, rewrites, large_level: ((1, LARGE_STEP_TOKENS[form], (), 4, "stored"),  # noqa: E731
                                             (LARGE_STEP_TOKENS[form], None, rewrites, large_level, form))
# (weights form, dtype, accuracy) -> the plans as (min_tokens, max_tokens, rewrites, level, form)
TABLE = {
    **{("float", d, a): ONE((), None) for d in ("fp32", "fp16") for a in WEIGHT_MATMUL_ACCURACY},
    **{("int8-channel", d, a): ONE((DYN,), 0 if a == "float" else 4, "int8-dynamic")
       for d in ("fp32", "fp16") for a in WEIGHT_MATMUL_ACCURACY},
    **{("int4-channel", d, a): ONE((), 0 if a == "float" else 4)
       for d in ("fp32", "fp16") for a in WEIGHT_MATMUL_ACCURACY},
    ("int8-blocks", "fp32", "auto"): SPLIT("pair", (PAIR,), 4),
    ("int4-blocks", "fp32", "auto"): SPLIT("pair", (PAIR,), 4),
    ("int8-blocks", "fp16", "auto"): ONE((), 4),
    ("int4-blocks", "fp16", "auto"): SPLIT("float", (HEAD,), 0),
    ("int8-blocks", "fp32", "int8"): SPLIT("int8", (CH8, DYN), 4),
    ("int4-blocks", "fp32", "int8"): SPLIT("int8", (CH8, DYN), 4),
    ("int8-blocks", "fp16", "int8"): ONE((), 4),
    ("int4-blocks", "fp16", "int8"): ONE((), 4),
    **{(f, d, "float"): ONE((), 0) for f in ("int8-blocks", "int4-blocks") for d in ("fp32", "fp16")},
}


def test_the_table_covers_every_row():
    forms = ("float", "int8-channel", "int4-channel", "int8-blocks", "int4-blocks")
    assert set(TABLE) == set(itertools.product(forms, ("fp32", "fp16"), WEIGHT_MATMUL_ACCURACY))


@pytest.mark.parametrize("form,dtype,accuracy", sorted(TABLE))
def test_plan_sessions(form, dtype, accuracy):
    plans = plan_sessions(weights(form), dtype, accuracy)
    got = tuple((p.min_tokens, p.max_tokens, p.rewrites, p.level, p.form) for p in plans)
    assert got == TABLE[form, dtype, accuracy]
    # every step size runs in exactly one session
    for tokens in (1, 2, 3, 4, 7, 8, 31, 32, 512):
        assert sum(p.runs(tokens) for p in plans) == 1


@pytest.mark.parametrize("form,dtype,accuracy", sorted(TABLE))
def test_without_derived_graphs_one_session_opens_the_stored_graph(form, dtype, accuracy):
    """Providers other than onnxruntime's CPU, and the reference op's backend, open the graph file
    as is: one session, at the accuracy's MatMulNBits level."""
    (p,) = plan_sessions(weights(form), dtype, accuracy, derive=False)
    assert (p.min_tokens, p.max_tokens, p.rewrites, p.form) == (1, None, (), "stored")
    assert p.level == (None if form == "float" else 0 if accuracy == "float" else 4)


def test_a_split_of_one_token_runs_every_step_in_the_large_form(monkeypatch):
    """bench/step_sizes.py times each form alone by moving the split."""
    from kvexport.runtime.execution import session_plan

    monkeypatch.setitem(session_plan.LARGE_STEP_TOKENS, "pair", 1)
    assert plan_sessions(weights("int4-blocks"), "fp32", "auto") == (SessionPlan(1, None, (PAIR,), 4, "pair"),)


def test_an_unknown_accuracy_is_refused():
    with pytest.raises(ValueError, match="fp8"):
        plan_sessions(weights("int4-blocks"), "fp32", "fp8")


@pytest.mark.parametrize("recorded,setting,expected", [
    (None, None, DEFAULT_ACCURACY),  # builds before the record
    ("int8", None, "int8"),  # the build's own
    ("int8", "auto", "auto"), ("auto", "float", "float"),  # the setting wins
])
def test_which_accuracy_applies(recorded, setting, expected):
    assert resolve_accuracy(weights("int4-blocks", recorded), setting) == expected
    assert resolve_accuracy(None, setting) == (setting or DEFAULT_ACCURACY)  # float weights: nothing recorded


def test_described_in_words():
    q = weights("int8-channel")
    assert describe(plan_sessions(q, "fp32", "int8"), q) == (
        "every step: int8 x int8 MatMulIntegerToFloat, per-token int8 activations; "
        "LM head: MatMulNBits (int8 activations per block of K)")
    q = weights("int4-blocks")
    assert describe(plan_sessions(q, "fp32", "int8"), q) == (
        "steps of 1-3 tokens: MatMulNBits (int8 activations per block of K); steps of 4+ tokens: per-channel "
        "int8 x per-token int8 MatMulIntegerToFloat (the blocks re-rounded per channel); LM head: MatMulNBits "
        "(int8 activations per block of K)")
    assert describe(plan_sessions(q, "fp32", "float"), q) == "every step: MatMulNBits (float activations, exact)"
    assert describe(plan_sessions(None, "fp32", "auto"), None) == "every step: float MatMul"
