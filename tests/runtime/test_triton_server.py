"""`kvexport triton`: the generated repository (config.pbtxt parsed back with Triton's
ModelConfig schema, refused options), then the real `tritonserver` from nvidia-pytriton
(CPU, 127.0.0.1) serving a tiny build and smollm2-135m: concurrent gRPC streams equal the
runtime's own greedy output, a cancelled stream frees its KV blocks (seen through the
kvexport_* metrics on Triton's metrics port), and bad requests get errors while the server
stays healthy."""

import os
import queue
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from kvexport import LLM, SamplingParams, io
from kvexport.cli import main
from kvexport.errors import BuildExistsError, ConfigError, KvExportError
from kvexport.exporter.build import BuildOptions, build
from kvexport.plugins.paged_attention.native import LIB_NAME
from kvexport.runtime import metrics as mx
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.requests import RequestParser
from kvexport.runtime.triton_model import engine_settings
from kvexport.runtime.triton_repo import TritonRepoOptions, check_repository, load_config, write_repository

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[2]
TRITON_ENV = Path(os.environ.get("KVEXPORT_TRITON_ENV", REPO_ROOT / ".venv-triton"))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:"]
TINY_PROMPTS = [[1, 5, 9, 3], [7, 7, 2, 11, 40, 41, 42], [100, 3]]


@pytest.fixture(scope="module")
def tiny_build(hf_folder, tmp_path_factory):
    out, _ = build(str(hf_folder("llama")), tmp_path_factory.mktemp("tt") / "tiny",
                   BuildOptions(max_seq_len=128, validate=False, attention=io.Attention.ONNX))
    return out


@pytest.fixture(scope="module")
def tiny_plugin_build(hf_folder, tmp_path_factory):
    out, _ = build(str(hf_folder("llama")), tmp_path_factory.mktemp("tp") / "tinyp",
                   BuildOptions(max_seq_len=128, validate=False, attention=io.Attention.PLUGIN))
    return out


# ---- the repository, no server ----------------------------------------------------------------
def test_config_is_generated_from_data_and_parses_back(tiny_build, tmp_path):
    engine = EngineConfig(max_num_seqs=8, kv_cache_memory="4MiB", threads=2)
    model_dir = write_repository(tiny_build, tmp_path / "repo", TritonRepoOptions(engine=engine, name="m", instances=2))
    cfg = load_config(model_dir / "config.pbtxt")
    assert cfg.name == "m" and cfg.backend == "python" and cfg.max_batch_size == 0
    assert cfg.model_transaction_policy.decoupled
    assert [i.name for i in cfg.input][:2] == ["text_input", "input_ids"] and all(i.optional for i in cfg.input)
    assert [o.name for o in cfg.output] == ["text_output", "token_ids", "finish_reason"]
    assert cfg.instance_group[0].count == 2
    p = {k: v.string_value for k, v in cfg.parameters.items()}
    assert p["max_num_seqs"] == "8" and p["kv_cache_memory"] == "4MiB" and p["backend"] == "onnxruntime"
    assert (model_dir / p["build_dir"]).resolve() == tiny_build.resolve()  # relative to the model's folder
    # the model reads back exactly the EngineConfig that was written
    build_dir, cfg = engine_settings({k: {"string_value": v} for k, v in p.items()}, model_dir)
    assert build_dir == tiny_build.resolve() and cfg == engine
    assert set(p) == {"build_dir", *engine.to_strings()}
    assert "TritonPythonModel" in (model_dir / "1" / "model.py").read_text()
    assert check_repository(tmp_path / "repo") == ["m"]
    (model_dir / "config.pbtxt").write_text((model_dir / "config.pbtxt").read_text() + "no_such_field: 1\n")
    with pytest.raises(ConfigError, match="not a valid Triton model config"):
        load_config(model_dir / "config.pbtxt")


def test_copy_build_is_self_contained(tiny_build, tmp_path):
    model_dir = write_repository(tiny_build, tmp_path / "repo", TritonRepoOptions(copy_build=True))
    p = {k: v.string_value for k, v in load_config(model_dir / "config.pbtxt").parameters.items()}
    assert p["build_dir"] == "build" and (model_dir / "build" / "kvexport.json").exists()
    assert model_dir.name == tiny_build.name


