"""Where a `kvexport dynamo` worker listens (issue 36 §5): its KV events and load go through
`kvexport dynamo-broker` on loopback, and no socket of the worker, nor of the frontend run by the
documented recipe, listens beyond 127.0.0.1 (Dynamo 1.6.1's direct ZMQ event plane binds 0.0.0.0:
the worker refuses it unless the operator opts in). Real processes: the broker CLI, a real
`python -m dynamo.frontend --router-mode kv`, a real worker; the listening sockets are read with
psutil. The rules themselves (`check_event_plane`, `loopback_defaults`) are checked on plain
environments, without Dynamo.

The cluster part is skipped, saying why, where the `dynamo` extra is not installed (CI installs it)."""

import os
import re
import subprocess
import sys
import time

import pytest

from kvexport.errors import ConfigError
from kvexport.runtime.serving.dynamo_events import (EventBroker, check_event_plane, loopback_defaults,
                                                    parse_broker_url)

URL = "xsub=tcp://127.0.0.1:5555 , xpub=tcp://127.0.0.1:5556"


def test_direct_zmq_is_refused_unless_the_operator_opts_in(caplog):
    with pytest.raises(ConfigError) as e:
        check_event_plane("file", False, {"DYN_EVENT_PLANE_HOST": "127.0.0.1"})
    msg = str(e.value)
    assert "tcp://0.0.0.0" in msg and "kvexport dynamo-broker" in msg and "--public-event-plane" in msg
    assert "DYN_EVENT_PLANE_HOST says (it is '127.0.0.1')" in msg
    with pytest.raises(ConfigError):  # DYN_EVENT_PLANE=zmq picks it with file discovery too
        check_event_plane("file", False, {"DYN_EVENT_PLANE": "zmq"})
    # opted in (the flag or the variable), or across machines (etcd, Kubernetes: the operator's network
    # policy): served, with a warning saying where it listens
    assert check_event_plane("file", True, {}).binds_all_interfaces
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert check_event_plane("mem", False, {"KVEXPORT_DYNAMO_PUBLIC_EVENT_PLANE": "1"}).transport == "zmq-direct"
        assert check_event_plane("kubernetes", False, {"DYN_EVENT_PLANE": "zmq"}).binds_all_interfaces
    assert caplog.text.count("tcp://0.0.0.0") == 2


def test_a_broker_or_nats_is_taken_and_a_bad_broker_url_named():
    assert check_event_plane("file", False, {"DYN_ZMQ_BROKER_URL": URL}).transport == "zmq-broker"
    assert check_event_plane("file", False, {"DYN_ZMQ_BROKER_ENABLED": "true"}).transport == "zmq-broker"
    assert check_event_plane("etcd", False, {}).transport == "nats"  # Dynamo's default beyond one machine
    assert check_event_plane("file", False, {"DYN_EVENT_PLANE": "nats"}).transport == "nats"
    assert parse_broker_url(URL) == (["tcp://127.0.0.1:5555"], ["tcp://127.0.0.1:5556"])
    for bad in ("tcp://127.0.0.1:5555", "xsub=tcp://a:1", "xsub= , xpub=tcp://a:2", "xsub=a:1 , xpub=tcp://a:2",
                "xsub=tcp://a:1 , xpub=tcp://a:2 , extra=1"):
        with pytest.raises(ConfigError, match="DYN_ZMQ_BROKER_URL"):
            check_event_plane("file", False, {"DYN_ZMQ_BROKER_URL": bad})
    with pytest.raises(ConfigError, match="DYN_EVENT_PLANE"):
        check_event_plane("file", False, {"DYN_EVENT_PLANE": "kafka"})


def test_one_machine_listens_on_loopback_unless_told():
    env = {"DYN_SYSTEM_HOST": "10.0.0.5"}
    assert loopback_defaults("file", env) == ["DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST"]
    assert env == {"DYN_SYSTEM_HOST": "10.0.0.5", "DYN_TCP_RPC_HOST": "127.0.0.1",
                   "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1"}
    env = {}
    assert loopback_defaults("etcd", env) == [] and env == {}  # several machines: Dynamo's defaults


