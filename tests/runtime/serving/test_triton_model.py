"""The Triton model's shutdown paths, in process: `TritonPythonModel` over a real tiny build
with a stand-in for `triton_python_backend_utils` (it exists only inside Triton's stub). A
step that hangs (injected: the engine's step blocks on an event) must not hold `finalize`
past the engine thread's STOP_WAIT_S; every open request gets exactly one FINAL response,
an error; and the file named by KVEXPORT_SHUTDOWN_FILE ends open requests and refuses new
ones. The real server's SIGTERM path is tests/runtime/serving/test_triton_serve.py."""

import json
import sys
import threading
import time
import types

import numpy as np
import pytest

from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.serving import engine_thread, triton_model

FINAL = 1


class FakePb(types.ModuleType):
    """The parts of triton_python_backend_utils the model uses."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    class TritonError:
        CANCELLED, UNAVAILABLE = "CANCELLED", "UNAVAILABLE"

        def __init__(self, message, code=None):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.tensors = {t.name: t.array for t in output_tensors}
            self.error = error

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

        def as_numpy(self):
            return self.array

    class Logger:
        @staticmethod
        def log_info(msg):
            pass

    class MetricFamily:
        GAUGE, COUNTER = "gauge", "counter"

        def __init__(self, name, description, kind):
            pass

        def Metric(self, labels):  # noqa: N802 - Triton's name
            return types.SimpleNamespace(set=lambda v: None, increment=lambda v: None)

    def __init__(self):
        super().__init__("triton_python_backend_utils")

    @staticmethod
    def get_input_tensor_by_name(request, name):
        a = request.inputs.get(name)
        return None if a is None else FakePb.Tensor(name, a)

    @staticmethod
    def using_decoupled_model_transaction_policy(config):
        return True


class Sender:
    def __init__(self):
        self.responses: list[tuple[object, int]] = []
        self.final = threading.Event()

    def send(self, response, flags=0):
        assert not self.final.is_set(), "a response after the FINAL one"
        self.responses.append((response, flags))
        if flags & FINAL:
            self.final.set()


class Request:
    def __init__(self, **inputs):
        self.inputs = {k: np.asarray(v) for k, v in inputs.items()}
        self.sender = Sender()

    def get_response_sender(self):
        return self.sender

    def is_cancelled(self):
        return False

    def parameters(self):
        return "{}"


@pytest.fixture(scope="module")
def tiny(hf_folder, tmp_path_factory):
    out, _ = build(str(hf_folder("llama")), tmp_path_factory.mktemp("tm") / "tiny",
                   BuildOptions(max_seq_len=128, validate=False))
    return out


@pytest.fixture
def model(tiny, tmp_path, monkeypatch):
    """An initialized model over the tiny build (KVEXPORT_SHUTDOWN_FILE: tmp_path/shutdown)."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", FakePb())
    monkeypatch.setenv(triton_model.SHUTDOWN_FILE_ENV, str(tmp_path / "shutdown"))
    m = triton_model.TritonPythonModel()
    config = {"parameters": {"build_dir": {"string_value": str(tiny)}, "kv_cache_memory": {"string_value": "1MiB"},
                             "threads": {"string_value": "1"}}}
    m.initialize({"model_config": json.dumps(config), "model_repository": str(tmp_path), "model_name": "tiny",
                  "model_version": "1", "model_instance_name": "tiny_0"})
    yield m
    if m.worker.is_alive():
        m.finalize()


def _long(stream=True):
    return Request(input_ids=np.array([3, 4, 5], np.int32), max_tokens=np.array([120], np.int32),
                   ignore_eos=np.array([True]), stream=np.array([stream]))


def _hang_steps(model):
    """Injected: from the next step on, engine.step() blocks until the returned event is set."""
    release, entered = threading.Event(), threading.Event()
    real = model.engine.step

    def step():
        entered.set()
        release.wait(60)
        return real()

    model.engine.step = step
    return release, entered


def _slow_steps(model, seconds: float) -> None:
    """Injected: every step takes at least `seconds` (the tiny model is done in milliseconds)."""
    real = model.engine.step

    def step():
        time.sleep(seconds)
        return real()

    model.engine.step = step


def _only_final_error(req) -> str:
    (resp, flags), = [(r, f) for r, f in req.sender.responses if f & FINAL]
    assert resp.error is not None and req.sender.responses[-1] == (resp, flags)
    return resp.error.message


def test_finalize_does_not_wait_for_a_hung_step_and_ends_every_request(model):
    reqs = [_long(stream=True), _long(stream=False)]
    release, entered = _hang_steps(model)
    try:
        model.execute(reqs)
        assert entered.wait(30)
        t0 = time.monotonic()
        model.finalize()
        took = time.monotonic() - t0
        assert took < engine_thread.STOP_WAIT_S + 1.0, took
        for r in reqs:
            assert r.sender.final.is_set() and "unloaded" in _only_final_error(r)
    finally:
        release.set()  # the hung step returns: it must deliver nothing more (Sender asserts)
    time.sleep(0.5)
    assert all(len([1 for _, f in r.sender.responses if f & FINAL]) == 1 for r in reqs)