def test_copy_build_into_a_repository_inside_the_build(tiny_build, tmp_path):
    """DESIGN.md's layout: build/<name>/triton/. Copying the build must skip the repository."""
    import shutil

    build = tmp_path / "b"
    shutil.copytree(tiny_build, build)
    model_dir = write_repository(build, build / "triton", TritonRepoOptions(copy_build=True, name="m"))
    copied = model_dir / "build"
    assert (copied / "kvexport.json").exists() and not (copied / "triton").exists()
    assert sorted(p.name for p in (build / "triton").iterdir()) == ["kvexport-triton.json", "m"]
    write_repository(build, build / "triton", TritonRepoOptions(copy_build=True, name="m", force=True))
    assert not (build / "triton" / "m" / "build" / "triton").exists()


def test_default_name_is_the_build_folder_as_given(tiny_build, tmp_path):
    (tmp_path / "my-model").symlink_to(tiny_build)
    model_dir = write_repository(tmp_path / "my-model", tmp_path / "repo")
    assert model_dir.name == "my-model" and load_config(model_dir / "config.pbtxt").name == "my-model"


def test_refusals(tiny_build, hf_folder, tmp_path):
    write_repository(tiny_build, tmp_path / "repo")
    with pytest.raises(BuildExistsError, match="--force"):
        write_repository(tiny_build, tmp_path / "repo")
    write_repository(tiny_build, tmp_path / "repo", TritonRepoOptions(name="again", force=True))
    assert check_repository(tmp_path / "repo") == ["again"]  # replaced, not merged
    with pytest.raises(ConfigError, match="no TensorRT engines"):
        write_repository(tiny_build, tmp_path / "r2", TritonRepoOptions(engine=EngineConfig(backend="tensorrt")))
    with pytest.raises(ConfigError, match="Triton model name"):
        TritonRepoOptions(name="a/b")
    with pytest.raises(ConfigError, match="max_num_seqs"):
        TritonRepoOptions(engine=EngineConfig(max_num_seqs=0))
    with pytest.raises(ConfigError, match="--instances"):
        TritonRepoOptions(instances=0)
    contiguous, _ = build(str(hf_folder("llama")), tmp_path / "contig", BuildOptions(layout=io.KVLayout.CONTIGUOUS, max_seq_len=64,
                                                                               validate=False))
    with pytest.raises(ConfigError, match="--layout paged"):
        write_repository(contiguous, tmp_path / "r3")
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_cli(tiny_build, tmp_path):
    r = CliRunner().invoke(main, ["triton", str(tiny_build), "--out", str(tmp_path / "repo"), "--name", "tiny",
                                  "--max-num-seqs", "4", "--instances", "1"])
    assert r.exit_code == 0, r.output
    assert check_repository(tmp_path / "repo") == ["tiny"]
    r = CliRunner().invoke(main, ["triton", str(tiny_build), "--out", str(tmp_path / "repo")])
    assert r.exit_code == 2 and "--force" in r.output


def test_engine_settings_from_parameters(tmp_path):
    par = lambda **kw: {k: {"string_value": v} for k, v in kw.items()}  # noqa: E731
    build_dir, cfg = engine_settings(par(build_dir="b", max_num_seqs="4", threads="0", EXECUTION_ENV_PATH="/env"),
                                     tmp_path)
    assert build_dir == tmp_path / "b" and cfg == EngineConfig(max_num_seqs=4)  # absent: EngineConfig's defaults
    with pytest.raises(ConfigError, match="unknown runtime setting"):
        engine_settings(par(build_dir="b", max_num_seq="4"), tmp_path)  # a typo is not ignored
    with pytest.raises(ConfigError, match="max_num_seqs"):
        engine_settings(par(build_dir="b", max_num_seqs="0"), tmp_path)
    with pytest.raises(KvExportError, match="build_dir"):
        engine_settings(par(max_num_seqs="4"), tmp_path)