def test_the_broker_forwards_and_binds_only_its_host():
    zmq = pytest.importorskip("zmq")
    psutil = pytest.importorskip("psutil")
    with pytest.raises(ConfigError, match="xsub_port"):
        EventBroker(xsub_port=70000)
    with EventBroker("127.0.0.1") as broker:
        listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        mine = {int(e.rsplit(":", 1)[1]) for e in (broker.xsub_endpoint, broker.xpub_endpoint)}
        assert {ip for ip, port in listening if port in mine} == {"127.0.0.1"}
        ctx = zmq.Context()
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        try:
            pub.connect(broker.xsub_endpoint)
            sub.connect(broker.xpub_endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, 200)
            got = None
            for _ in range(50):  # a subscription reaches the publisher asynchronously
                pub.send(b"event")
                try:
                    got = sub.recv()
                    break
                except zmq.Again:
                    pass
            assert got == b"event"
        finally:
            pub.close(0)
            sub.close(0)
            ctx.term()


def test_echo_is_refused_naming_what_the_client_sent():
    """Dynamo 1.6.1's frontend turns `echo: true` into output_options.prompt_logprobs=1 (seen on the
    wire, docs/BAD_INPUTS.md): the refusal names both, so a client that sent `echo` knows it is meant."""
    from kvexport.runtime.serving.dynamo_protocol import request_to_params
    from kvexport.runtime.serving.requests import RequestError, RequestParser

    r = {"token_ids": [5, 6], "stop_conditions": {}, "sampling_options": {}, "output_options": {"prompt_logprobs": 1}}
    with pytest.raises(RequestError, match="`echo`") as e:
        request_to_params(r, RequestParser(None, 100, 32))
    assert e.value.param == "output_options.prompt_logprobs"


def test_a_build_the_frontend_cannot_read_is_refused_before_the_engine_loads(chat_build, tmp_path, monkeypatch):
    """A build without the tokenizer files at its root is refused before the (slow) engine load.
    LLMEngine is replaced by a stand-in that fails the test if it is made: the order is what is checked."""
    pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed")
    import shutil

    from kvexport.runtime.serving import dynamo_serve
    from kvexport.runtime.serving.dynamo_worker import DynamoWorkerOptions

    build = tmp_path / "no-tokenizer"
    shutil.copytree(chat_build, build, ignore=shutil.ignore_patterns("weights.data", "*.onnx"))
    (build / "tokenizer.json").unlink()

    def engine(*a, **kw):
        raise AssertionError("the engine was loaded before the build's files were checked")

    monkeypatch.setattr(dynamo_serve, "LLMEngine", engine)
    monkeypatch.setenv("DYN_ZMQ_BROKER_URL", URL)
    with pytest.raises(ConfigError, match="lacks tokenizer.json at its root"):
        dynamo_serve.serve_dynamo(build, DynamoWorkerOptions(discovery_backend="file"))


# ---- real processes -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dynamo_env():
    pytest.importorskip("dynamo.llm", reason="the dynamo extra is not installed (scripts/install_dev.sh installs "
                                             "it; docs/DEPLOYMENT.md)")
    pytest.importorskip("httpx")
    return pytest.importorskip("psutil")


def listening(pid: int) -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def test_a_worker_without_a_broker_refuses_to_start(dynamo_env, chat_build, tmp_path):
    """Dynamo 1.6.1 would bind its event sockets on 0.0.0.0: the worker exits 2 before loading the
    engine, naming the broker, NATS and the opt-in."""
    env = dict(os.environ, DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=str(tmp_path / "kv"),
               DYN_EVENT_PLANE_HOST="127.0.0.1")
    for name in ("DYN_ZMQ_BROKER_URL", "DYN_ZMQ_BROKER_ENABLED", "DYN_EVENT_PLANE",
                 "KVEXPORT_DYNAMO_PUBLIC_EVENT_PLANE"):
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-m", "kvexport.cli", "dynamo", str(chat_build), "--threads", "1"],
                       env=env, capture_output=True, text=True, timeout=120)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert "tcp://0.0.0.0" in out and "kvexport dynamo-broker" in out and "--public-event-plane" in out, out
    assert "Traceback" not in out


