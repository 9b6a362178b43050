"""A hostile trial of `kvexport dynamo` workers through a real `python -m dynamo.frontend` (issue 31 §7):
bad requests, a worker SIGKILLed mid-request, workers started on broken builds, prefill/decode
workers of mismatched builds. Counts the inputs tried and the failures by kind:

    500        a 5xx for a client's mistake (or for a valid request)
    hang       no answer within 10 s
    traceback  a Python traceback in a worker's log for a client's mistake
    status     a wrong status: a 2xx for a request the worker must refuse, a 4xx for a valid one
    wrong      a 200 whose tokens are not kvexport's greedy tokens on the build (prefill/decode mismatch)
    leak       KV blocks or running requests left on a worker once every request has ended
    crash      a worker process died (other than the one the trial kills)
    start      a broken build a worker registered (or started without a clear one-line error, exit 2)

Everything runs on 127.0.0.1 (file discovery, the event broker: bench/dynamo_routing.py's
`local_cluster`) on a paged build with a tokenizer (`--build`; small and fast: the tests' tiny
chat build is the right size). Prints one line per case and the totals; `--json` writes them.

    # after: the recipe's frontend settings (docs/DEPLOYMENT.md); before: the frontend as Dynamo ships it
    .venv/bin/python bench/dynamo_trial.py --build BUILD --json bench/results/dynamo_trial_after.json
    .venv/bin/python bench/dynamo_trial.py --build BUILD --env DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS= \
        --env DYN_HTTP_BODY_LIMIT_MB= --json bench/results/dynamo_trial_before.json
    .venv/bin/python bench/dynamo_trial.py --build BUILD --sections mismatch --json bench/results/dynamo_trial_mismatch.json

The totals and every case: docs/BAD_INPUTS.md, "Hardening round 3, own trial: Dynamo workers".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dynamo_routing as dr  # noqa: E402  (bench/: its local_cluster)

MODEL = "trial"
HANG_S = 10.0
OK, REFUSE, EITHER = "ok", "refuse", "either"  # what a case must get: 200, a 4xx, or either


def request_cases(vocab: int, context: int) -> list[tuple[str, str, object, str]]:
    """(name, route, body: a dict sent as JSON or bytes sent raw, expectation)."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    p = [5, 6, 7]
    msg = [{"role": "user", "content": "hello"}]
    cases: list[tuple[str, str, object, str]] = [
        # ---- malformed bodies
        ("not json", c, b"{not json", REFUSE), ("empty body", c, b"", REFUSE), ("json array", c, b"[1,2]", REFUSE),
        ("json string", c, b'"hi"', REFUSE), ("truncated json", c, b'{"model": "trial", "prompt": [1,', REFUSE),
        ("nested 10000 deep", c, b'{"model":"trial","prompt":' + b"[" * 10000 + b"]" * 10000 + b"}", REFUSE),
        ("NaN literal max_tokens", c, b'{"model":"trial","prompt":[5,6],"max_tokens":NaN}', REFUSE),
        ("Infinity literal temperature", c, b'{"model":"trial","prompt":[5,6],"temperature":Infinity}', REFUSE),
        ("no model", c, {"prompt": p}, REFUSE), ("unknown model", c, {"model": "nope", "prompt": p}, REFUSE),
        ("model is a number", c, {"model": 5, "prompt": p}, REFUSE), ("no prompt", c, {"model": MODEL}, REFUSE),
        ("chat without messages", ch, {"model": MODEL}, REFUSE),
        ("messages a string", ch, {"model": MODEL, "messages": "hello"}, REFUSE),
        ("messages [{}]", ch, {"model": MODEL, "messages": [{}]}, REFUSE),
        ("role unknown", ch, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, REFUSE),
        ("content a number", ch, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, REFUSE),
        ("empty messages", ch, {"model": MODEL, "messages": []}, REFUSE),
        # ---- prompts
        ("prompt null", c, {"model": MODEL, "prompt": None}, REFUSE),
        ("prompt a number", c, {"model": MODEL, "prompt": 5}, REFUSE),
        ("prompt an object", c, {"model": MODEL, "prompt": {"a": 1}}, REFUSE),
        ("prompt empty string", c, {"model": MODEL, "prompt": ""}, EITHER),
        ("prompt empty list", c, {"model": MODEL, "prompt": []}, REFUSE),
        ("prompt [[]]", c, {"model": MODEL, "prompt": [[]]}, REFUSE),
        ("token id -1", c, {"model": MODEL, "prompt": [5, -1]}, REFUSE),
        ("token id = vocab", c, {"model": MODEL, "prompt": [5, vocab]}, REFUSE),
        ("token id 2**40", c, {"model": MODEL, "prompt": [5, 2 ** 40]}, REFUSE),
        ("token id 2**64", c, {"model": MODEL, "prompt": [5, 2 ** 64]}, REFUSE),
        ("token id 1.5", c, {"model": MODEL, "prompt": [5, 1.5]}, REFUSE),
        ("token id a string", c, {"model": MODEL, "prompt": [5, "6"]}, REFUSE),
        ("token id true", c, {"model": MODEL, "prompt": [5, True]}, REFUSE),
        ("prompt = context", c, {"model": MODEL, "prompt": [5] * context}, REFUSE),
        ("prompt = context - 1", c, {"model": MODEL, "prompt": [5] * (context - 1), "max_tokens": 1}, OK),
        ("prompt 100k ids", c, {"model": MODEL, "prompt": [5] * 100_000}, REFUSE),
        ("prompt 1 MB text", c, {"model": MODEL, "prompt": "word " * 200_000}, REFUSE),
        ("batch of 2 prompts", c, {"model": MODEL, "prompt": ["hi", "there"]}, EITHER),
        ("batch of 2 id lists", c, {"model": MODEL, "prompt": [[5, 6], [7, 8]]}, EITHER),
        ("emoji prompt", c, {"model": MODEL, "prompt": "🙂🚀 ünïcödé ∑", "max_tokens": 3}, OK),
        ("NUL in prompt", c, {"model": MODEL, "prompt": "a\u0000b", "max_tokens": 3}, OK),
        ("lone surrogate", c, b'{"model":"trial","prompt":"a\\ud800b","max_tokens":3}', EITHER),
        ("RTL + zero-width", c, {"model": MODEL, "prompt": "\u202eabc\u200b\u200d", "max_tokens": 3}, OK),
        ("zalgo 60 chars", ch, {"model": MODEL, "messages": [{"role": "user", "content": "z\u0336" * 30}],
                                "max_tokens": 3}, EITHER),
        # ---- numbers
        *[(f"max_tokens {v!r}", c, {"model": MODEL, "prompt": p, "max_tokens": v}, e) for v, e in (
            (-1, REFUSE), (0, EITHER), (1e30, REFUSE), (2 ** 63, REFUSE), (2 ** 64, REFUSE), ("8", REFUSE),
            (1.5, REFUSE), (None, OK), (True, REFUSE))],
        *[(f"temperature {v!r}", c, {"model": MODEL, "prompt": p, "temperature": v, "max_tokens": 3}, e)
          for v, e in ((-1, REFUSE), (0, OK), (1e-310, OK), (1e-6, OK), (1e308, EITHER), (3, EITHER), ("hot", REFUSE),
                       (None, OK))],
        *[(f"top_p {v!r}", c, {"model": MODEL, "prompt": p, "top_p": v, "max_tokens": 3}, e)
          for v, e in ((0, EITHER), (-0.5, REFUSE), (1.5, REFUSE), (1e-300, EITHER), ("x", REFUSE))],
        *[(f"top_k {v!r}", c, {"model": MODEL, "prompt": p, "top_k": v, "max_tokens": 3}, e)
          for v, e in ((-5, REFUSE), (0, EITHER), (-1, EITHER), (10 ** 9, OK), (2 ** 40, EITHER), (1.5, REFUSE))],
        *[(f"min_p {v!r}", c, {"model": MODEL, "prompt": p, "min_p": v, "max_tokens": 3}, e)
          for v, e in ((2, REFUSE), (-1, REFUSE), (1, OK))],
        *[(f"{k} {v!r}", c, {"model": MODEL, "prompt": p, k: v, "max_tokens": 3}, e)
          for k, v, e in (("frequency_penalty", 1e308, REFUSE), ("frequency_penalty", -3, REFUSE),
                          ("presence_penalty", 2, OK), ("presence_penalty", 5, REFUSE),
                          ("repetition_penalty", 0, REFUSE), ("repetition_penalty", -1, REFUSE),
                          ("repetition_penalty", 1e308, EITHER), ("repetition_penalty", 1e-300, EITHER))],
        *[(f"seed {v!r}", c, {"model": MODEL, "prompt": p, "seed": v, "max_tokens": 3}, e)
          for v, e in ((-1, EITHER), (2 ** 64, REFUSE), (2 ** 63, EITHER), ("x", REFUSE), (0, OK))],
        *[(f"min_tokens {v!r}", c, {"model": MODEL, "prompt": p, "min_tokens": v, "max_tokens": 3}, e)
          for v, e in ((5, REFUSE), (-1, REFUSE), (3, OK))],
        # ---- n, logprobs, echo and friends
        ("n 2", c, {"model": MODEL, "prompt": p, "n": 2}, REFUSE), ("n 0", c, {"model": MODEL, "prompt": p, "n": 0},
                                                                      REFUSE),
        ("n -1", c, {"model": MODEL, "prompt": p, "n": -1}, REFUSE),
        ("n 10**9", c, {"model": MODEL, "prompt": p, "n": 10 ** 9}, REFUSE),
        ("best_of 3", c, {"model": MODEL, "prompt": p, "best_of": 3}, REFUSE),
        ("chat n 2", ch, {"model": MODEL, "messages": msg, "n": 2}, REFUSE),
        ("logprobs 0", c, {"model": MODEL, "prompt": p, "logprobs": 0, "max_tokens": 2}, OK),
        ("logprobs 5", c, {"model": MODEL, "prompt": p, "logprobs": 5, "max_tokens": 2}, OK),
        ("logprobs -1", c, {"model": MODEL, "prompt": p, "logprobs": -1, "max_tokens": 2}, REFUSE),
        ("logprobs 1000", c, {"model": MODEL, "prompt": p, "logprobs": 1000, "max_tokens": 2}, REFUSE),
        ("chat logprobs + top_logprobs 5", ch, {"model": MODEL, "messages": msg, "logprobs": True,
                                                "top_logprobs": 5, "max_tokens": 2}, OK),
        ("chat top_logprobs 50", ch, {"model": MODEL, "messages": msg, "logprobs": True, "top_logprobs": 50,
                                      "max_tokens": 2}, REFUSE),
        ("chat top_logprobs -1", ch, {"model": MODEL, "messages": msg, "logprobs": True, "top_logprobs": -1,
                                      "max_tokens": 2}, REFUSE),
        ("echo", c, {"model": MODEL, "prompt": p, "echo": True, "max_tokens": 2}, EITHER),
        ("prompt_logprobs 1", c, {"model": MODEL, "prompt": p, "prompt_logprobs": 1, "max_tokens": 2}, REFUSE),
        ("suffix", c, {"model": MODEL, "prompt": p, "suffix": "end", "max_tokens": 2}, REFUSE),
        ("logit_bias", c, {"model": MODEL, "prompt": p, "logit_bias": {"5": 100}, "max_tokens": 2}, REFUSE),
        ("ignore_eos + max_tokens 40", c, {"model": MODEL, "prompt": p, "ignore_eos": True, "max_tokens": 40}, OK),
        ("stream_options without stream", c, {"model": MODEL, "prompt": p, "stream_options": {"include_usage": True},
                                              "max_tokens": 2}, EITHER),
        ("stream 'yes'", c, {"model": MODEL, "prompt": p, "stream": "yes"}, REFUSE),
        ("guided_json", c, {"model": MODEL, "prompt": p, "guided_json": {"type": "object"}, "max_tokens": 8}, EITHER),
        ("unknown field", c, {"model": MODEL, "prompt": p, "frobnicate": 1, "max_tokens": 2}, EITHER),
        # ---- stop strings
        ("stop 5", c, {"model": MODEL, "prompt": p, "stop": 5}, REFUSE),
        ("stop ['']", c, {"model": MODEL, "prompt": p, "stop": [""], "max_tokens": 3}, EITHER),
        ("stop 100 strings", c, {"model": MODEL, "prompt": p, "stop": [f"s{i}" for i in range(100)],
                                 "max_tokens": 3}, EITHER),
        ("stop 10 KB string", c, {"model": MODEL, "prompt": p, "stop": ["y" * 10_000], "max_tokens": 3}, EITHER),
        ("stop unicode", c, {"model": MODEL, "prompt": p, "stop": ["🙂", "\u0000"], "max_tokens": 3}, OK),
        ("stop_token_ids -1", c, {"model": MODEL, "prompt": p, "stop_token_ids": [-1], "max_tokens": 3}, REFUSE),
        ("stop_token_ids huge", c, {"model": MODEL, "prompt": p, "stop_token_ids": [2 ** 40], "max_tokens": 3},
         REFUSE),
        # ---- salts
        *[(f"cache_salt {name}", c, {"model": MODEL, "prompt": p, "cache_salt": v, "max_tokens": 2}, e)
          for name, v, e in (("''", "", EITHER), ("5", 5, REFUSE), ("null", None, OK), ("10 KB", "s" * 10_000, REFUSE),
                             ("unicode", "租户🙂", OK), ("list", ["a"], REFUSE), ("a", "a", OK))],
        ("nvext.cache_salt ''", c, {"model": MODEL, "prompt": p, "nvext": {"cache_salt": ""}, "max_tokens": 2},
         EITHER),
        ("nvext.cache_salt 5", c, {"model": MODEL, "prompt": p, "nvext": {"cache_salt": 5}, "max_tokens": 2}, REFUSE),
        ("nvext a string", c, {"model": MODEL, "prompt": p, "nvext": "x", "max_tokens": 2}, REFUSE),
        ("salts disagree", c, {"model": MODEL, "prompt": p, "cache_salt": "a", "nvext": {"cache_salt": "b"},
                               "max_tokens": 2}, EITHER),
    ]
    return cases


