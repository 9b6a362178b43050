"""The Triton Python-backend model that serves a kvexport build with continuous batching.
This module owns the model's tensor interface (`INPUTS`, `OUTPUTS`, read by
`triton_repo.py` to write config.pbtxt), the reading of its config.pbtxt parameters
(`engine_settings`: `build_dir` + runtime/config.py's EngineConfig as strings) and
`TritonPythonModel`, which a generated repository's `model.py` re-exports. Prompts and
sampling fields are parsed by runtime/serving/requests.py, as every front end's are, within
`kvexport serve`'s limits (stop strings, the request size; checked before tokenizing).

    Triton execute() ──parse/validate──▶ EngineThread.submit ──▶ engine thread: step() ...
                                                                     │ deliver(Event)
    gRPC stream / SSE ◀── response_sender.send(text_output, token_ids[, FINAL]) ◀─┘

One `LLMEngine` per model instance, owned by one background thread (`engine_thread.py`);
the model is decoupled, so `execute()` only validates and queues requests and returns at
once. Every request ends with exactly one response flagged FINAL: streaming requests get
one response per step that produced tokens (the text added and the new token ids), the
last one flagged FINAL; non-streaming requests get one response with the whole
completion. Invalid requests get an error response and never reach the engine. On the
engine thread, ticks poll `request.is_cancelled()` (a cancelled gRPC stream, a
disconnected SSE client; every 50 ms, at most 32 requests a tick) and abort those
requests, so their KV blocks go back to the pool. KV and scheduler figures are published
as Triton custom metrics on Triton's metrics port (runtime/serving/metrics.py's table, the one
`kvexport serve`'s /metrics publishes, labelled by model, version and instance).

NOTE: Triton 2.51 reports no cancellation for an HTTP client that leaves a request whose
response is not streamed (/generate, or generate_stream with stream false): nothing is
written to it before the end, so is_cancelled() stays false and the request runs to its
max_tokens. gRPC streams and streamed SSE are seen within 50 ms.

If tritonserver itself is killed (SIGKILL), the next tick (within engine_thread.py IDLE_WAIT_S) sees the
stub's parent gone and ends the stub's process.

Shutdown: on SIGTERM tritonserver waits for open HTTP connections (up to its exit timeout,
30 s) before it unloads any model, and then exits at once, mid-request (SIGSEGV). A model
cannot see that signal, so it watches a file instead: when the file named by the
environment variable `KVEXPORT_SHUTDOWN_FILE` exists, every open request gets a final
error response and new ones are refused, so the connections close and Triton unloads the
model (`finalize`) and exits cleanly. `kvexport triton-serve` (runtime/serving/triton_local.py)
creates it on SIGTERM/SIGINT after its grace period. `finalize` stops the engine thread
without waiting for a long step and ends what is still open with an error response.

`triton_python_backend_utils` exists only inside Triton's Python-backend stub, so it is
imported in `initialize()`, never at module import.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvexport.errors import KvExportError

from . import metrics as mx
from ..config import EngineConfig
from ..core.block_hash import request_salt
from .cache_salts import SaltKey, accept_salt
from .requests import (MAX_BODY_BYTES, MAX_CACHE_SALT_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS, RequestError,
                       RequestParser, response_format, structured_outputs)
from ..sampling_params import SamplingParams

log = logging.getLogger(__name__)
pb_utils = None  # triton_python_backend_utils, bound by TritonPythonModel.initialize()

# name, Triton data type, dims, optional, what it is (max_batch_size is 0: dims are full shapes)
# NOTE: every integer input is INT64: Triton's HTTP front end casts a JSON number to a
# narrower declared type without a range check (max_tokens 2**31 arrived as -2**31, 2**32 + 3
# as 3, a token id 2**32 + 1 as 1), so the model could not tell a wrapped value from a real
# one. As INT64 every JSON integer below 2**63 arrives exact and is range-checked here (larger
# ones Triton refuses itself); seed is INT64 too, so a negative seed gets our error.
INPUTS = (
    ("text_input", "TYPE_STRING", [1], True, "prompt text (one of text_input / input_ids is required)"),
    ("input_ids", "TYPE_INT64", [-1], True, "prompt token ids, for builds without a tokenizer"),
    ("max_tokens", "TYPE_INT64", [1], True, "tokens to generate at most [16]"),
    ("stream", "TYPE_BOOL", [1], True, "true: one response per step; false: one response [false]"),
    ("temperature", "TYPE_FP32", [1], True, "0 = greedy [0]"),
    ("top_p", "TYPE_FP32", [1], True, "nucleus mass kept, (0, 1] [1]"),
    ("top_k", "TYPE_INT64", [1], True, "0 = off [0]"),
    ("seed", "TYPE_INT64", [1], True, "per-request RNG seed, >= 0"),
    ("stop", "TYPE_STRING", [-1], True, "stop strings (not included in the output)"),
    ("ignore_eos", "TYPE_BOOL", [1], True, "keep generating past EOS [false]"),
    ("speculative", "TYPE_BOOL", [1], True, "false: no speculative decoding for this request [the model's setting]"),
    ("cache_salt", "TYPE_STRING", [1], True, "prefix-cache salt: KV is shared only with requests of the same salt"),
    ("response_format", "TYPE_STRING", [1], True, 'OpenAI response_format as JSON text: {"type": "json_schema", ...}'),
    ("structured_outputs", "TYPE_STRING", [1], True, 'vLLM structured_outputs as JSON text: {"regex": ...}'),
    ("kv_budget_tokens", "TYPE_INT64", [1], True, "a smaller KV budget for this request, in tokens (the model's "
     "kv_eviction snapkv / h2o; refused without it) [the model's]"),
    ("lora", "TYPE_STRING", [1], True, "a LoRA adapter the model serves (its lora_modules parameter), by name "
     "[the base model]"),
)
OUTPUTS = (
    ("text_output", "TYPE_STRING", [1], "text added by this response (streaming) or the whole completion"),
    ("token_ids", "TYPE_INT32", [-1], "token ids added by this response (streaming) or all generated ids"),
    ("finish_reason", "TYPE_STRING", [1], "'' until the FINAL response: stop | length | abort"),
)
# model parameters (config.pbtxt `parameters`, strings): `build_dir` (the build's path;
# relative paths resolve against the model's folder) and the fields of runtime/config.py's
# EngineConfig (`EngineConfig.to_strings()`; absent ones take its defaults).
# NOTE: Triton's own parameters are upper case (EXECUTION_ENV_PATH, ...); ours are lower case
BUILD_DIR_PARAMETER = "build_dir"
# numpy kinds each declared type arrives as. NOTE: integers of either sign: a repository written
# before the inputs became INT64 declares INT32 (kind i) and seed UINT64 (kind u), and loads this
# same model code; every value is range-checked after this anyway
_NP_KIND = {"TYPE_STRING": "O", "TYPE_INT64": "iu", "TYPE_FP32": "f", "TYPE_BOOL": "b"}
POLL_CANCEL_S = 0.05  # how often the engine thread asks Triton whether requests were cancelled
# NOTE: each is_cancelled() is a round trip to the Triton process; a tick asks at most this
# many requests (round robin), so a large batch is polled every (active / 32) * 50 ms
POLL_CANCEL_MAX = 32
SHUTDOWN_FILE_ENV = "KVEXPORT_SHUTDOWN_FILE"  # when the file it names exists, the model ends every request
DEFAULT_MAX_TOKENS = 16  # when a request has no max_tokens input
METRICS_EVERY_S = 0.1  # how often it republishes the metrics while busy (and once on falling idle)
# bytes of text_input at most, checked before tokenizing: the request-body limit of `kvexport serve`
# (one constant, runtime/serving/requests.py, which needs no FastAPI: Triton's environment lacks it)
MAX_TEXT_BYTES = MAX_BODY_BYTES


def resolve_build_dir(value: str, model_dir: str | Path) -> Path:
    """The `build_dir` parameter -> an absolute path (relative ones are taken from the model's folder)."""
    p = Path(os.path.expandvars(value))
    return p if p.is_absolute() else (Path(model_dir) / p).resolve()


def engine_settings(parameters: dict, model_dir: str | Path) -> tuple[Path, EngineConfig]:
    """config.pbtxt `parameters` (name -> {"string_value": ...}) -> (build directory,
    EngineConfig). Unknown lower-case names are an error (a typo must not fall back to a
    default silently)."""
    p = {k: v.get("string_value", "") for k, v in parameters.items()}
    build_dir = p.pop(BUILD_DIR_PARAMETER, "").strip()
    if not build_dir:
        raise KvExportError("config.pbtxt needs the parameter build_dir (regenerate with `kvexport triton`)")
    cfg = EngineConfig.from_strings({k: v for k, v in p.items() if not k.isupper()})
    return resolve_build_dir(build_dir, model_dir), cfg


def _scalar(arrays: dict[str, np.ndarray], name: str, default):
    a = arrays.get(name)
    if a is None:
        return default
    if a.size != 1:
        raise RequestError(f"input {name!r} must hold one value, got shape {list(a.shape)}", name)
    v = a.reshape(-1)[0]
    return v.item() if hasattr(v, "item") else v


def _lora_name(arrays: dict[str, np.ndarray]) -> str | None:
    """The `lora` input -> the adapter's name (None: absent, the base); whether it is loaded is the engine's
    check (a RequestError naming `lora`)."""
    raw = _scalar(arrays, "lora", None)
    if raw is None:
        return None
    if isinstance(raw, bytes):
        if len(raw) > 1024:
            raise RequestError(f"lora: an adapter name of at most 1024 bytes, got {len(raw)}", "lora")
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("lora is not valid UTF-8", "lora") from None
    return str(raw) or None


def _stop_strings(stop: np.ndarray | None) -> list[str]:
    """The `stop` input -> strings, within the OpenAI path's limits (openai_protocol.py), the
    count and byte lengths checked before anything is decoded."""
    if stop is None:
        return []
    items = stop.reshape(-1)
    what = f"stop: at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters"
    if items.size > MAX_STOP_STRINGS:
        raise RequestError(f"{what}, got {items.size} strings", "stop")
    out = []
    for s in items:
        if isinstance(s, bytes):
            if len(s) > 4 * MAX_STOP_CHARS:  # UTF-8: at most 4 bytes a character
                raise RequestError(f"{what}, got one of {len(s)} bytes", "stop")
            s = s.decode("utf-8", "replace")
        s = str(s)
        if len(s) > MAX_STOP_CHARS:
            raise RequestError(f"{what}, got one of {len(s)} characters", "stop")
        out.append(s)
    return out


def _structured(arrays: dict[str, np.ndarray]):
    """The inputs response_format / structured_outputs (JSON text, as the OpenAI fields) -> StructuredOutputs."""
    got = {}
    for name in ("response_format", "structured_outputs"):
        if name in arrays:
            raw = _scalar(arrays, name, b"")
            try:
                got[name] = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
            except ValueError as e:
                raise RequestError(f"{name} must be JSON text: {e}", name) from None
    if len(got) > 1:
        raise RequestError("send either response_format or structured_outputs, not both", "structured_outputs")
    if "structured_outputs" in got:
        return structured_outputs(got["structured_outputs"])
    return response_format(got.get("response_format"))[0]


def parse_request(arrays: dict[str, np.ndarray], parser: RequestParser,
                  parameters: dict | None = None) -> tuple[list[int], SamplingParams, bool]:
    """Input tensors (name -> numpy array, absent inputs left out) -> (prompt token ids,
    SamplingParams, stream). The tensors' names, dtypes and shapes are checked here; the
    prompt and the sampling fields by the shared `parser` (runtime/serving/requests.py). Raises
    RequestError for anything a client got wrong. `parameters`: the request's parameters;
    this model takes none (NOTE: /generate turns a JSON field that is no input, e.g. a
    misspelt `max_token`, into a parameter: refused, not ignored).
    NOTE: the cheap limits (sizes, counts, byte lengths) are checked before anything is
    tokenized or converted to Python objects, so a huge request costs the other requests nothing."""
    spec = {name: dtype for name, dtype, *_ in INPUTS}
    unknown = sorted(k for k in parameters or {} if not k.startswith("triton_"))  # triton_*: Triton's own
    if unknown:
        raise RequestError(f"unknown input(s) or parameter(s) {', '.join(map(repr, unknown))}; inputs: "
                           f"{', '.join(spec)}", unknown[0])
    for name, a in arrays.items():
        if name not in spec:
            raise RequestError(f"unknown input {name!r}; inputs: {', '.join(spec)}", name)
        if a.dtype.kind not in _NP_KIND[spec[name]] and not (spec[name] == "TYPE_STRING" and a.dtype.kind == "S"):
            raise RequestError(f"input {name!r} must be {spec[name][5:]}, got numpy dtype {a.dtype}", name)
    if ("text_input" in arrays) == ("input_ids" in arrays):
        raise RequestError("send exactly one of the inputs 'text_input' (BYTES) or 'input_ids' (INT64)")
    values = {k: _scalar(arrays, k, None) for k in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                                    "ignore_eos", "speculative", "kv_budget_tokens")}
    values["stop"] = _stop_strings(arrays.get("stop"))
    values["lora"] = _lora_name(arrays)
    values["structured"] = _structured(arrays)
    stream = bool(_scalar(arrays, "stream", False))
    if "text_input" in arrays:
        text = _scalar(arrays, "text_input", b"")
        size = len(text) if isinstance(text, bytes) else len(str(text).encode("utf-8", "surrogatepass"))
        if size > MAX_TEXT_BYTES:
            raise RequestError(f"text_input: {size} bytes is more than this server takes ({MAX_TEXT_BYTES} bytes, "
                               f"as `kvexport serve` takes per request body); send a shorter prompt", "text_input")
        try:
            text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        except UnicodeDecodeError:
            raise RequestError("text_input is not valid UTF-8", "text_input") from None
        prompt, param = parser.text(text, "text_input"), "text_input"
    else:
        ids = arrays["input_ids"].reshape(-1)
        parser.check_length(ids.size, "input_ids")  # before the ids become Python ints
        prompt, param = parser.prompt(ids.tolist(), "input_ids"), "input_ids"
    parser.check_length(len(prompt), param)
    params = parser.sampling_params(values, len(prompt), default_max_tokens=DEFAULT_MAX_TOKENS, strict_max_tokens=True)
    return prompt, params, stream


