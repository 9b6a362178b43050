"""Hostile trial of issue 31 §7 (every surface but Dynamo): streaming eviction at extreme
sink / window settings, `kvexport calibrate` (int4 and int8 KV) on hostile texts, and `kill -9`
during disk-tier writes (and during the shutdown persist of the host tier) followed by a restart.

    .venv/bin/python bench/hostile_trial.py [--sections streaming,calibrate,kill9] [--kills 2]
        [--workdir DIR] [--out bench/results/hostile_trial.json]

Every case is a real run on tiny random llama builds (context 64, KV blocks of 16, smollm2-135m's
tokenizer) and gets one outcome:

    ok             the run did what it should: a KvExportError naming the option / field and what to
                   do, or a finished run whose tokens equal the oracle (a float64 transformers
                   reference of sink + window attention for streaming; the same engine without
                   tiers / without eviction elsewhere) and whose KV stayed bounded
    internal       an exception that is not a KvExportError (a traceback, exit 1, a 500)
    hang           no answer within the case's time limit
    wrong_output   finished, but with tokens or constants that are not right (NaN scales, tokens
                   not the oracle's, a count that is off)
    data_loss      a restart lost or damaged what it should keep, or did not start
    message        a KvExportError whose message does not name the field at fault and a fix that works

Prints the table of cases and the totals by kind, and writes them as JSON (--out).
docs/BAD_INPUTS.md "Hardening round 3, own trial: streaming eviction, ..." lists the cases.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

KINDS = ("internal", "hang", "wrong_output", "data_loss", "message")
BS, CTX = 16, 64  # the builds' KV block size and context


class Trial:
    """The cases run and what each got."""

    def __init__(self):
        self.rows: list[dict] = []

    def record(self, section: str, case: str, outcome: str, detail: str = "") -> None:
        assert outcome == "ok" or outcome in KINDS, outcome
        self.rows.append({"section": section, "case": case, "outcome": outcome, "detail": detail[:400]})
        print(f"[{section}] {case}: {outcome}{' - ' + detail[:300] if detail else ''}", flush=True)

    def totals(self) -> dict:
        by = Counter(r["outcome"] for r in self.rows)
        per = {}
        for r in self.rows:
            per.setdefault(r["section"], Counter())[r["outcome"]] += 1
        return {"inputs": len(self.rows), "failures": sum(by[k] for k in KINDS),
                "by_kind": {k: by[k] for k in KINDS}, "by_section": {s: dict(c) for s, c in per.items()}}


def expect_error(trial: Trial, section: str, case: str, fn, *needles: str) -> None:
    """A case that must be refused with a KvExportError whose message holds every needle."""
    from kvexport.errors import KvExportError

    try:
        fn()
    except KvExportError as e:
        missing = [n for n in needles if n not in str(e)]
        trial.record(section, case, "message" if missing else "ok",
                     f"{str(e)[:200]}" + (f" (lacks {missing})" if missing else ""))
        return
    except Exception as e:  # noqa: BLE001 - the trial classifies whatever happens
        trial.record(section, case, "internal", f"{type(e).__name__}: {e}")
        return
    trial.record(section, case, "wrong_output", "accepted; should be refused")


# ---- the builds -----------------------------------------------------------------------------------------
def hf_folder(directory: Path, family: str = "llama", **over) -> Path:
    """A tiny random model saved as an HF folder; llama ones get smollm2-135m's tokenizer (vocab 49152)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig

    base = dict(vocab_size=49152, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, max_position_embeddings=256)
    if family == "gemma2":
        base.update(vocab_size=128, head_dim=16, sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "gemma2": Gemma2Config}[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**base, **over}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)  # realistic logit spreads: greedy ties unlikely
    model.save_pretrained(directory, safe_serialization=True)
    if family == "llama":
        from kvexport.exporter.source import load_tokenizer, resolve

        load_tokenizer(resolve("smollm2-135m")).save_pretrained(directory)
    return directory