def post(base: str, route: str, body, stream: bool = False) -> tuple[int | None, str, float]:
    """(status or None on a hang, text (first 300 chars), seconds)."""
    t0 = time.monotonic()
    try:
        if isinstance(body, bytes):
            r = httpx.post(base + route, content=body, headers={"content-type": "application/json"}, timeout=HANG_S)
            return r.status_code, r.text[:300], time.monotonic() - t0
        body = dict(body, stream=True) if stream else body
        with httpx.stream("POST", base + route, json=body, timeout=HANG_S) as r:
            text = "".join(r.iter_text())
            if stream and r.status_code == 200 and '"error"' in text[:20000]:
                return 299, text[:300], time.monotonic() - t0  # 299: a 200 whose stream carries an error
            return r.status_code, text[:300], time.monotonic() - t0
    except httpx.TimeoutException:
        return None, "timeout", time.monotonic() - t0
    except httpx.HTTPError as e:
        return -1, f"{type(e).__name__}: {e}"[:300], time.monotonic() - t0


def classify(status: int | None, expect: str) -> str | None:
    if status is None:
        return "hang"
    if status == -1 or status >= 500:
        return "500"
    if expect == REFUSE and status < 400:
        return "status"
    if expect == OK and status >= 300:
        return "status"
    return None