def test_the_shutdown_file_ends_open_requests_and_refuses_new_ones(model, tmp_path):
    first = _long()
    _slow_steps(model, 0.05)  # 120 tokens: 6 s
    model.execute([first])
    deadline = time.monotonic() + 30
    while not first.sender.responses:  # tokens are flowing
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (tmp_path / "shutdown").touch()
    assert first.sender.final.wait(5)
    assert _only_final_error(first) == "the server is shutting down"
    late = _long()
    model.execute([late])
    assert late.sender.final.is_set() and "shutting down" in _only_final_error(late)
    deadline = time.monotonic() + 10
    while model.engine.pool.num_used_blocks:  # the aborted request's blocks are back
        assert time.monotonic() < deadline
        time.sleep(0.05)
    model.finalize()


def test_finalize_of_an_idle_model_is_quick(model):
    ok = Request(input_ids=np.array([3, 4], np.int32), max_tokens=np.array([3], np.int32))
    model.execute([ok])
    assert ok.sender.final.wait(30)
    (resp, _), = ok.sender.responses
    assert resp.error is None and len(resp.tensors["token_ids"]) == 3
    t0 = time.monotonic()
    model.finalize()
    assert time.monotonic() - t0 < 1.5 and not model.worker.is_alive()


def test_the_model_carries_speculative_decoding_and_the_request_input_turns_it_off(tiny, tmp_path, monkeypatch):
    """config.pbtxt `speculative: ngram` (an EngineConfig setting): the same greedy tokens as a
    request sending `speculative` false, which drafts nothing (the engine's counters)."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", FakePb())
    m = triton_model.TritonPythonModel()
    params = {"build_dir": str(tiny), "kv_cache_memory": "1MiB", "threads": "1", "speculative": "ngram",
              "num_speculative_tokens": "3"}
    m.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}}),
                  "model_repository": str(tmp_path), "model_name": "tiny", "model_version": "1",
                  "model_instance_name": "tiny_0"})
    try:
        prompt = np.array([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], np.int32)  # repeats itself: n-gram drafts match
        got = {}
        for spec in (False, True):
            before = m.engine.spec_stats().num_draft_tokens
            r = Request(input_ids=prompt, max_tokens=np.array([24], np.int32), ignore_eos=np.array([True]),
                        speculative=np.array([spec]))
            m.execute([r])
            assert r.sender.final.wait(30)
            (resp, _), = r.sender.responses
            assert resp.error is None
            got[spec] = (resp.tensors["token_ids"].tolist(), m.engine.spec_stats().num_draft_tokens - before)
        assert got[True][0] == got[False][0] and len(got[True][0]) == 24
        assert got[False][1] == 0 < got[True][1], got
    finally:
        m.finalize()


def test_the_model_serves_lora_adapters_by_the_request_input(hf_folder, tmp_path, monkeypatch):
    """config.pbtxt `lora_modules` on a --lora-max-rank build: a request's `lora` input runs its adapter (the same
    tokens as the Python API's SamplingParams.lora, which tests/runtime/test_lora_serving.py holds to peft's); one
    naming an adapter not loaded gets an error naming `lora`."""
    pytest.importorskip("peft")  # NOTE: imported here, not at collection (it sets triton up: plugins' conftest)
    from kvexport import LLM, SamplingParams

    from testkit.lora_adapters import make_adapter

    folder = hf_folder("llama")
    out, _ = build(str(folder), tmp_path / "lora", BuildOptions(max_seq_len=64, block_size=4, lora_max_rank=4,
                                                                validate=False))
    make_adapter(folder, tmp_path / "a", 0, r=4, target_modules=["q_proj", "v_proj"])
    prompt = [5, 6, 7, 8, 9, 10, 11]
    llm = LLM(out, lora_modules=f"one={tmp_path / 'a'}", kv_cache_memory="4MiB")
    want = {name: llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, lora=name))[0].token_ids
            for name in (None, "one")}
    assert want[None] != want["one"], "the adapter changes no token: a weak test"
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", FakePb())
    m = triton_model.TritonPythonModel()
    params = {"build_dir": str(out), "kv_cache_memory": "4MiB", "threads": "1", "lora_modules": f"one={tmp_path / 'a'}"}
    m.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}}),
                  "model_repository": str(tmp_path), "model_name": "tiny", "model_version": "1",
                  "model_instance_name": "tiny_0"})
    try:
        for name in (None, "one"):
            extra = {"lora": np.array([name.encode()], dtype=object)} if name else {}
            r = Request(input_ids=np.array(prompt, np.int64), max_tokens=np.array([8], np.int64),
                        ignore_eos=np.array([True]), **extra)
            m.execute([r])
            assert r.sender.final.wait(30)
            (resp, _), = r.sender.responses
            assert resp.error is None and resp.tensors["token_ids"].tolist() == want[name]
        r = Request(input_ids=np.array(prompt, np.int64), lora=np.array([b"two"], dtype=object))
        m.execute([r])
        assert r.sender.final.wait(30)
        assert "lora: no adapter 'two' is loaded" in _only_final_error(r)
    finally:
        m.finalize()