@pytest.fixture(scope="module")
def brokered_cluster(dynamo_env, chat_build, tmp_path_factory):
    """`kvexport dynamo-broker` (the CLI, a process) + the frontend + one worker, by the recipe."""
    from testkit.bench import script as bench_script

    bench = bench_script("dynamo_routing")
    tmp = tmp_path_factory.mktemp("event-plane")
    broker = subprocess.Popen([sys.executable, "-m", "kvexport.cli", "dynamo-broker"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        line = broker.stdout.readline()
        m = re.fullmatch(r"DYN_ZMQ_BROKER_URL='(.*)'\n", line)
        assert m, line
        with pytest.MonkeyPatch.context() as mp:  # local_cluster passes them to the frontend and the worker
            mp.setenv("DYN_ZMQ_BROKER_URL", m.group(1))
            mp.setenv("DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS", "500")  # the recipe's frontend settings
            mp.setenv("DYN_HTTP_BODY_LIMIT_MB", "1")
            with bench.local_cluster(chat_build, tmp, 1, "kv", ("--kv-cache-memory", "4MiB"), namespace="kvxev",
                                     model="tiny") as c:
                yield c, broker
    finally:
        broker.terminate()
        broker.wait(timeout=20)


def test_nothing_listens_beyond_loopback_and_events_flow_through_the_broker(brokered_cluster):
    zmq = pytest.importorskip("zmq")
    import httpx
    import psutil

    cluster, broker = brokered_cluster
    frontend = next(p for p in psutil.Process().children() if "dynamo.frontend" in " ".join(p.cmdline()))
    for name, pid in (("worker", cluster.workers[0].pid), ("frontend", frontend.pid), ("broker", broker.pid)):
        where = listening(pid)
        assert where and {ip for ip, _ in where} == {"127.0.0.1"}, (name, where)
    # the router hears the worker through the broker: a subscriber there gets its KV events
    _, xpub = parse_broker_url(cluster.env["DYN_ZMQ_BROKER_URL"])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(xpub[0])
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 5000)
        time.sleep(1.0)  # subscribed
        r = httpx.post(f"{cluster.base}/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": [300 + i for i in range(33)], "max_tokens": 2})
        assert r.status_code == 200, r.text
        wire = b""
        while b"stored" not in wire:  # zmq.Again (no event within 5 s) fails the test
            wire += b"".join(sub.recv_multipart())
    finally:
        sub.close(0)
        ctx.term()
    # and the router used them: the same prefix again is served from the cache
    r = httpx.post(f"{cluster.base}/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": [300 + i for i in range(33)] + [9], "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_the_recipes_frontend_refuses_streamed_requests_with_a_400(brokered_cluster):
    """With the recipe's DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS a streamed request the worker refuses is a
    400 naming the field, as the same request unstreamed (without it: a 200 whose first SSE event is
    the error), and DYN_HTTP_BODY_LIMIT_MB refuses a 30 MB prompt in seconds (without it Dynamo's
    frontend tokenizes it for minutes, holding up every request: docs/BAD_INPUTS.md)."""
    import httpx

    cluster, _ = brokered_cluster
    for stream in (False, True):
        r = httpx.post(f"{cluster.base}/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": [5, 6], "n": 2, "stream": stream})
        assert r.status_code == 400 and "sampling_options.n" in r.text, (stream, r.status_code, r.text)
    r = httpx.post(f"{cluster.base}/v1/completions", timeout=30, json={"model": "tiny", "prompt": "x" * 30_000_000})
    assert r.status_code == 413 and "DYN_HTTP_BODY_LIMIT_MB" in r.text, r.text