class Logs:
    """New text of the workers' logs since the last look."""

    def __init__(self, paths):
        self.paths, self.seen = paths, {}

    def new(self) -> str:
        out = []
        for p in self.paths():
            text = p.read_text(errors="replace") if p.exists() else ""
            out.append(text[self.seen.get(p, 0):])
            self.seen[p] = len(text)
        return "".join(out)


def settle_leaks(cluster, n: int) -> list[str]:
    """Workers holding blocks or requests 5 s after the last request ended."""
    deadline = time.monotonic() + 5
    while True:
        bad = []
        for i in range(n):
            try:
                m = cluster.worker_metrics(i)
            except httpx.HTTPError:
                continue
            if m.get("kvexport_kv_blocks_used", 0) or m.get("kvexport_requests_running", 0):
                bad.append(f"worker{i}: {m.get('kvexport_kv_blocks_used')} blocks, "
                           f"{m.get('kvexport_requests_running')} running")
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(0.5)


def run_requests(cluster, build: Path, rows: list[dict]) -> None:
    manifest = json.loads((build / "kvexport.json").read_text())
    vocab = manifest["model"]["vocab_size"]
    context = manifest["kv"]["max_seq_len"]
    logs = Logs(lambda: [p for p in cluster.logs if p.name.startswith("worker")])
    logs.new()
    for name, route, body, expect in request_cases(vocab, context):
        for stream in ((False, True) if isinstance(body, dict) and "stream" not in body else (False,)):
            status, text, secs = post(cluster.base, route, body, stream)
            new = logs.new()
            kind = classify(status, expect)
            if kind is None and "Traceback" in new and (status or 0) >= 400:
                kind = "traceback"
            if kind is None and any(w.poll() is not None for w in cluster.workers):
                kind = "crash"
            rows.append(dict(section="request", case=name + (" (stream)" if stream else ""), expect=expect,
                             status=status, seconds=round(secs, 3), failure=kind, answer=text[:200]))
            print(f"{kind or 'ok':9} {status!s:5} {secs:6.2f}s {name}{' (stream)' if stream else ''}: {text[:110]!r}",
                  flush=True)
    run_big_body(cluster, rows)
    leaks = settle_leaks(cluster, len(cluster.workers))
    rows.append(dict(section="request", case="after all requests: blocks and requests held", expect="none",
                     status=None, seconds=0, failure="leak" if leaks else None, answer="; ".join(leaks)))
    print("leaks:", leaks or "none", flush=True)