def test_parse_request_validates_inputs():
    from kvexport.runtime.triton_model import RequestError, parse_request

    i32 = lambda v: np.array([v], np.int32)  # noqa: E731
    ids = np.array([1, 2, 3], np.int32)
    tok = lambda text: {"input_ids": [5] * len(text)}  # noqa: E731 - a tokenizer stand-in
    with_tok, no_tok = RequestParser(tok, 50, 100), RequestParser(None, 50, 100)
    prompt, params, stream = parse_request({"input_ids": ids, "max_tokens": i32(100), "stream": np.array([True]),
                                            "stop": np.array([b"\n", b"END"], dtype=object)}, no_tok)
    assert prompt == [1, 2, 3] and params.max_tokens == 97 and stream and params.stop == ("\n", "END")
    prompt, params, stream = parse_request({"text_input": np.array([b"hey"], dtype=object)}, with_tok)
    assert prompt == [5, 5, 5] and params.max_tokens == 16 and params.greedy and not stream
    for arrays, parser, msg in [
            ({}, with_tok, "exactly one"),
            ({"input_ids": ids, "text_input": np.array([b"hi"], dtype=object)}, with_tok, "exactly one"),
            ({"input_ids": ids, "max_tokens": i32(0)}, no_tok, "max_tokens must be in"),
            ({"input_ids": ids, "max_tokens": i32(101)}, no_tok, "max_tokens must be in"),
            ({"input_ids": ids, "max_tokens": np.array([3.0], np.float32)}, no_tok, "must be INT32"),
            ({"input_ids": ids, "top_k": np.array([1, 2], np.int32)}, no_tok, "one value"),
            ({"input_ids": ids, "bogus": i32(1)}, no_tok, "unknown input"),
            ({"input_ids": np.array([], np.int32)}, no_tok, "empty"),
            ({"input_ids": np.arange(100, dtype=np.int32) % 50}, no_tok, "context holds"),
            ({"input_ids": np.array([1, -1], np.int32)}, no_tok, "token id -1 is outside"),  # would wrap
            ({"input_ids": np.array([1, 50], np.int32)}, no_tok, "token id 50 is outside"),
            ({"text_input": np.array([b"hi"], dtype=object)}, no_tok, "no tokenizer"),
            ({"text_input": np.array([b"\xff"], dtype=object)}, with_tok, "UTF-8"),
            ({"input_ids": ids, "temperature": np.array([-1.0], np.float32)}, no_tok, "temperature")]:
        with pytest.raises(RequestError, match=msg):
            parse_request(arrays, parser)
    # a /generate JSON field that is no input arrives as a request parameter: refused, not ignored
    with pytest.raises(RequestError, match="unknown input.*'max_token'") as e:
        parse_request({"input_ids": ids}, no_tok, {"max_token": 5})
    assert e.value.param == "max_token"
    assert parse_request({"input_ids": ids}, no_tok, {"triton_enable_empty_final_response": True})[0] == [1, 2, 3]