def parse_cache_salt(arrays: dict[str, np.ndarray], key: SaltKey | None = None) -> str | None:
    """The `cache_salt` input -> the request's prefix-cache salt (block_hash.request_salt), or
    None when absent. Taken by the rule every front end applies (cache_salts.accept_salt: the input
    is the only place; with `key`, the model's $KVEXPORT_CACHE_SALT_KEY, only a salt a gateway
    signed, and never none); the byte length checked before decoding. NOTE: Triton knows no
    kvexport tenants (its authentication is its own): a gateway that has tenants puts each one's
    signed salt here."""
    raw = _scalar(arrays, "cache_salt", None)
    if raw is None:
        return request_salt(None, accept_salt((("cache_salt", None),), key))
    if isinstance(raw, bytes):
        if len(raw) > 4 * MAX_CACHE_SALT_CHARS:  # UTF-8: at most 4 bytes a character
            raise RequestError(f"cache_salt: at most {MAX_CACHE_SALT_CHARS} characters, got {len(raw)} bytes",
                               "cache_salt")
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("cache_salt is not valid UTF-8", "cache_salt") from None
    return request_salt(None, accept_salt((("cache_salt", str(raw)),), key))


@dataclass(eq=False)
class _Request:
    """One Triton request in flight; `deliver` and `cancel` run on the engine thread."""
    request: object  # pb_utils.InferenceRequest
    sender: object  # its response sender
    stream: bool
    rid: str = field(default_factory=lambda: f"triton-{uuid.uuid4().hex}")
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    done: bool = False


