"""Structured output through the real `tritonserver` (issue 35): the Triton model's `response_format`
/ `structured_outputs` inputs (JSON text) served by Triton's execution environment (.venv-triton:
numpy<2, torch CPU + xgrammar 0.2.8 + jsonschema, scripts/install_dev.sh) on smollm2-135m: a
json_schema request returns JSON valid for its schema, a regex request matches, an invalid schema
gets an error naming the field while the model goes on serving. And where an environment lacks
xgrammar, the request is refused naming the field and the package (that part blocks the import in
this process: no environment without xgrammar is installed for the tests)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from kvexport.runtime.config import EngineConfig
from kvexport.runtime.serving.triton_repo import TritonRepoOptions, write_repository

HOST = "127.0.0.1"
TRITON_ENV = Path(os.environ.get("KVEXPORT_TRITON_ENV", Path(__file__).resolve().parents[3] / ".venv-triton"))
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "country": {"enum": ["France", "Japan", "Peru"]},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "country", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def triton(smollm2_build, tmp_path_factory, free_ports):
    """`kvexport triton-serve` of smollm2-135m: the model's generate URL."""
    if not (TRITON_ENV / "bin" / "python3").exists():
        pytest.skip(f"no Triton execution environment at {TRITON_ENV}: run scripts/install.sh --dev")
    d = tmp_path_factory.mktemp("triton-structured")
    write_repository(smollm2_build, d / "repo", TritonRepoOptions(
        engine=EngineConfig(kv_cache_memory="32MiB", threads=2), name="smol", execution_env=str(TRITON_ENV)))
    http, grpc, metrics = free_ports(3)
    log = d / "triton-serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvexport.cli", "triton-serve", str(d / "repo"), "--triton-env",
                                 str(TRITON_ENV), "--http-port", str(http), "--grpc-port", str(grpc),
                                 "--metrics-port", str(metrics)], stdout=f, stderr=subprocess.STDOUT, cwd=d,
                                env=dict(os.environ, COLUMNS="400"))
    try:
        deadline = time.monotonic() + 240
        while "Triton serving" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-5000:]
            time.sleep(0.2)
        yield f"http://{HOST}:{http}/v2/models/smol/generate"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_json_schema_and_regex_through_tritonserver(triton):
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = httpx.post(triton, json={"text_input": "A city as JSON:", "max_tokens": 48,
                                 "response_format": json.dumps(rf)}, timeout=180)
    body = r.json()
    assert r.status_code == 200 and body["finish_reason"] == "stop", body
    jsonschema.validate(json.loads(body["text_output"]), SCHEMA)
    r = httpx.post(triton, json={"text_input": "A code:", "max_tokens": 12,
                                 "structured_outputs": json.dumps({"regex": "[A-Z]{3}-[0-9]{3}"})}, timeout=180)
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", r.json()["text_output"]), r.text
    # a schema that cannot be served: the error names the field; the model serves the next request
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    r = httpx.post(triton, json={"text_input": "hi", "max_tokens": 4, "response_format": json.dumps(bad)}, timeout=60)
    assert "response_format" in r.text and "uniqueItems" in r.text, r.text
    r = httpx.post(triton, json={"text_input": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 2, r.text


def test_without_xgrammar_the_request_is_refused_by_name(smollm2_build):
    """An environment without xgrammar (the import blocked here): GrammarError naming the field and
    the package, before any tokenizer table is built."""
    from kvexport import manifest as mf
    from kvexport.runtime.execution.structured import GrammarError, StructuredOutputManager
    from kvexport.runtime.sampling_params import StructuredOutputs
    from kvexport.runtime.tokenizer import load_build_tokenizer

    tok = load_build_tokenizer(Path(smollm2_build), mf.load(Path(smollm2_build)).tokenizer)
    saved = sys.modules.get("xgrammar")
    sys.modules["xgrammar"] = None  # `import xgrammar` raises ImportError
    try:
        with pytest.raises(GrammarError) as e:
            StructuredOutputManager(tok, 49152, (2,)).compile(StructuredOutputs(json=SCHEMA), "response_format")
    finally:
        if saved is not None:
            sys.modules["xgrammar"] = saved
        else:
            del sys.modules["xgrammar"]
    assert e.value.param == "response_format" and e.value.code == "structured_output_unavailable"
    assert str(e.value).startswith("response_format: structured output needs the Python package xgrammar")
    assert "pip install xgrammar==0.2.8" in str(e.value)