# ---- the real server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_build, tiny_plugin_build, smollm2_build, tmp_path_factory, free_ports):
    from kvexport.runtime.triton_local import (Ports, ServerStartError, backend_dir, find_triton, python_version,
                                               server_command, wait_http_ready)

    if not (TRITON_ENV / "bin" / "python3").exists():
        pytest.skip(f"no Triton execution environment at {TRITON_ENV}: run scripts/install.sh")
    triton = find_triton(TRITON_ENV)
    d = tmp_path_factory.mktemp("triton")
    # the tiny model: two instances, a copied build (a non-version folder inside the model's folder)
    write_repository(tiny_build, d / "repo", TritonRepoOptions(
        engine=EngineConfig(kv_cache_memory="1MiB", threads=1), name="tiny", instances=2, copy_build=True,
        execution_env=str(TRITON_ENV)))
    write_repository(smollm2_build, d / "repo2", TritonRepoOptions(
        engine=EngineConfig(kv_cache_memory="64MiB", threads=2), name="smol", execution_env=str(TRITON_ENV)))
    (d / "repo2" / "smol").rename(d / "repo" / "smol")
    # a plugin build: the Triton environment runs the native CPU PagedAttention op (it has no
    # onnxruntime-extensions, so without the op this model would fail to load)
    if (TRITON_ENV / "lib" / "kvexport" / LIB_NAME).is_file():
        write_repository(tiny_plugin_build, d / "repo3", TritonRepoOptions(
            engine=EngineConfig(kv_cache_memory="1MiB", threads=1), name="tinyp", execution_env=str(TRITON_ENV)))
        (d / "repo3" / "tinyp").rename(d / "repo" / "tinyp")
    ports = Ports(*free_ports(3))
    argv, env = server_command(triton, d / "repo", backend_dir(triton, python_version(TRITON_ENV), d / "backends"),
                               ports)
    log = d / "tritonserver.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=d, start_new_session=True)
    try:
        try:
            wait_http_ready(f"http://{HOST}:{ports.http}/v2/health/ready", proc, 180)
        except ServerStartError as e:
            pytest.fail(f"tritonserver did not become ready ({e}); its log:\n"
                        f"{log.read_text(errors='replace')[-6000:]}")
        print(f"tritonserver ready in {time.monotonic() - t0:.1f}s")
        yield ports
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class Stream:
    """One gRPC stream: send requests, collect responses until each has its final one."""

    def __init__(self, ports):
        import tritonclient.grpc as grpcclient

        self.g = grpcclient
        self.client = grpcclient.InferenceServerClient(f"{HOST}:{ports.grpc}")
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)))

    def send(self, model: str, rid: str, **inputs):
        types = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(np.bool_): "BOOL",
                 np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64", np.dtype(np.int64): "INT64"}
        tensors = []
        for name, value in inputs.items():
            a = np.asarray(value)
            if a.dtype.kind in "US":
                a = np.array([s.encode() for s in a.reshape(-1)], dtype=object).reshape(a.shape)
            t = self.g.InferInput(name, list(a.shape), types[a.dtype])
            t.set_data_from_numpy(a)
            tensors.append(t)
        self.client.async_stream_infer(model, tensors, request_id=rid)

    def next(self, timeout: float = 60):
        return self.q.get(timeout=timeout)

    def collect(self, n: int, timeout: float = 120) -> dict[str, dict]:
        """Responses of n requests until each one's final response: id -> text, ids, reason, chunks."""
        out: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while sum(1 for r in out.values() if r["reason"]) < n:
            result, error = self.next(max(0.1, deadline - time.monotonic()))
            assert error is None, error
            rid = result.get_response().id
            r = out.setdefault(rid, {"text": "", "ids": [], "reason": "", "chunks": 0})
            assert not r["reason"], f"response after the final one for {rid}"
            r["text"] += result.as_numpy("text_output")[0].decode()
            r["ids"] += result.as_numpy("token_ids").tolist()
            r["reason"] = result.as_numpy("finish_reason")[0].decode()
            r["chunks"] += 1
        return out

    def close(self, cancel: bool = False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def metrics(ports, model: str) -> dict[str, float]:
    text = httpx.get(f"http://{HOST}:{ports.metrics}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvexport_") and f'model="{model}"' in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value  # summed over instances
    return out


def wait_metric(ports, model: str, cond, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(ports, model)
        if cond(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


@pytest.mark.slow
def test_concurrent_streams_equal_the_runtime(server, smollm2_build):
    llm = LLM(smollm2_build, kv_cache_memory="64MiB")
    want = llm.generate(PROMPTS, SamplingParams(max_tokens=16))
    del llm
    s = Stream(server)
    try:
        t0 = time.monotonic()
        for i, p in enumerate(PROMPTS):
            s.send("smol", str(i), text_input=[p], max_tokens=np.array([16], np.int32), stream=[True])
        got = s.collect(len(PROMPTS))
        print(f"{len(PROMPTS)} concurrent streams of 16 tokens: {time.monotonic() - t0:.2f}s")
    finally:
        s.close()
    for i, w in enumerate(want):
        g = got[str(i)]
        assert (g["text"], g["ids"], g["reason"]) == (w.text, w.token_ids, w.finish_reason)
        assert g["chunks"] > 1  # streamed, not one response
    # the non-streaming form over HTTP /generate: one response with the whole completion
    r = httpx.post(f"http://{HOST}:{server.http}/v2/models/smol/generate",
                   json={"text_input": PROMPTS[0], "max_tokens": 16}, timeout=60).json()
    assert r["text_output"] == want[0].text and r["token_ids"] == want[0].token_ids


@pytest.mark.parametrize("model", ["tiny", "tinyp"])
def test_tiny_build_token_ids_equal_the_runtime(server, request, model):
    build_dir = request.getfixturevalue({"tiny": "tiny_build", "tinyp": "tiny_plugin_build"}[model])
    if model == "tinyp":
        request.getfixturevalue("cpu_op")
        if not (TRITON_ENV / "lib" / "kvexport" / LIB_NAME).is_file():
            pytest.skip(f"the native CPU op is not built in {TRITON_ENV} (scripts/install.sh builds it)")
    eng = LLMEngine(build_dir, EngineConfig(kv_cache_memory="1MiB"))
    assert (eng.backend.attention_impl == "plugin (native CPU op)") == (model == "tinyp")
    rids = [eng.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in TINY_PROMPTS]
    while eng.has_unfinished():
        eng.step()
    want = [eng.pop_output(r).token_ids for r in rids]
    s = Stream(server)
    try:
        for i, p in enumerate(TINY_PROMPTS):
            s.send(model, f"t{i}", input_ids=np.array(p, np.int32), max_tokens=np.array([12], np.int32),
                   ignore_eos=[True], stream=[i % 2 == 0])
        got = s.collect(len(TINY_PROMPTS))
    finally:
        s.close()
    assert [got[f"t{i}"]["ids"] for i in range(len(TINY_PROMPTS))] == want
    assert got["t1"]["chunks"] == 1 and got["t0"]["chunks"] == 12  # stream=false: one response


@pytest.mark.slow
def test_cancelled_stream_frees_its_kv_blocks(server):
    """A gRPC stream cancelled mid-way while another request runs: the other one completes,
    the cancelled one's blocks go back to the pool and it counts as cancelled."""
    before = wait_metric(server, "smol", lambda m: m.get("kvexport_kv_blocks_used") == 0)
    assert before["kvexport_kv_blocks_total"] > 0 and before["kvexport_kv_blocks_used"] == 0
    long, other = Stream(server), Stream(server)
    try:
        long.send("smol", "long", text_input=["Tell me a very long story about a dragon."],
                  max_tokens=np.array([400], np.int32), ignore_eos=[True], stream=[True])
        for _ in range(3):  # tokens are flowing
            result, error = long.next()
            assert error is None, error
        other.send("smol", "other", text_input=["Count to twenty:"], max_tokens=np.array([24], np.int32),
                   ignore_eos=[True], stream=[True])
        busy = wait_metric(server, "smol", lambda m: m["kvexport_requests_running"] == 2)
        assert busy["kvexport_kv_blocks_used"] > 0 and busy["kvexport_requests_running"] == 2
        long.close(cancel=True)
        done = other.collect(1)["other"]
        assert done["reason"] == "length" and len(done["ids"]) == 24
    finally:
        long.close(cancel=True)
        other.close()
    after = wait_metric(server, "smol", lambda m: m["kvexport_kv_blocks_used"] == 0
                        and m["kvexport_requests_cancelled_total"] > before["kvexport_requests_cancelled_total"])
    assert after["kvexport_kv_blocks_used"] == 0 and after["kvexport_requests_running"] == 0
    assert after["kvexport_requests_cancelled_total"] == before["kvexport_requests_cancelled_total"] + 1
    assert after["kvexport_generation_tokens_total"] < before["kvexport_generation_tokens_total"] + 400 + 24


@pytest.mark.slow
def test_disconnected_generate_stream_client_frees_its_kv_blocks(server):
    before = wait_metric(server, "smol", lambda m: m.get("kvexport_kv_blocks_used") == 0)
    with httpx.stream("POST", f"http://{HOST}:{server.http}/v2/models/smol/generate_stream", timeout=60,
                      json={"text_input": "Write a long poem.", "max_tokens": 400, "ignore_eos": True,
                            "stream": True}) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leave: the connection closes
    after = wait_metric(server, "smol", lambda m: m["kvexport_kv_blocks_used"] == 0
                        and m["kvexport_requests_cancelled_total"] > before["kvexport_requests_cancelled_total"])
    assert after["kvexport_kv_blocks_used"] == 0
    assert after["kvexport_requests_cancelled_total"] == before["kvexport_requests_cancelled_total"] + 1


@pytest.mark.slow
def test_cancelled_non_streaming_request_frees_its_kv_blocks(server):
    """stream=false over a gRPC stream (one response at the end): cancelling the stream
    aborts it too. NOTE: over HTTP, Triton 2.51 reports no cancellation for a request whose
    response is not streamed (/generate; generate_stream with stream false) until it writes
    the response, so such a request runs to max_tokens (docs/DEPLOYMENT.md)."""
    before = wait_metric(server, "smol", lambda m: m.get("kvexport_kv_blocks_used") == 0)
    s = Stream(server)
    try:
        s.send("smol", "whole", text_input=["Tell me a very long story about a dragon."],
               max_tokens=np.array([400], np.int32), ignore_eos=[True], stream=[False])
        busy = wait_metric(server, "smol", lambda m: m["kvexport_kv_blocks_used"] > 0
                           and m["kvexport_generation_tokens_total"] > before["kvexport_generation_tokens_total"])
        assert busy["kvexport_requests_running"] == 1
    finally:
        s.close(cancel=True)
    after = wait_metric(server, "smol", lambda m: m["kvexport_kv_blocks_used"] == 0
                        and m["kvexport_requests_cancelled_total"] > before["kvexport_requests_cancelled_total"],
                        timeout=5)
    assert after["kvexport_kv_blocks_used"] == 0 and after["kvexport_requests_running"] == 0
    assert after["kvexport_requests_cancelled_total"] == before["kvexport_requests_cancelled_total"] + 1
    assert after["kvexport_generation_tokens_total"] < before["kvexport_generation_tokens_total"] + 400


def test_bad_requests_get_errors_and_the_server_stays_healthy(server):
    i32 = lambda v: np.array([v], np.int32)  # noqa: E731
    bad = [
        ("smol", {"max_tokens": i32(4)}, "exactly one of the inputs"),  # no prompt
        ("smol", {"text_input": ["hi"], "input_ids": np.array([1, 2], np.int32)}, "exactly one of the inputs"),
        ("smol", {"text_input": ["hi"], "max_tokens": i32(10**9)}, "max_tokens must be in"),
        ("smol", {"text_input": ["hi"], "max_tokens": i32(-3)}, "max_tokens must be in"),
        ("smol", {"text_input": ["hi"], "max_tokens": np.array([4.0], np.float32)}, "max_tokens"),  # wrong dtype
        ("smol", {"text_input": np.array([[1, 2]], np.int32)}, "text_input"),  # wrong dtype
        ("smol", {"text_input": ["hi"], "temperature": np.array([-1.0], np.float32)}, "temperature"),
        ("smol", {"text_input": ["hi"], "top_p": np.array([0.0], np.float32)}, "top_p"),
        ("smol", {"text_input": ["hi"], "no_such_input": i32(1)}, "no_such_input"),
        ("tiny", {"text_input": ["hi"]}, "no tokenizer"),
        ("tiny", {"input_ids": np.array([1] * 200, np.int32)}, "context holds"),  # longer than the context
        ("tiny", {"input_ids": np.array([1, -2], np.int32)}, "outside this model's vocabulary"),  # would wrap
    ]
    s = Stream(server)
    try:
        for model, inputs, expect in bad:
            s.send(model, "bad", **inputs)
            result, error = s.next()
            assert error is not None and expect in str(error), (model, inputs, result, error)
        s.send("smol", "ok", text_input=["hi"], max_tokens=i32(3))
        assert s.collect(1)["ok"]["reason"] == "length"
    finally:
        s.close()
    # NOTE: an unknown model goes on a stream of its own: Triton 2.51's gRPC frontend aborts
    # (proto_buffer_writer.h "!byte_buffer->Valid()") when a request for an unknown model
    # follows an errored request on the same stream, even one Triton itself rejected for
    # its dtype, before any model ran (reproduced within ~30 tries; docs/DEPLOYMENT.md)
    s = Stream(server)
    try:
        s.send("nope", "bad", text_input=["hi"])
        result, error = s.next()
        assert error is not None and "nope" in str(error)
    finally:
        s.close()
    r = httpx.post(f"http://{HOST}:{server.http}/v2/models/smol/generate", json={"max_tokens": 3}, timeout=30)
    assert "exactly one of the inputs" in r.text
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/smol/ready", "/v2/models/tiny/ready"):
        assert httpx.get(f"http://{HOST}:{server.http}{path}", timeout=10).status_code == 200, path
    m = wait_metric(server, "smol", lambda m: m["kvexport_kv_blocks_used"] == 0)
    assert m["kvexport_kv_blocks_used"] == 0
    assert sorted(m) == sorted(mx.NAMES)  # runtime/metrics.py's table, as `kvexport serve` publishes it