def make_builds(tmp: Path) -> dict[str, Path]:
    """The tiny builds, made once per --workdir (later runs reuse them)."""
    from kvexport import io
    from kvexport.exporter.build import BuildOptions, build

    src = tmp / "hf-llama"
    if not (src / "tokenizer.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        hf_folder(src)
    out = {"src": src}
    for name, kv in (("fp32", None), ("int8", io.DType.INT8), ("int4", io.DType.INT4)):
        if (tmp / f"b-{name}" / io.MANIFEST_NAME).is_file():
            out[name] = tmp / f"b-{name}"
            continue
        quant = dict(kv_dtype=kv, calibration_tokens=256) if kv else {}
        opts = BuildOptions(max_seq_len=CTX, validate=False, attention=io.Attention.ONNX, **quant)
        out[name], _ = build(str(src), tmp / f"b-{name}", opts)
    return out


# ---- (a) streaming eviction ------------------------------------------------------------------------------
def reference(folder, prompt, max_tokens, sink_tokens, recent, max_model_len=CTX):
    """Greedy tokens of transformers (float64) under streaming's semantics (tests/testkit/streaming.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from testkit.streaming import streaming_reference

    return streaming_reference(folder, prompt, max_tokens, sink_tokens, recent, BS, max_model_len)


def generate(build, prompts, max_tokens, n=1, **settings):
    """(outputs, engine, max blocks used) of greedy requests run together on one engine."""
    from kvexport.runtime.config import EngineConfig
    from kvexport.runtime.engine import LLMEngine
    from kvexport.runtime.sampling_params import SamplingParams

    cfg = dict(kv_cache_memory="1MiB", threads=1, max_num_batched_tokens=64)
    e = LLMEngine(build, EngineConfig(**{**cfg, **settings}))
    rids = []
    for p in prompts:
        first = len(rids)
        for i in range(n):
            rids.append(e.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n),
                                      sample_index=i, share_prompt_with=rids[first] if i else None))
    used = 0
    for _ in range(100_000):
        if not e.has_unfinished():
            break
        e.step()
        used = max(used, e.stats().kv_blocks_used)
    return [e.output(r) for r in rids], e, used


def streaming(trial: Trial, b: dict, quick: bool = False) -> None:
    """quick: only the settings that must be refused (no generation runs, no windowed builds)."""
    from kvexport.runtime.config import EngineConfig

    S = "streaming"
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    src = b["src"]

    def stream_case(case, sinks, recent, max_tokens=120, build="fp32", prompts=(prompt,), n=1, oracle="ref",
                    max_blocks=None, **extra):
        if quick:
            return
        try:
            outs, e, used = generate(b[build], list(prompts), max_tokens, n=n, kv_eviction="streaming",
                                     kv_sink_tokens=sinks, kv_recent_tokens=recent, **extra)
        except Exception as ex:  # noqa: BLE001
            from kvexport.errors import KvExportError

            trial.record(S, case, "message" if isinstance(ex, KvExportError) else "internal",
                         f"{type(ex).__name__}: {ex}")
            return
        bad = [o for o in outs if o.error or len(o.token_ids) != max_tokens or o.finish_reason != "length"]
        if bad:
            trial.record(S, case, "wrong_output", f"{bad[0].error or (len(bad[0].token_ids), bad[0].finish_reason)}")
            return
        sink_tokens = -(-sinks // BS) * BS
        limit = max_blocks or (sink_tokens + recent) // BS + 2 + -(-64 // BS)
        if oracle == "ref":
            want = [reference(src, list(p), max_tokens, sink_tokens, recent) for p in prompts for _ in range(n)]
        elif oracle == "none":  # a window covering the context: no eviction's tokens
            want = [list(o.token_ids) for o in generate(b[build], list(prompts), max_tokens, n=n)[0]]
        else:
            want = None
        got = [list(o.token_ids) for o in outs]
        if want is not None and got != want:
            first = next(i for i, (g, w) in enumerate(zip(got[0], want[0])) if g != w) if got[0] != want[0] else -1
            trial.record(S, case, "wrong_output", f"tokens differ from the oracle (first at {first})")
        elif e.stats().kv_blocks_used != 0 or (n == 1 and len(prompts) == 1 and used > limit):
            trial.record(S, case, "wrong_output", f"blocks used {used} > {limit} or left {e.stats().kv_blocks_used}")
        else:
            trial.record(S, case, "ok", f"{max_tokens} tokens, shifts {e.scheduler.num_context_shifts}, "
                                        f"max blocks {used}")

    stream_case("sinks 0 (a plain sliding window), recent 16", 0, 16)
    stream_case("sinks 1 (rounded up to one block), recent 16", 1, 16)
    stream_case("sinks 16, recent 17 (not a multiple of the block size)", 16, 17)
    stream_case("sinks 16, recent 31", 16, 31)
    stream_case("sinks 0, recent 48 (sinks + recent + one block = context)", 0, 48)
    stream_case("sinks 17 (two blocks), recent 16", 17, 16)
    stream_case("sinks 32, recent 16 (sinks + recent + block = context)", 32, 16)
    stream_case("long generation: 1000 tokens past a 64-token context", 4, 16, max_tokens=1000, oracle=None)
    stream_case("max_num_batched_tokens 1 (one token a step)", 4, 16, max_tokens=80, max_num_batched_tokens=1)
    stream_case("max_num_batched_tokens 16", 4, 16, max_tokens=80, max_num_batched_tokens=16)
    stream_case("prefix caching off", 4, 16, enable_prefix_caching=False)
    stream_case("host tier on (--kv-offload-memory 1MiB)", 4, 16, kv_offload_memory="1MiB")
    stream_case("n = 3 sharing the prompt's blocks", 4, 16, n=3)
    stream_case("host + disk tiers (--kv-offload-dir)", 4, 16, kv_offload_memory="64KiB",
                kv_offload_dir=tempfile.mkdtemp(prefix="stream-disk-", dir=Path(b["fp32"]).parent))
    stream_case("sinks 0, recent 16, --max-model-len 32 (a shift every 16 tokens)", 0, 16, max_tokens=100,
                max_model_len=32, oracle=None)
    stream_case("8 requests, one shared 40-token prefix, pool of 40 blocks (preemption)", 4, 16, max_tokens=100,
                prompts=[list(range(100, 140)) + [i] for i in range(8)], kv_cache_memory="640KiB")
    stream_case("prompt of 63 tokens (context - 1)", 4, 16, max_tokens=70, prompts=(list(range(200, 263)),))
    stream_case("int8 KV, window covering the context", 0, 48, max_tokens=40, build="int8", oracle="none")
    stream_case("int8 KV, sinks 4, recent 16, 300 tokens", 4, 16, max_tokens=300, build="int8", oracle=None)
    stream_case("int4 KV, window covering the context", 0, 48, max_tokens=40, build="int4", oracle="none")
    stream_case("int4 KV, sinks 0, recent 16, 300 tokens", 0, 16, max_tokens=300, build="int4", oracle=None)

    # prompts the context cannot hold: refused (an error output), never a crash
    try:
        if quick:
            raise StopIteration
        outs, _, _ = generate(b["fp32"], [list(range(300, 300 + CTX + 5))], 10, kv_eviction="streaming",
                              kv_sink_tokens=4, kv_recent_tokens=16)
        o = outs[0]
        ok = o.error and "max_model_len" in str(o.error) or "context" in str(o.error)
        trial.record(S, "prompt longer than the context", "ok" if ok else "wrong_output", str(o.error)[:200])
    except StopIteration:
        pass
    except Exception as ex:  # noqa: BLE001
        trial.record(S, "prompt longer than the context", "internal", f"{type(ex).__name__}: {ex}")

    def engine(**settings):
        return lambda: generate(b["fp32"], [prompt], 4, kv_eviction="streaming", **settings)

    expect_error(trial, S, "recent 1", engine(kv_recent_tokens=1), "--kv-recent-tokens", "at least 16")
    expect_error(trial, S, "recent 15 (< one block)", engine(kv_recent_tokens=15), "--kv-recent-tokens", "at least 16")
    expect_error(trial, S, "recent 0", engine(kv_recent_tokens=0), "kv_recent_tokens", ">= 1")
    expect_error(trial, S, "recent -5", engine(kv_recent_tokens=-5), "kv_recent_tokens", ">= 1")
    expect_error(trial, S, "recent True", engine(kv_recent_tokens=True), "kv_recent_tokens")
    expect_error(trial, S, "recent '16' (a string)", engine(kv_recent_tokens="16"), "kv_recent_tokens")
    expect_error(trial, S, "recent 10**30", engine(kv_recent_tokens=10**30), "--kv-recent-tokens", "<= 32")
    expect_error(trial, S, "recent 64 (= context)", engine(kv_recent_tokens=64), "--kv-recent-tokens", "<= 32")
    expect_error(trial, S, "sinks 48 + recent 16 (= context)", engine(kv_sink_tokens=48, kv_recent_tokens=16),
                 "lower --kv-sink-tokens to <= 32")
    expect_error(trial, S, "sinks 10**6, recent 16", engine(kv_sink_tokens=10**6, kv_recent_tokens=16),
                 "--kv-sink-tokens", "<= 32")
    expect_error(trial, S, "sinks 10**30, recent unset (32)", engine(kv_sink_tokens=10**30),
                 "lower --kv-sink-tokens to <= 16")
    expect_error(trial, S, "sinks 64 (= context), recent 16", engine(kv_sink_tokens=64, kv_recent_tokens=16),
                 "--kv-sink-tokens", "<= 32")
    expect_error(trial, S, "sinks -1", engine(kv_sink_tokens=-1), "kv_sink_tokens", ">= 0")
    expect_error(trial, S, "sinks 2.5", engine(kv_sink_tokens=2.5), "kv_sink_tokens")
    expect_error(trial, S, "recent 32 + max_num_batched_tokens 64 on an 8-block pool",
                 engine(kv_recent_tokens=32, kv_cache_memory="128KiB"), "--kv-recent-tokens", "--kv-cache-memory")
    expect_error(trial, S, "sinks 4 (a block), recent 16, --max-model-len 32 (16 + 16 + block > 32)",
                 engine(kv_recent_tokens=16, max_model_len=32), "lower --kv-sink-tokens to <= 0")
    expect_error(trial, S, "sinks 17 (two blocks), recent 17, --max-model-len 32",
                 engine(kv_sink_tokens=17, kv_recent_tokens=17, max_model_len=32),
                 "--kv-sink-tokens to 0 and --kv-recent-tokens to <= 16")
    expect_error(trial, S, "--max-model-len 24 (under two blocks)", engine(kv_recent_tokens=16, max_model_len=24),
                 "--max-model-len", "--kv-eviction none")
    expect_error(trial, S, "kv_eviction 'Streaming' (case)", lambda: EngineConfig(kv_eviction="Streaming"),
                 "kv_eviction", "streaming")
    expect_error(trial, S, "from_strings kv_sink_tokens 'many' (Triton parameters)",
                 lambda: EngineConfig.from_strings({"kv_sink_tokens": "many"}), "kv_sink_tokens")
    expect_error(trial, S, "from_strings kv_recent_tokens '1e400'",
                 lambda: EngineConfig.from_strings({"kv_recent_tokens": "1e400"}), "kv_recent_tokens")

    if quick:
        return
    # hybrid / windowed builds
    from kvexport import io
    from kvexport.exporter.build import BuildOptions, build

    tmp = Path(tempfile.mkdtemp(prefix="streaming-", dir=Path(b["fp32"]).parent))  # fresh on each run
    for fam, over in (("mistral", {"sliding_window": 8}), ("gemma2", {})):
        try:
            hf = hf_folder(tmp / f"hf-{fam}", fam, **over)
            out, _ = build(str(hf), tmp / f"b-{fam}", BuildOptions(max_seq_len=CTX, validate=False,
                                                                   attention=io.Attention.ONNX))
        except Exception as ex:  # noqa: BLE001
            trial.record(S, f"{fam} windowed build", "internal", f"building: {type(ex).__name__}: {ex}")
            continue
        expect_error(trial, S, f"{fam} (sliding-window layers) with streaming",
                     lambda: generate(out, [[5, 6, 7]], 4, kv_eviction="streaming", kv_recent_tokens=16),
                     "--kv-eviction", "none")
    # a window that does not cut into the context: mistral with sliding_window 4096 serves
    try:
        hf = hf_folder(tmp / "hf-mistral-wide", "mistral", sliding_window=4096, vocab_size=49152)
        out, _ = build(str(hf), tmp / "b-mistral-wide", BuildOptions(max_seq_len=CTX, validate=False,
                                                                     attention=io.Attention.ONNX))
        outs, e, _ = generate(out, [prompt], 100, kv_eviction="streaming", kv_sink_tokens=4, kv_recent_tokens=16)
        want = reference(hf, prompt, 100, 16, 16)
        trial.record(S, "mistral, sliding_window 4096 > context, streaming", "ok"
                     if list(outs[0].token_ids) == want else "wrong_output")
    except Exception as ex:  # noqa: BLE001
        trial.record(S, "mistral, sliding_window 4096 > context, streaming", "internal", f"{type(ex).__name__}: {ex}")


# ---- (b) calibrate on hostile texts ----------------------------------------------------------------------
def calibrate_cases(trial: Trial, b: dict, tmp: Path) -> None:
    import numpy as np

    from kvexport.errors import KvExportError
    from kvexport.exporter import calibrate as cal

    S = "calibrate"
    texts = tmp / "texts"
    shutil.rmtree(texts, ignore_errors=True)
    texts.mkdir()
    good = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 40

    def text(name, data: bytes | str):
        p = texts / name
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return p

    rng = np.random.default_rng(0)
    cases = [
        ("empty file", text("empty.txt", b""), 64, ("--text", "--tokens")),
        ("one token", text("one.txt", "the"), 64, ("--text", "--tokens")),
        ("one token, --tokens 1 (under the option's range)", text("one1.txt", "the"), 1, ("--tokens", "16..")),
        ("only whitespace (10 KB of spaces and newlines)", text("ws.txt", " \n\t" * 3400), 64, None),
        ("binary garbage (64 KB)", text("bin.bin", rng.integers(0, 256, 65536, dtype=np.uint8).tobytes()), 64, None),
        ("invalid UTF-8 (lone continuation bytes)", text("bad-utf8.txt", b"\x80\xbf\xfe\xff" * 5000), 64, None),
        ("NUL bytes only (64 KB)", text("nul.txt", b"\0" * 65536), 64, None),
        ("one enormous line (3 MB, no newline)", text("line.txt", ("word " * 600_000)), 256, None),
        ("10^6 repeated tokens ('a ' * 10^6)", text("rep.txt", "a " * 1_000_000), 256, None),
        ("10^6 repeated tokens, --tokens 4096 (past the context)", texts / "rep.txt", 4096, None),
        ("text longer than the context, --tokens 512", text("long.txt", good * 4), 512, None),
        ("a BOM then text", text("bom.txt", "\ufeff" + good), 64, None),
        ("UTF-16 text", text("utf16.txt", good.encode("utf-16")), 64, None),
    ]
    fifo = texts / "fifo"
    os.mkfifo(fifo)
    link = texts / "link.txt"
    link.symlink_to(texts / "long.txt")
    dangling = texts / "dangling.txt"
    dangling.symlink_to(texts / "gone.txt")
    unreadable = text("unreadable.txt", good)
    unreadable.chmod(0)
    cases += [
        ("a directory", texts, 64, ("--text",)),
        ("a FIFO (no writer)", fifo, 64, ("--text",)),
        ("a symlink to a good text", link, 64, None),
        ("a dangling symlink", dangling, 64, ("--text",)),
        ("a missing file", texts / "missing.txt", 64, ("--text",)),
        ("an unreadable file (mode 000)" + (" [root: readable]" if os.geteuid() == 0 else ""), unreadable, 64,
         None if os.geteuid() == 0 else ("--text",)),
        ("/dev/zero (endless NULs)", Path("/dev/zero"), 64, ("--text",)),
    ]
    for build in ("int4", "int8"):
        for case, path, tokens, refuse in cases:
            label = f"{build}: {case}"
            result: dict = {}
            if path == Path("/dev/zero"):  # NOTE: endless: in a child with a memory limit, never this process
                trial.record(S, label, *_endless_text_case(b[build], path, b["src"]))
                continue

            def run():
                try:
                    result["m"] = cal.calibrate(b[build], path, tokens=tokens, model_source=str(b["src"]),
                                                validate=False)
                except BaseException as ex:  # noqa: BLE001
                    result["e"] = ex

            th = threading.Thread(target=run, daemon=True)
            th.start()
            th.join(120)
            if th.is_alive():
                trial.record(S, label, "hang", "no answer in 120 s")
                if path == fifo:  # let the reader go
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                    os.close(fd)
                    th.join(10)
                continue
            ex = result.get("e")
            if ex is not None:
                if not isinstance(ex, KvExportError):
                    trial.record(S, label, "internal", f"{type(ex).__name__}: {ex}"[:300] + " | " +
                                 "".join(traceback.format_exception(ex)[-2:])[:200])
                elif refuse is None:
                    trial.record(S, label, "message", f"refused a usable text: {ex}")
                else:
                    missing = [n for n in refuse if n not in str(ex)]
                    trial.record(S, label, "message" if missing else "ok",
                                 f"{ex}"[:200] + (f" (lacks {missing})" if missing else ""))
                continue
            m = result["m"]
            from kvexport.exporter.calibrate import calibration_of

            values = _graph_constants(b[build])
            finite = all(np.isfinite(v).all() for v in values)
            if refuse is not None:
                trial.record(S, label, "wrong_output", f"accepted ({calibration_of(m.kv.quantization)['tokens']} "
                                                       f"tokens); should be refused naming {refuse}")
            elif not finite:
                trial.record(S, label, "wrong_output", "non-finite constants written into the graphs")
            else:
                trial.record(S, label, "ok", f"{calibration_of(m.kv.quantization)['tokens']} tokens")

    # a source model whose activations overflow (inf embeddings): NaN / inf constants
    import torch
    from safetensors.torch import load_file, save_file

    poisoned = tmp / "hf-poisoned"
    shutil.rmtree(poisoned, ignore_errors=True)
    shutil.copytree(b["src"], poisoned)
    f = poisoned / "model.safetensors"
    w = load_file(str(f))
    emb = next(k for k in w if k.endswith("embed_tokens.weight"))
    w[emb] = w[emb].clone()
    w[emb][:] = torch.inf  # every hidden state inf: NaN keys (inf * rsqrt(inf) = inf * 0)
    save_file(w, str(f), metadata={"format": "pt"})
    for build in ("int4", "int8"):
        label = f"{build}: a source model whose activations overflow (NaN / inf keys)"
        before = _graph_constants(b[build])
        try:
            cal.calibrate(b[build], texts / "long.txt", tokens=64, model_source=str(poisoned), validate=False)
        except KvExportError as ex:
            unchanged = all(np.array_equal(x, y, equal_nan=True) for x, y in zip(before, _graph_constants(b[build])))
            ok = "--model" in str(ex) or "--text" in str(ex)
            trial.record(S, label, "ok" if ok and unchanged else "message", str(ex)[:200])
            continue
        except Exception as ex:  # noqa: BLE001
            trial.record(S, label, "internal", f"{type(ex).__name__}: {ex}")
            continue
        finite = all(np.isfinite(v).all() for v in _graph_constants(b[build]))
        trial.record(S, label, "wrong_output" if not finite else "ok",
                     "non-finite constants written into the graphs" if not finite else "finite constants")
    unreadable.chmod(0o644)


_ENDLESS = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from kvexport.errors import KvExportError
from kvexport.exporter import calibrate as cal
try:
    cal.calibrate(sys.argv[1], sys.argv[2], tokens=64, model_source=sys.argv[3], validate=False)
except KvExportError as e:
    print("REFUSED", e)
    sys.exit(2)
print("ACCEPTED")
"""


def _endless_text_case(build, path, src) -> tuple[str, str]:
    """calibrate on an endless text (/dev/zero) in a child process limited to 3 GiB and 300 s."""
    p = subprocess.Popen([sys.executable, "-c", _ENDLESS, str(build), str(path), str(src)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return "hang", "no answer in 300 s"
    if p.returncode == 2 and "--text" in out:
        return "ok", out.strip().splitlines()[-1][:200]
    if p.returncode == 2:
        return "message", out.strip().splitlines()[-1][:200]
    if p.returncode == 0:
        return "wrong_output", "accepted an endless text"
    return "internal", f"exit {p.returncode}: {out.strip().splitlines()[-1][:200] if out.strip() else ''}"


def _graph_constants(build) -> list:
    import onnx

    from kvexport import io
    from onnx import numpy_helper

    g = onnx.load(str(Path(build) / io.PREFILL_GRAPH), load_external_data=False)
    return [numpy_helper.to_array(t) for t in g.graph.initializer if t.name.startswith(("kv_scales.", "kv_offsets."))]


# ---- (c) kill -9 during disk-tier writes -----------------------------------------------------------------
_WORKER = r"""
import dataclasses, json, os, sys
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.sampling_params import SamplingParams
build, folder, mode, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
e = LLMEngine(build, EngineConfig(kv_cache_memory="256KiB", threads=1, max_num_batched_tokens=64,
                                  kv_offload_memory=sys.argv[5], kv_offload_dir=folder, kv_offload_disk="64MiB"))
print("STARTED", json.dumps(dataclasses.asdict(e.stats().tiers)), flush=True)
outs = []
for p in prompts:
    rid = e.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    outs.append(list(e.output(rid).token_ids))
    print("DONE", len(outs), flush=True)
print("OUTPUTS", json.dumps(outs), flush=True)
print("STATS", json.dumps(dataclasses.asdict(e.stats().tiers)), flush=True)
if mode == "persist":
    print("PERSIST", flush=True)
    e.close()
    print("CLOSED", flush=True)
"""


def _worker(build, folder, mode, prompts, host="0", wait=True):
    cmd = [sys.executable, "-c", _WORKER, str(build), str(folder), mode, json.dumps(prompts), host]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return p
    out, _ = p.communicate(timeout=300)
    return p.returncode, out


def _parse(out: str, tag: str):
    for line in out.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    return None


def kill9(trial: Trial, b: dict, tmp: Path, kills: int) -> None:
    import random

    S = "kill -9"
    rng = random.Random(0)
    tmp = tmp / "kill9"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # 24 prompts of 3 blocks (48 tokens) + a few tokens: a 16-block pool evicts to the tiers all the time
    prompts = [[1000 + 7 * i + j for j in range(48)] + [5, 6] for i in range(24)]
    rc, out = _worker(b["fp32"], "", "plain", prompts)
    oracle = _parse(out, "OUTPUTS")
    if rc != 0 or oracle is None:
        trial.record(S, "oracle run without tiers", "internal", out[-500:])
        return

    def restart_case(label, folder, host="0", planted=0):
        rc, out = _worker(b["fp32"], folder, "plain", prompts, host)
        started = _parse(out, "STARTED")
        got, stats = _parse(out, "OUTPUTS"), _parse(out, "STATS")
        blocks = folder / "blocks"
        leftovers = [n for n in os.listdir(blocks) if n.startswith(".tmp-")] if blocks.is_dir() else []
        if rc != 0 or started is None:
            trial.record(S, label, "data_loss", f"restart failed (exit {rc}): {out.strip().splitlines()[-1:]}")
        elif got != oracle:
            trial.record(S, label, "wrong_output", "outputs after the restart differ from a run without tiers")
        elif leftovers:
            trial.record(S, label, "wrong_output", f"temporary files left: {leftovers[:3]}")
        elif stats["disk_errors"] < planted:  # NOTE: temp files count at start, damaged blocks when read
            trial.record(S, label, "wrong_output", f"{planted} torn files removed, {stats['disk_errors']} "
                                                   f"counted (stats().tiers.disk_errors)")
        else:
            trial.record(S, label, "ok", f"disk blocks at start {started['disk_blocks']}, disk hits "
                                         f"{stats['disk_hits']}, errors counted {stats['disk_errors']} "
                                         f"({started['disk_errors']} at start)")

    # kill -9 while writes are in flight: when a temporary file shows in blocks/
    for k in range(kills):
        folder = tmp / f"kill-{k}"
        host = "0" if k % 2 == 0 else "128KiB"
        p = _worker(b["fp32"], folder, "plain", prompts, host, wait=False)
        deadline, hit = time.monotonic() + 120, False
        delay = rng.uniform(0.0, 0.02)
        while time.monotonic() < deadline and p.poll() is None:
            blocks = folder / "blocks"
            try:
                if blocks.is_dir() and any(n.startswith(".tmp-") for n in os.listdir(blocks)):
                    time.sleep(delay)
                    hit = True
                    break
            except FileNotFoundError:
                pass
            time.sleep(0.0005)
        p.send_signal(signal.SIGKILL)
        p.wait()
        torn = [n for n in os.listdir(folder / "blocks") if n.startswith(".tmp-")] if (folder / "blocks").is_dir() else []
        restart_case(f"kill -9 during disk writes #{k} ({'host tier + ' if host != '0' else ''}disk; "
                     f"{'a write in flight' if hit else 'no write seen'}; {len(torn)} temp files left)", folder, host,
                     planted=len(torn))

    # torn files a power cut could leave (no fsync): truncated and zero-filled block files, and temp files
    folder = tmp / "torn"
    rc, out = _worker(b["fp32"], folder, "persist", prompts[:8], "128KiB")
    files = sorted((folder / "blocks").glob("*.kvb"))
    if rc != 0 or len(files) < 4:
        trial.record(S, "torn block files after a clean run", "internal", out[-300:])
    else:
        files[0].write_bytes(files[0].read_bytes()[:100])
        files[1].write_bytes(b"\0" * files[1].stat().st_size)
        files[2].write_bytes(b"")
        (folder / "blocks" / ".tmp-999999-1").write_bytes(b"KVXBLK01 half")
        (folder / "blocks" / ".tmp-999999-2").write_bytes(b"")
        restart_case("torn files: truncated, zero-filled, empty block files + 2 temp files", folder, "128KiB",
                     planted=5)

    # kill -9 during the marker's first write: only the lock and a temporary marker file in the folder
    folder = tmp / "marker"
    folder.mkdir()
    (folder / "kvexport-kv-offload.lock").write_text("12345\n")
    (folder / ".tmp-12345-1").write_bytes(b'{"format": "kvexport-kv-off')
    restart_case("kill -9 during the marker's first write (lock + a half temporary marker)", folder)

    # kill -9 during the shutdown persist of the host tier
    for k in range(max(1, kills // 2)):
        folder = tmp / f"persist-{k}"
        p = _worker(b["fp32"], folder, "persist", prompts, "1MiB", wait=False)
        seen = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            line = p.stdout.readline()
            seen += line
            if line.startswith("PERSIST"):
                time.sleep(rng.uniform(0.0, 0.01) * k)
                break
        p.send_signal(signal.SIGKILL)
        p.wait()
        n_files = len(list((folder / "blocks").glob("*.kvb")))
        restart_case(f"kill -9 during the shutdown persist #{k} ({n_files} block files written)", folder)

    # a full persist then a restart keeps what the host tier held: disk hits, the same outputs
    folder = tmp / "persist-full"
    rc, out = _worker(b["fp32"], folder, "persist", prompts, "1MiB")
    rc2, out2 = _worker(b["fp32"], folder, "plain", prompts, "0")
    st, got = _parse(out2, "STATS"), _parse(out2, "OUTPUTS")
    if rc or rc2 or got != oracle:
        trial.record(S, "clean persist then restart", "data_loss", (out + out2)[-300:])
    else:
        trial.record(S, "clean persist then restart", "ok" if st["disk_hits"] > 0 else "data_loss",
                     f"disk hits after the restart {st['disk_hits']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="streaming,calibrate,kill9")
    ap.add_argument("--kills", type=int, default=2, help="kill -9 runs during disk writes (half as many during "
                                                                 "the shutdown persist)")
    ap.add_argument("--quick", action="store_true", help="streaming: only the settings that must be refused")
    ap.add_argument("--workdir", help="keep the builds here and reuse them [a temporary folder]")
    ap.add_argument("--out", default="bench/results/hostile_trial.json")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    trial = Trial()
    with tempfile.TemporaryDirectory(prefix="kvexport-hostile-") as d:
        tmp = Path(a.workdir or d)
        tmp.mkdir(parents=True, exist_ok=True)
        builds = make_builds(tmp)
        sections = a.sections.split(",")
        if "streaming" in sections:
            streaming(trial, builds, a.quick)
        if "calibrate" in sections:
            calibrate_cases(trial, builds, tmp)
        if "kill9" in sections:
            kill9(trial, builds, tmp, a.kills)
    totals = trial.totals()
    print(json.dumps(totals, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"totals": totals, "cases": trial.rows}, indent=1))


if __name__ == "__main__":
    main()
