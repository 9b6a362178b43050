"""The model runner: `pack()` builds exactly the paged inputs the graphs take (the one
packing function: engine, validation, samples and benches use it), a step is split into
backend calls only for a backend that pads queries, and a request whose part of a step
fails in the backend fails alone — the runner finds it by running halves again and the
other requests get the logits they would have got without it.

The failures are injected by wrapping a real onnxruntime backend so that it raises when a
poison token id is in the step (nothing real fails on demand); everything else is real."""

import numpy as np
import pytest

from kvexport import io
from kvexport import manifest as mf
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.execution.model_runner import ModelRunner, _groups, chunk, pack
from kvexport.runtime.execution.ort_backends import ort_backend
from kvexport.runtime.sampling_params import SamplerState, SamplingParams
from kvexport.runtime.core.outputs import ScheduledRequest, SchedulerOutput

BS = 4
POISON = 77


def test_chunk_slots_follow_the_block_table():
    c = chunk("a", [5, 6, 7], 3, [9, 2], BS)
    assert c.slot_mapping == (9 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1) and c.start_pos == 3 and c.samples


def test_pack_onnx_attention_cuts_tables_to_earlier_steps():
    rows = [chunk("a", [1, 2, 3], 0, [5, 6], BS), chunk("b", [4], 6, [7, 8, 9], BS)]
    inp = pack(rows, BS, full_tables=False)
    assert inp.token_ids.tolist() == [1, 2, 3, 4] and inp.positions.tolist() == [0, 1, 2, 6]
    assert inp.query_start_loc.tolist() == [0, 3, 4] and inp.seq_lens.tolist() == [3, 7]
    # "a" reads nothing from the pool (a fresh prompt); "b" reads its 6 earlier tokens: 2 blocks
    assert inp.block_tables.tolist() == [[io.PAD_BLOCK_ID, io.PAD_BLOCK_ID], [7, 8]]
    assert inp.slot_mapping.tolist() == [20, 21, 22, 8 * 4 + 2]
    assert not inp.is_decode and inp.phase is io.Phase.PREFILL
    assert all(a.dtype == np.int64 for a in inp.feeds().values())


def test_pack_plugin_tables_cover_this_step():
    rows = [chunk("a", [1, 2, 3], 0, [5, 6], BS), chunk("b", [4], 6, [7, 8, 9], BS)]
    inp = pack(rows, BS, full_tables=True)
    assert inp.block_tables.tolist() == [[5, io.PAD_BLOCK_ID], [7, 8]]
    dec = pack([chunk("a", [1], 4, [5, 6], BS), chunk("b", [2], 8, [7, 8, 9], BS)], BS, full_tables=True)
    assert dec.is_decode and dec.phase is io.Phase.DECODE and dec.block_tables.tolist() == [[5, 6, 0], [7, 8, 9]]


def test_groups_keep_decodes_together_and_padding_bounded():
    assert _groups([1, 1, 1], 1.25) == [[0, 1, 2]]
    assert _groups([8, 1, 7, 2, 1], 1.25) == [[0, 2], [3], [1, 4]]


@pytest.fixture(scope="module")
def tiny(hf_folder, tmp_path_factory):
    out, _ = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path_factory.mktemp("mr") / "b",
                   BuildOptions(block_size=BS, max_seq_len=64, validate=False, attention=io.Attention.ONNX))
    return out, mf.load(out)


class Poisoned:
    """A real backend that raises when the poison token is in the step (injected failure)."""

    def __init__(self, real):
        self.real, self.calls = real, 0
        self.num_blocks, self.full_block_tables, self.pads_queries = real.num_blocks, real.full_block_tables, False
        self.attention_impl, self.groups = real.attention_impl, real.groups

    def execute(self, inp, all_tokens=False):
        self.calls += 1
        if POISON in inp.token_ids.tolist():
            raise RuntimeError("injected backend failure")
        return self.real.execute(inp, all_tokens)


def _rows(prompts):
    params = SamplingParams(max_tokens=4)
    out = []
    for s, p in enumerate(prompts):
        c = chunk(f"r{s}", p, 0, [1 + 3 * s, 2 + 3 * s, 3 + 3 * s], BS)
        out.append(ScheduledRequest(c.request_id, c.token_ids, 0, c.block_table, c.slot_mapping, True,
                                    SamplerState.create(params), 0))
    return out


def test_a_failing_request_fails_alone_and_the_others_get_their_logits(tiny):
    build_dir, m = tiny
    prompts = [[5, 6, 7], [8, POISON, 9, 10], [11, 12], [13, 14, 15, 16, 17]]
    rows = _rows(prompts)
    backend = Poisoned(ort_backend(build_dir, m, 16))
    res = ModelRunner(backend, BS).execute(SchedulerOutput(tuple(rows), 14, ()))
    assert list(res.failed) == ["r1"] and "injected backend failure" in res.failed["r1"]
    assert sorted(res.sampled) == ["r0", "r2", "r3"]
    assert backend.calls > 1  # the halves were run again
    clean = ModelRunner(ort_backend(build_dir, m, 16), BS)
    expect = clean.logits([rows[i] for i in (0, 2, 3)])
    got = ModelRunner(Poisoned(ort_backend(build_dir, m, 16)), BS)._isolating(rows)[0]
    np.testing.assert_allclose(got[[0, 2, 3]], expect, atol=1e-5)
    greedy = {f"r{i}": int(expect[k].argmax()) for k, i in enumerate((0, 2, 3))}
    assert {r: t.token_id for r, t in res.sampled.items()} == greedy


def test_every_request_failing_is_reported_not_raised(tiny):
    build_dir, m = tiny
    rows = _rows([[POISON, 5], [6, POISON]])
    res = ModelRunner(Poisoned(ort_backend(build_dir, m, 16)), BS).execute(SchedulerOutput(tuple(rows), 4, ()))
    assert sorted(res.failed) == ["r0", "r1"] and not res.sampled


def test_serving_imports_neither_torch_nor_the_exporter():
    """The model runner (shared with validation and the benches), the engine and the
    onnxruntime backends import no torch and nothing of the exporter (the Triton
    environment has no torch)."""
    import subprocess
    import sys

    code = ("import sys, kvexport.runtime.execution.model_runner, kvexport.runtime.engine, kvexport.runtime.execution.ort_backends; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvexport.exporter')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]", out.stdout