def run_big_body(cluster, rows: list[dict], mb: int = 30) -> None:
    """A `mb` MB text prompt, and meanwhile a small text request every 0.5 s: the big one must be refused
    within HANG_S and must not hold up the others (Dynamo's frontend tokenizes before any check, and
    text prompts wait for its tokenizer: seen here, token-id prompts are not held up)."""
    big: list = []
    t = threading.Thread(target=lambda: big.append(post(cluster.base, "/v1/completions",
                                                        {"model": MODEL, "prompt": "x" * (mb * 1_000_000)})))
    t.start()
    small: list[float] = []
    calm = 0  # small requests answered within 1 s since the big one ended (its client gone, the frontend maybe not)
    while (t.is_alive() or calm < 5) and len(small) < 300:
        status, _, secs = post(cluster.base, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        small.append(secs if status == 200 else HANG_S)
        calm = 0 if t.is_alive() or secs > 1.0 or status != 200 else calm + 1
        time.sleep(0.5)
    t.join()
    status, text, secs = big[0] if big else (None, "no answer", 0.0)
    rows.append(dict(section="request", case=f"prompt {mb} MB text", expect=REFUSE, status=status,
                     seconds=round(secs, 3), failure=classify(status, REFUSE), answer=text[:200]))
    worst = max(small, default=0.0)
    rows.append(dict(section="request", case=f"small requests during the {mb} MB one ({len(small)})", expect=OK,
                     status=200 if worst < HANG_S else None, seconds=round(worst, 3),
                     failure="hang" if worst >= HANG_S else None, answer=f"slowest {worst:.2f} s"))
    print(f"big body: {status} in {secs:.1f} s; {len(small)} small requests meanwhile, slowest {worst:.2f} s",
          flush=True)


def run_kill(cluster, rows: list[dict]) -> None:
    """SIGKILL worker 0 while it streams a long request; another request to it, non-streamed, in flight
    too. Each client must get an answer (an error or a migrated completion) within HANG_S; then the
    worker is started again and must serve."""
    results: dict[str, tuple] = {}

    def one(key: str, stream: bool) -> None:
        body = {"model": MODEL, "prompt": [40 + len(key), 41, 42], "max_tokens": 50, "ignore_eos": True}
        results[key] = post(cluster.base, "/v1/completions", body, stream)

    threads = [threading.Thread(target=one, args=(f"k{i}", i % 2 == 0)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.4)
    victim = cluster.workers[0]
    victim.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    for t in threads:
        t.join(timeout=HANG_S + 5)
    victim.wait(timeout=10)
    for key, (status, text, secs) in sorted(results.items()):
        kind = "hang" if status is None else ("500" if status == -1 or (status >= 500 and status != 503) else None)
        rows.append(dict(section="kill", case=f"SIGKILL mid-request: request {key}", expect="200 or 503",
                         status=status, seconds=round(secs, 3), failure=kind, answer=text[:200]))
        print(f"{kind or 'ok':9} {status!s:5} {secs:6.2f}s kill {key}: {text[:110]!r}", flush=True)
    # requests right after the kill (the frontend may still list the dead worker)
    after = []
    for i in range(8):
        status, text, secs = post(cluster.base, "/v1/completions", {"model": MODEL, "prompt": [60 + i], "max_tokens": 2})
        after.append(status)
        kind = "hang" if status is None else ("500" if status == -1 or (status >= 500 and status != 503) else None)
        rows.append(dict(section="kill", case=f"request {i} just after the kill", expect="200 or 503",
                         status=status, seconds=round(secs, 3), failure=kind, answer=text[:200]))
        print(f"{kind or 'ok':9} {status!s:5} {secs:6.2f}s after kill {i}: {text[:110]!r}", flush=True)
    print(f"kill: answered {len(results)}/6 within {time.monotonic() - t0:.1f} s; after: {after}", flush=True)
    cluster.start_worker(0)
    dr.wait_until(lambda: cluster.ready_workers() == len(cluster.workers), "the killed worker back",
                  cluster.log_text, 120)
    status, text, secs = post(cluster.base, "/v1/completions", {"model": MODEL, "prompt": [70], "max_tokens": 2})
    rows.append(dict(section="kill", case="the worker started again serves", expect=OK, status=status,
                     seconds=round(secs, 3), failure=classify(status, OK), answer=text[:200]))
    leaks = settle_leaks(cluster, len(cluster.workers))
    rows.append(dict(section="kill", case="after the kill: blocks and requests held", expect="none", status=None,
                     seconds=0, failure="leak" if leaks else None, answer="; ".join(leaks)))


def broken_builds(build: Path, tmp: Path) -> list[tuple[str, Path]]:
    out = []

    def copy(name: str) -> Path:
        d = tmp / name
        shutil.copytree(build, d)
        return d

    d = copy("truncated-weights")
    w = d / "weights.data"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    out.append(("weights.data truncated to half", d))
    d = copy("zeroed-weights")
    data = bytearray((build / "weights.data").read_bytes())
    mid = len(data) // 2
    data[mid: mid + 4096] = bytes(4096)
    (d / "weights.data").write_bytes(bytes(data))
    out.append(("weights.data zeroed in the middle (same size)", d))
    for name, edit in (("max_seq_len 100000", lambda m: m["kv"].__setitem__("max_seq_len", 100000)),
                       ("vocab_size +1", lambda m: m["model"].__setitem__("vocab_size", m["model"]["vocab_size"] + 1)),
                       ("block_size 7", lambda m: m["kv"].__setitem__("block_size", 7)),
                       ("schema_version 999", lambda m: m.__setitem__("schema_version", 999))):
        d = copy("manifest-" + name.split()[0])
        m = json.loads((d / "kvexport.json").read_text())
        edit(m)
        (d / "kvexport.json").write_text(json.dumps(m))
        out.append((f"manifest {name}", d))
    d = copy("manifest-truncated")
    (d / "kvexport.json").write_text((build / "kvexport.json").read_text()[:200])
    out.append(("manifest truncated JSON", d))
    for missing in ("prefill.onnx", "decode.onnx", "tokenizer.json", "kvexport.json", "config.json"):
        d = copy("missing-" + missing.split(".")[0])
        (d / missing).unlink()
        out.append((f"{missing} missing", d))
    d = copy("garbage-graph")
    (d / "decode.onnx").write_bytes(b"\x00garbage" * 100)
    out.append(("decode.onnx garbage", d))
    return out


def run_broken(cluster, build: Path, tmp: Path, rows: list[dict]) -> None:
    for name, d in broken_builds(build, tmp):
        before = cluster.ready_workers()
        t0 = time.monotonic()
        try:
            r = subprocess.run([sys.executable, "-m", "kvexport.cli", "dynamo", str(d), "--namespace",
                                cluster.namespace, "--served-model-name", MODEL, "--threads", "1"],
                               env=cluster.env, capture_output=True, text=True, timeout=60)
            code, out = r.returncode, (r.stdout + r.stderr).strip()
        except subprocess.TimeoutExpired as e:  # it started: registered and serving
            code, out = None, f"still running after 60 s: {(e.stdout or b'')[-300:]!r}"
        secs = time.monotonic() - t0
        registered = "dynamo worker: model" in out or code is None
        failure = None
        if registered or code != 2:
            failure = "start"
        elif "Traceback" in out:
            failure = "traceback"
        rows.append(dict(section="broken build", case=name, expect="exit 2, one line", status=code,
                         seconds=round(secs, 2), failure=failure, answer=out[-300:]))
        print(f"{failure or 'ok':9} {code!s:5} {secs:6.2f}s broken: {name}: {out[-160:]!r}", flush=True)
        assert cluster.ready_workers() == before


def run_mismatch(build: Path, other: Path, tmp: Path, rows: list[dict]) -> None:
    """A prefill worker on `other`, a decode worker on `build` (the inline KV transfer: no NIXL)."""
    with dr.local_cluster(build, tmp / "mismatch", 2, "kv", ("--kv-cache-memory", "4MiB", "--kv-transfer",
                                                             "request-plane"),
                          namespace="kvxtrialmm", model=MODEL, timeout=180,
                          each_worker_args=[("--mode", "prefill"), ("--mode", "decode")]) as c:
        # worker 0 (prefill) must run on the other build: restart it there
        c.workers[0].terminate()
        c.workers[0].wait(timeout=30)
        args = [sys.executable, "-m", "kvexport.cli", "dynamo", str(other), "--namespace", c.namespace,
                "--served-model-name", MODEL, "--threads", "1", "--kv-cache-memory", "4MiB", "--kv-transfer",
                "request-plane", "--mode", "prefill"]
        log = tmp / "mismatch-prefill.log"
        with open(log, "w") as f:
            p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=dict(c.env, DYN_SYSTEM_PORT="0"))
        try:
            dr.wait_until(lambda: p.poll() is not None or dr.READY.search(log.read_text(errors="replace")),
                          "the prefill worker of the other build", lambda: log.read_text(errors="replace"), 180)
            time.sleep(3)  # the frontend lists it
            from kvexport import LLM, SamplingParams

            prompts = [[80 + i] + list(range(100, 120)) for i in range(6)]  # more than a block: blocks handed over
            want = [o.token_ids for o in LLM(build, threads=1, kv_cache_memory="4MiB").generate(
                prompts, SamplingParams(max_tokens=3))]
            for i, prompt in enumerate(prompts):
                t0 = time.monotonic()
                try:
                    r = httpx.post(c.base + "/v1/completions", timeout=HANG_S, json={
                        "model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 0,
                        "return_tokens_as_token_ids": True})
                    status, text = r.status_code, r.text
                except httpx.TimeoutException:
                    status, text = None, "timeout"
                secs = time.monotonic() - t0
                kind = "hang" if status is None else ("500" if status >= 500 and status != 503 else
                                                      ("status" if 400 <= status < 500 else None))
                if status == 200:  # the tokens kvexport computes on the decode worker's build
                    got = [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
                    if got != want[i]:
                        kind, text = "wrong", f"tokens {got}, kvexport's {want[i]}"
                rows.append(dict(section="mismatch", case=f"prefill/decode of two builds: request {i}",
                                 expect="served or 503 (a deployment error is not the client's)", status=status,
                                 seconds=round(secs, 3), failure=kind, answer=text[:200]))
                print(f"{kind or 'ok':9} {status!s:5} {secs:6.2f}s mismatch {i}: {text[:110]!r}", flush=True)
                time.sleep(0.5)
            health = httpx.get(c.metrics[1].replace("/metrics", "/health"), timeout=5)
            rows.append(dict(section="mismatch", case="the decode worker's /health", expect="503 notready",
                             status=health.status_code, seconds=0,
                             failure=None if health.status_code == 503 else "status", answer=health.text[:200]))
            print("decode /health:", health.status_code, health.text[:200], flush=True)
        finally:
            p.terminate()
            p.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="a paged build with a tokenizer (small)")
    ap.add_argument("--other-build", help="a second build for the prefill/decode mismatch [a copy of --build "
                                          "with its weights changed]")
    ap.add_argument("--tmp", default="/tmp/kvexport-dynamo-trial")
    ap.add_argument("--sections", default="request,kill,broken,mismatch")
    ap.add_argument("--json", help="write the rows and totals here")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set for the frontend and the workers, e.g. DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS=0 (the "
                         "trial sets 500 and DYN_HTTP_BODY_LIMIT_MB=2 unless told; NAME= unsets: docs/DEPLOYMENT.md)")
    args = ap.parse_args()
    build, tmp = Path(args.build).resolve(), Path(args.tmp)
    os.environ.update({"DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS": "500", "DYN_HTTP_BODY_LIMIT_MB": "2"})
    for name, value in (kv.split("=", 1) for kv in args.env):  # local_cluster passes os.environ on
        os.environ.pop(name, None) if value == "" else os.environ.__setitem__(name, value)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rows: list[dict] = []
    sections = args.sections.split(",")
    if {"request", "kill", "broken"} & set(sections):
        with dr.local_cluster(build, tmp / "cluster", 2, "kv", ("--kv-cache-memory", "4MiB"), namespace="kvxtrial",
                              model=MODEL, timeout=180) as cluster:
            if "request" in sections:
                run_requests(cluster, build, rows)
            if "broken" in sections:
                run_broken(cluster, build, tmp / "broken", rows)
            if "kill" in sections:
                run_kill(cluster, rows)
    if "mismatch" in sections:
        other = Path(args.other_build) if args.other_build else None
        if other is None:  # the same model with other weights: a build that is not this one
            other = tmp / "other-build"
            shutil.copytree(build, other)
            w = other / "weights.data"
            data = bytearray(w.read_bytes())
            for i in range(0, len(data), 4):  # every float32 negated: same shapes, other numbers
                data[i + 3] ^= 0x80
            w.write_bytes(bytes(data))
            m = json.loads((other / "kvexport.json").read_text())
            m["weights"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()  # a whole build, not a damaged one
            (other / "kvexport.json").write_text(json.dumps(m))
        run_mismatch(build, other, tmp, rows)
    failures = Counter(r["failure"] for r in rows if r["failure"])
    totals = dict(inputs=len(rows), failures=sum(failures.values()), by_kind=dict(failures))
    print(json.dumps(totals), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(totals=totals, rows=rows), indent=1, default=str))


if __name__ == "__main__":
    main()
