"""The engine thread shared by `kvexport serve` and the Triton model survives failures: a
failing step fails the running requests and keeps serving; a message it cannot handle is
logged; a stopped thread refuses new work instead of queueing it forever. The failures are
injected by replacing engine methods (nothing real fails on demand), as the tests say."""

import threading

import pytest

from kvexport.errors import KvExportError
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.engine_thread import EngineThread
from kvexport.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny(hf_folder, tmp_path_factory):
    out, _ = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path_factory.mktemp("et") / "b",
                   BuildOptions(block_size=4, max_seq_len=64, validate=False))
    return out


def _collect(worker, prompt, max_tokens=4):
    done, events = threading.Event(), []

    def deliver(ev):
        events.append(ev)
        if ev.finished:
            done.set()

    worker.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), deliver)
    assert done.wait(30), "no final event"
    return events


def test_a_failing_step_fails_its_requests_and_the_thread_keeps_serving(tiny):
    engine = LLMEngine(tiny)
    real_step, calls = engine.step, {"n": 0}

    def flaky_step():  # injected failure: the first step raises
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real_step()

    engine.step = flaky_step
    worker = EngineThread(engine)
    worker.start()
    try:
        failed = _collect(worker, [5, 6, 7])
        assert failed[-1].finish_reason == "error" and "boom" in failed[-1].error
        ok = _collect(worker, [5, 6, 7])
        assert ok[-1].finish_reason == "length" and sum(len(e.new_token_ids) for e in ok) == 4
        assert engine.pool.num_used_blocks == 0 and worker.is_alive()
    finally:
        worker.stop()


def test_a_message_that_fails_is_logged_and_the_thread_survives(tiny, caplog):
    engine = LLMEngine(tiny)
    worker = EngineThread(engine)

    def broken_abort(rid):  # injected failure
        raise RuntimeError("abort failed")

    worker.start()
    try:
        engine.abort = broken_abort
        worker._sinks["x"] = None  # an unknown request id that "exists", so abort is attempted
        worker.abort(["x"])
        ok = _collect(worker, [9, 10])
        assert ok[-1].finish_reason == "length" and worker.is_alive()
        assert "handling" in caplog.text
    finally:
        worker._sinks.pop("x", None)
        worker.stop()


def test_a_stopped_thread_refuses_new_work(tiny):
    worker = EngineThread(LLMEngine(tiny))
    worker.start()
    worker.stop()
    with pytest.raises(KvExportError, match="stopped"):
        worker.submit([5, 6], SamplingParams(max_tokens=2), lambda ev: None)


def test_a_request_that_breaks_the_backend_fails_alone_among_concurrent_ones(tiny):
    """Injected failure: the real backend raises when the poison token id is in a step.
    The poisoned request gets an error event; the concurrent ones finish normally, with
    the tokens they get when served without it; bad token ids get an error event."""
    clean = EngineThread(LLMEngine(tiny))
    clean.start()
    try:
        expect = [_collect(clean, p) for p in ([5, 6, 7], [9, 10, 11, 12])]
    finally:
        clean.stop()
    engine = LLMEngine(tiny)
    real = engine.backend.execute

    def execute(inp, all_tokens=False):
        if 77 in inp.token_ids.tolist():
            raise RuntimeError("injected backend failure")
        return real(inp, all_tokens)

    engine.backend.execute = execute
    worker = EngineThread(engine)
    worker.start()
    try:
        done, events = threading.Event(), {}

        def sink(i):
            def deliver(ev):
                events.setdefault(i, []).append(ev)
                if ev.finished and len([e for v in events.values() for e in v if e.finished]) == 4:
                    done.set()
            return deliver

        params = SamplingParams(max_tokens=4, ignore_eos=True)
        for i, p in enumerate(([5, 6, 7], [20, 77, 21], [9, 10, 11, 12], [60000])):
            worker.submit(p, params, sink(i))
        assert done.wait(30)
        assert events[1][-1].finish_reason == "error" and "injected" in events[1][-1].error
        assert events[3][-1].finish_reason == "error" and "vocabulary" in events[3][-1].error
        for i, want in ((0, expect[0]), (2, expect[1])):
            got = [t for e in events[i] for t in e.new_token_ids]
            assert got == [t for e in want for t in e.new_token_ids] and events[i][-1].finish_reason == "length"
        assert engine.pool.num_used_blocks == 0 and worker.is_alive()
    finally:
        worker.stop()