class TritonPythonModel:
    """Triton's Python-backend entry points: initialize, execute, finalize."""

    def initialize(self, args: dict) -> None:
        global pb_utils
        import triton_python_backend_utils as pb_utils  # noqa: F811 - exists only in the stub

        from ..engine import LLMEngine
        from .engine_thread import EngineThread

        for var, value in (("HF_HUB_OFFLINE", "1"), ("ORT_DISABLE_TELEMETRY", "1"), ("TOKENIZERS_PARALLELISM", "false")):
            os.environ.setdefault(var, value)  # as the CLI does: the model only reads its local build
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise KvExportError("this model streams tokens: set model_transaction_policy { decoupled: true }")
        build_dir, cfg = engine_settings(config.get("parameters", {}), args["model_repository"])
        self.engine = LLMEngine(build_dir, cfg)
        self.parser = RequestParser.for_engine(self.engine)
        self.salt_key = SaltKey.from_env()  # $KVEXPORT_CACHE_SALT_KEY: only gateway-signed cache_salts (cache_salts.py)
        self.labels = {"model": args["model_name"], "version": str(args["model_version"]),
                       "instance": args["model_instance_name"]}
        self._lock = threading.Lock()  # guards _active: execute() adds, the engine thread removes
        self._active: dict[str, _Request] = {}
        self._last_poll = self._last_metrics = 0.0
        self._poll_next = 0  # round-robin cursor over the active requests
        self._idle_published = False  # the metrics shown were taken while the engine was idle
        self._cancelled = 0
        self._shutdown_file = os.environ.get(SHUTDOWN_FILE_ENV) or None
        self._server_pid = os.getppid()  # tritonserver, which started this stub
        self._shutting_down = False  # the shutdown file appeared: open requests ended, new ones refused
        self._metrics = _Metrics(self.labels)
        self.worker = EngineThread(self.engine, on_tick=self._tick)
        self._metrics.publish(self.worker.counters, 0)  # before the thread runs: figures from the start
        pb_utils.Logger.log_info(f"kvexport: serving {build_dir} ({self.worker.counters.stats.kv_blocks_total} KV blocks, "
                                 f"max_model_len {self.engine.max_model_len})")
        self.worker.start()  # from here on only the engine thread touches the engine

    # ---- Triton's execute thread ------------------------------------------------------
    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                arrays = {}
                for name, *_ in INPUTS:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is not None:
                        arrays[name] = t.as_numpy()
                prompt, params, stream = parse_request(arrays, self.parser, json.loads(request.parameters() or "{}"))
                if params.structured is not None:  # compiled here, not in the engine's step (structured.py)
                    field = "response_format" if "response_format" in arrays else "structured_outputs"
                    self.engine.prep.compile(params.structured, field)  # errors name the input
                salt = parse_cache_salt(arrays, self.salt_key)
                self.engine.prep.check_params(params)  # an adapter not loaded, ...: an error naming the input
            except Exception as e:  # noqa: BLE001 - a bad request gets an error, the model keeps serving
                msg = str(e) if isinstance(e, KvExportError) else f"invalid request: {e}"
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(msg)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            r = _Request(request, sender, stream)
            with self._lock:
                refused = self._shutting_down
                if not refused:
                    self._active[r.rid] = r
            if refused:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "the server is shutting down", pb_utils.TritonError.UNAVAILABLE)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            try:
                self.worker.submit(prompt, params, lambda ev, r=r: self._deliver(r, ev), request_ids=[r.rid],
                                   salt=salt)
            except KvExportError as e:  # the engine thread is gone: fail fast instead of hanging
                if self._release(r):
                    self._send_error(r, str(e))
        return None

    def finalize(self) -> None:
        # the thread's open requests get an error event (-> _deliver -> a FINAL error response);
        # a step still running is not waited for past STOP_WAIT_S and delivers nothing after
        self.worker.stop(reason="the model was unloaded")
        if self.worker.is_alive():
            log.warning("the engine thread was still in a step when the model was unloaded")
        with self._lock:
            left = list(self._active.values())
        for r in left:  # submitted to no thread (execute() raced with the unload)
            if self._release(r):  # marked done first: a late engine event cannot follow the FINAL error
                self._send_error(r, "the model was unloaded")

    # ---- engine thread ----------------------------------------------------------------
    def _response(self, text: str, ids: list[int], reason: str | None):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("token_ids", np.asarray(ids, dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.array([(reason or "").encode()], dtype=np.object_)),
        ])

    def _release(self, r: _Request) -> bool:
        """Mark r done and forget it; False if it was already done."""
        with self._lock:
            if r.done:
                return False
            r.done = True
            self._active.pop(r.rid, None)
            return True

    def _send_error(self, r: _Request, message: str, code=None) -> None:
        err = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        try:
            r.sender.send(pb_utils.InferenceResponse(error=err), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001 - the client may be gone already
            log.debug("could not send the error response of %s", r.rid, exc_info=True)

    def _deliver(self, r: _Request, ev) -> None:
        if r.done:
            return
        if ev.finish_reason == "error":
            if self._release(r):
                self._send_error(r, ev.error or "the request failed")
            return
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if ev.finished else 0
        if r.stream:
            if not (ev.new_text or ev.new_token_ids or ev.finished):
                return
            resp = self._response(ev.new_text, ev.new_token_ids, ev.finish_reason if ev.finished else None)
        else:
            r.text += ev.new_text
            r.token_ids += ev.new_token_ids
            if not ev.finished:
                return
            resp = self._response(r.text, r.token_ids, ev.finish_reason)
        if ev.finished and not self._release(r):
            return
        try:
            r.sender.send(resp, flags=final)
        except Exception:  # noqa: BLE001 - the client went away; the next tick sees the cancellation
            log.debug("sending a response of %s failed", r.rid, exc_info=True)

    def _shut_down(self) -> None:
        """The shutdown file appeared: end every open request and refuse new ones."""
        with self._lock:
            self._shutting_down = True
            active = list(self._active.values())
        for r in active:
            if self._release(r):
                self.worker.abort([r.rid])
                self._send_error(r, "the server is shutting down", pb_utils.TritonError.UNAVAILABLE)
        pb_utils.Logger.log_info(f"kvexport: shutting down, {len(active)} open request(s) ended")

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_poll >= POLL_CANCEL_S:
            self._last_poll = now
            if os.getppid() != self._server_pid:
                # NOTE: tritonserver was killed (SIGKILL; `kvexport triton-serve` killed with -9 takes it
                # along): no request can reach or leave this stub any more, and Triton 2.51's stub does
                # not always notice, so it would hold its memory forever. Leave at once.
                os._exit(1)
            if self._shutdown_file and not self._shutting_down and os.path.exists(self._shutdown_file):
                self._shut_down()
            with self._lock:
                active = list(self._active.values())
            start = self._poll_next % len(active) if active else 0
            batch = (active[start:] + active[:start])[:POLL_CANCEL_MAX]
            self._poll_next = start + len(batch)
            for r in batch:
                if not r.done and r.request.is_cancelled() and self._release(r):
                    self.worker.abort([r.rid])
                    self._cancelled += 1
                    self._send_error(r, "request cancelled", pb_utils.TritonError.CANCELLED)
        idle = not self.engine.has_unfinished()
        # every METRICS_EVERY_S while busy, and at once when the engine falls idle
        if now - self._last_metrics >= METRICS_EVERY_S or (idle and not self._idle_published):
            self._last_metrics = now
            self._idle_published = idle
            self._metrics.publish(self.worker.counters, self._cancelled)


class _Metrics:
    """Triton custom metrics (Prometheus, on Triton's metrics port): runtime/serving/metrics.py's
    table, as `kvexport serve`'s /metrics has it, labelled by model, version and instance."""

    def __init__(self, labels: dict[str, str]):
        # NOTE: a MetricFamily must outlive its Metrics, so the families are kept here
        self.families = []
        self.metrics = []
        for m in mx.METRICS:
            kind = pb_utils.MetricFamily.GAUGE if m.kind == mx.GAUGE else pb_utils.MetricFamily.COUNTER
            self.families.append(pb_utils.MetricFamily(name=m.full_name, description=m.help, kind=kind))
            self.metrics.append((m, self.families[-1].Metric(labels=labels)))
        self._seen: dict[str, float] = {}

    def publish(self, counters, cancelled: int) -> None:
        for m, metric in self.metrics:
            value = float(m.get(counters, cancelled))
            if m.kind == mx.GAUGE:
                metric.set(value)
                continue
            delta = value - self._seen.get(m.name, 0.0)  # Triton counters only take increments
            if delta > 0:
                metric.increment(delta)
                self._seen[m.name] = value
