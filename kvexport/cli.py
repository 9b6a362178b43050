"""The `kvexport` command line. Each command parses its arguments and calls one library
function; options beyond a few flags live in recipes."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import click
from rich.console import Console
from rich.markup import escape

from kvexport.exporter.limits import (BACKENDS, DTYPES, KV_DTYPES, QUANT_METHODS, RANGES, WEIGHT_BLOCK_SIZES,
                                      WEIGHT_PRECISIONS)

from . import io
from .errors import KvExportError
from .manifest_weights import WEIGHT_MATMUL_ACCURACY

# NOTE: user text (paths, prompts, error messages) reaches this console only through escape()
# or markup=False; emoji=False keeps ":name:" in a path or prompt as typed
console = Console(stderr=True, soft_wrap=True, emoji=False)


def _env_defaults() -> None:
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    # kvexport only reads local folders, files and packaged aliases: never the model hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the CLI gets SIGTERM (`kill`, `docker stop`), so what
    runs on Ctrl-C runs on it too: e.g. a build's temporary folder is removed."""


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the stop signal this CLI run got, if any


def _on_stop_signal(signum, frame) -> None:
    # NOTE: only the first signal raises; later ones (a second Ctrl-C, a repeated SIGTERM) are
    # ignored, so they cannot cut short the cleanup the first one started (SIGKILL still works)
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    _received.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _exit_stopped() -> None:
    """Report a stop signal (exit status 128 + its number, as a shell reports it)."""
    signum = _received[0] if _received else signal.SIGINT
    console.print("[bold red]terminated[/] (SIGTERM)" if signum == signal.SIGTERM else
                  "[bold red]interrupted[/] (Ctrl-C)")
    sys.exit(128 + signum)


class _Cli(click.Group):
    def main(self, *args, **kwargs):
        # NOTE: only for the CLI's lifetime, and only from the main thread (signal.signal's rule)
        if threading.current_thread() is not threading.main_thread():
            return super().main(*args, **kwargs)
        _received.clear()
        previous = {s: signal.signal(s, _on_stop_signal) for s in _STOP_SIGNALS}
        try:
            return super().main(*args, **kwargs)
        finally:
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvExportError as e:
            console.print(f"[bold red]error:[/] {escape(str(e))}")
            sys.exit(2)
        except KeyboardInterrupt:  # and Terminated
            _exit_stopped()
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # click reports these itself (usage errors exit 2)
        except OSError as e:  # the environment, not kvexport: a path it cannot write, a full disk
            if _received:  # the stop signal, surfaced as another error
                _exit_stopped()
            _error(f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
            sys.exit(2)
        except Exception as e:  # a bug: one clear line, the traceback only with -v
            if _received:  # the stop signal, surfaced as another error (ImportError when it cut an import)
                _exit_stopped()
            logging.getLogger(__name__).info("traceback of the internal error", exc_info=True)
            _error(f"internal error, a bug in kvexport: {type(e).__name__}: {_clip(str(e), 300)}\n"
                   f"rerun with -v for the traceback and report it")
            sys.exit(1)


def _error(message: str) -> None:
    """An error line on stderr; the message is printed literally (never read as rich markup)."""
    console.print(f"[bold red]error:[/] {escape(message)}")


def _clip(text: str, limit: int = 60) -> str:
    """`text` cut to `limit` characters (a 54 KB prompt is not echoed back in an error)."""
    return text if len(text) <= limit else f"{text[:limit - 1]}… ({len(text)} characters)"


def _quote(text: str, limit: int = 50) -> str:
    """`text` quoted as Python would, its first `limit` characters only: 'word word…' (54000 characters)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}… ({len(text)} characters)"


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvexport")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose: bool) -> None:
    """kvexport: Hugging Face causal LMs -> prefill/decode ONNX graphs with explicit KV cache."""
    _env_defaults()
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def engine_options(f):
    """The runtime settings as options, generated from their one definition
    (kvexport.runtime.config, runtime/config.py: EngineConfig's fields, defaults and SETTINGS help), for
    every command that runs an engine. Values are checked by EngineConfig itself."""
    from dataclasses import fields

    from kvexport.runtime.config import CHOICES, SETTINGS, EngineConfig

    d = EngineConfig()
    opts = []
    for fld in fields(EngineConfig):
        flag, default = "--" + fld.name.replace("_", "-"), getattr(d, fld.name)
        if isinstance(default, bool):
            name = fld.name.removeprefix("enable_").replace("_", "-")
            opts.append(click.option(f"--{name}/--no-{name}", fld.name, default=default, show_default=True,
                                     help=SETTINGS[fld.name]))
        elif isinstance(default, tuple):  # comma-separated integers
            opts.append(click.option(flag, fld.name, default=",".join(map(str, default)), callback=_int_list,
                                     help=SETTINGS[fld.name]))
        else:
            typ = click.Choice(CHOICES[fld.name]) if fld.name in CHOICES else (str if isinstance(default, str) else int)
            opts.append(click.option(flag, fld.name, type=typ, default=default, show_default=default is not None,
                                     help=SETTINGS[fld.name]))
    for o in reversed(opts):
        f = o(f)
    return f


def _int_list(ctx, param, value: str) -> tuple[int, ...]:
    """A click callback: "1,2,4" -> (1, 2, 4)."""
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated integers, e.g. 1,2,4,8", param=param) from None


def _engine_config(settings: dict):
    """Pop the engine_options() values out of a command's keyword arguments."""
    from dataclasses import fields

    from kvexport.runtime.config import EngineConfig

    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: settings.pop(k) for k in list(settings) if k in names})


def _rich_progress():
    """A progress callback for build(): one spinner line per step, with its duration."""

    @contextlib.contextmanager
    def step(name: str) -> Iterator[None]:
        t = time.perf_counter()
        with console.status(f"{escape(name)}…"):
            yield
        console.print(f"[green]✓[/] {escape(name)} [dim]({time.perf_counter() - t:.1f}s)[/]")

    return step


def _finite(ctx, param, value: float | None) -> float | None:
    """A click callback: click's float types take "nan" and "inf"; options here never do."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", param=param)
    return value


class _Path(click.Path):
    """click.Path, refusing by name what os.stat would raise on: a NUL character, text that is
    no file name (lone surrogates: never from argv, whose bytes always encode back)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and "\0" in value:
            self.fail(f"{_quote(value)} contains a NUL character", param, ctx)
        try:
            os.fsencode(value)
        except UnicodeEncodeError:
            self.fail(f"{ascii(value)} cannot be a file name", param, ctx)
        return super().convert(value, param, ctx)


def _range(name: str) -> click.IntRange:
    """The click type of a numeric build option: its range from exporter/limits.py."""
    lo, hi = RANGES[name]
    return click.IntRange(lo, hi)


def _new_path(ctx, param, value: str | None) -> str | None:
    """A click callback for a path kvexport creates or replaces (--out, --json): refused here,
    naming the option, when it cannot be made (a NUL, a name too long, a file where a folder
    must be, a folder this process cannot write)."""
    if value is None:
        return None
    if "\0" in value or not value.strip():
        raise click.BadParameter("give a path (not empty, no NUL character)", param=param)
    path = Path(value)
    if any(len(os.fsencode(part)) > 255 for part in path.parts):  # _Path checked that they encode
        raise click.BadParameter(f"a name in {_clip(value)!r} is longer than 255 bytes", param=param)
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise click.BadParameter(f"{parent} is a file, not a folder", param=param)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise click.BadParameter(f"cannot write in {parent} (permission denied)", param=param)
    return value


@main.command()
@click.argument("model", required=False)
@click.option("--out", type=_Path(), callback=_new_path, help="Build directory (default: build/<model name>).")
@click.option("--layout", type=click.Choice([l.value for l in io.KVLayout]), help="KV-cache layout [paged].")
@click.option("--dtype", type=click.Choice([d.value for d in DTYPES]), help="Weights/activations dtype [fp32].")
@click.option("--attention", type=click.Choice([a.value for a in io.Attention]),
              help="Paged attention: kvexport::PagedAttention plugin nodes (served fastest: the native CPU op, "
                   "TensorRT), or standard ONNX ops for tools without kvexport's op [plugin; onnx for contiguous "
                   "builds, or with a warning when the native CPU op is not built].")
@click.option("--kv-dtype", type=click.Choice([d.value for d in KV_DTYPES]),
              help="KV-cache dtype [same as --dtype]; int8 uses calibrated per-channel scales.")
@click.option("--calibration-text", type=_Path(exists=True, dir_okay=False, readable=True),
              help="int8 KV: text to calibrate the scales on (int4: the key offsets) [bundled Shakespeare: Hamlet].")
@click.option("--calibration-tokens", type=_range("calibration_tokens"),
              help="int8 / int4 KV: tokens of the text to use [2048].")
@click.option("--backend", type=click.Choice([*BACKENDS, "onnx"]),
              help="The backend the build is for, as the runtime's --backend: onnxruntime (ONNX graphs), or tensorrt "
                   "(also TensorRT engines; needs --attention plugin, TensorRT and a GPU); onnx = onnxruntime "
                   "[onnxruntime].")
@click.option("--block-size", type=_range("block_size"), help="Tokens per KV block for the paged layout [16].")
@click.option("--max-seq-len", type=_range("max_seq_len"),
              help="Longest context served [model's max positions, capped at 32768].")
@click.option("--all-logits", is_flag=True, default=None, help="Prefill returns logits for every token (perplexity).")
@click.option("--recipe", help="A recipe YAML file, or a shipped recipe name (llama, mistral, qwen2, phi3, gpt2).")
@click.option("--allow-pickle", is_flag=True, help="Accept pickled *.bin weights (loaded with weights_only=True).")
@click.option("--force", is_flag=True, help="Replace an earlier kvexport build at --out (never anything else).")
@click.option("--no-validate", is_flag=True, help="Skip the comparison with transformers.")
@click.option("--weights", type=click.Choice(WEIGHT_PRECISIONS),
              help="Matmul weights: fp32/fp16, or int8/int4 QDQ in the fast CPU forms unless told otherwise "
                   "(docs/QUANTIZATION.md) [--dtype].")
@click.option("--weight-block-size", type=click.Choice([str(b) if b else "channel" for b in WEIGHT_BLOCK_SIZES]),
              help="int8/int4 weights: input rows per scale, or one scale per output channel (int8 runs as "
                   "int8 x int8 GEMMs with per-token activation scales) [int8: channel with smoothquant, or 32 "
                   "with another --quant-method (32: exact, GGUF Q8_0 blocks kept); int4: 32].")
@click.option("--quant-method", type=click.Choice(QUANT_METHODS),
              help="int8/int4 from float weights: round-to-nearest, AWQ scales on --calibration-text, or "
                   "smoothquant (scales that also spare the int8 activations: int8 per channel, int4 blocks) "
                   "[int8: smoothquant per channel, rtn in blocks; int4: rtn].")
@click.option("--weight-matmul-accuracy", type=click.Choice(WEIGHT_MATMUL_ACCURACY),
              help="int8/int4: how onnxruntime's CPU serves the weights by default (the manifest records it; "
                   "serving commands' --weight-matmul-accuracy overrides it): auto (int8 pairs, ~exact), int8 "
                   "(fastest), float (exact) [int8 for smoothquant, else auto].")
def build(model, out, layout, dtype, attention, kv_dtype, calibration_text, calibration_tokens, backend, block_size,
          max_seq_len, all_logits, recipe, allow_pickle, force, no_validate, weights, weight_block_size, quant_method,
          weight_matmul_accuracy):
    """Export a model (HF folder, .gguf file or alias) into a validated build directory."""
    from kvexport.exporter.build import BuildOptions, build as run_build
    from kvexport.exporter.source import DEFAULT_MODEL
    from kvexport.recipes import Recipe, load_recipe

    if model is not None and not model.strip():
        raise click.BadParameter("is empty: give a model folder, a .gguf file or an alias (or leave it out for "
                                 f"the default, {DEFAULT_MODEL})", param_hint="MODEL")
    r = load_recipe(recipe) if recipe else Recipe()
    kw = r.options()
    given = {"layout": layout, "dtype": dtype, "attention": attention, "kv_dtype": kv_dtype,
             "calibration_text": calibration_text, "calibration_tokens": calibration_tokens, "backend": backend,
             "block_size": block_size, "max_seq_len": max_seq_len, "all_logits": all_logits, "weights": weights,
             "weight_block_size": None if weight_block_size is None else int(weight_block_size.replace("channel", "0")),
             "quant_method": quant_method, "weight_matmul_accuracy": weight_matmul_accuracy}
    kw.update({k: v for k, v in given.items() if v is not None})
    if no_validate:
        kw["validate"] = False
    if "layout" in kw:
        kw["layout"] = io.KVLayout(kw["layout"])
    if "dtype" in kw:
        kw["dtype"] = io.DType(kw["dtype"])
    if "kv_dtype" in kw:
        kw["kv_dtype"] = io.DType(kw["kv_dtype"])
    if "attention" in kw:
        kw["attention"] = io.Attention(kw["attention"])
    kw["force"] = force or kw.get("force", False)
    opts = BuildOptions(allow_pickle=allow_pickle, **kw)
    model = model or r.model or DEFAULT_MODEL
    out = out or r.out
    path, manifest = run_build(model, out, opts, progress=_rich_progress())
    _print_validation(manifest)
    console.print(f"[bold green]build ready:[/] {escape(str(path))}")


def _print_validation(manifest) -> None:
    """One verdict line per validation check (exporter/validate.py verdicts)."""
    from kvexport.exporter.validate import verdicts

    if manifest.validation is None:
        console.print("[yellow]validation skipped[/]")
    for line in verdicts(manifest):
        console.print(line, style="green" if ": PASS (" in line else "red", markup=False)


@main.command()
@click.argument("build_dir", type=_Path(exists=True, file_okay=False))
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True,
              help="Sequences per step, max.")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Tokens per prefill step, max.")
@click.option("--max-num-blocks", type=click.IntRange(min=2), default=16384, show_default=True,
              help="KV pool blocks, max (block 0 is the pad block).")
@click.option("--max-seq-len", type=click.IntRange(min=1), help="Longest context [the build's].")
def engines(build_dir, max_num_seqs, max_num_batched_tokens, max_num_blocks, max_seq_len):
    """Build TensorRT engines for an existing `--attention plugin` build (needs TensorRT and a GPU)."""
    from kvexport.exporter.tensorrt_build import EngineBuildOptions, add_engines

    m = add_engines(build_dir, EngineBuildOptions(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                                  max_num_blocks=max_num_blocks, max_seq_len=max_seq_len))
    assert m.engines is not None  # add_engines records them
    console.print(f"[bold green]engines ready:[/] {escape(', '.join(e.file for e in m.engines.engines.values()))}")


@main.command()
@click.argument("build_dir", type=_Path(exists=True, file_okay=False))
@click.option("--text", type=_Path(exists=True, dir_okay=False, readable=True),
              help="Calibration text [bundled Shakespeare: Hamlet].")
@click.option("--tokens", type=_range("calibration_tokens"), default=2048, show_default=True,
              help="Tokens of the text to run.")
@click.option("--model", "model_source", help="Source model [the one recorded in the manifest].")
@click.option("--no-validate", is_flag=True, help="Skip re-validating against transformers.")
def calibrate(build_dir, text, tokens, model_source, no_validate):
    """Recompute a build's calibrated KV constants from a text and rewrite them in place: int8 KV's
    per-channel scales (MLA: the latent's), int4 KV's key transform (offsets and channel scales)."""
    from kvexport.exporter.calibrate import calibrate as run
    from kvexport.exporter.calibrate import describe

    manifest = run(build_dir, text, tokens, model_source, validate=not no_validate, progress=_rich_progress())
    console.print(describe(manifest), markup=False)
    _print_validation(manifest)


@main.command()
@click.argument("build_dir", type=_Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True,
              help="Print a machine-readable summary (JSON on stdout) instead of the tables.")
def inspect(build_dir, as_json):
    """Print a build's manifest: graph I/O, parameters, KV bytes per token, validation, and the
    polygraphy / trtexec command lines for it."""
    from kvexport.inspect import render, summary

    if as_json:
        import json

        click.echo(json.dumps(summary(build_dir), indent=2))
        return
    render(build_dir, Console(soft_wrap=True, emoji=False))


@main.command()
@click.argument("model")
@click.option("--memory", metavar="SIZE",
              help="Memory for weights + KV cache: 24GiB, 80GB, bytes, or 30% of the memory available now.")
@click.option("--weights", type=click.Choice(WEIGHT_PRECISIONS),
              help="Weights the fit subtracts [the build's; fp16 for a model].")
@click.option("--max-model-len", type=click.IntRange(2, RANGES["max_seq_len"][1]),
              help="Tokens per sequence (prompt + output) [the build's max_seq_len; the model's max positions, "
                   "capped at 32768].")
@click.option("--max-num-seqs", type=click.IntRange(min=1),
              help="Also give the longest context each of this many sequences can have.")
@click.option("--block-size", type=_range("block_size"), help="Tokens per KV block (paged) [the build's; 16].")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1),
              help="Tokens per engine step: sizes windowed layers' blocks [the engine's default].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (keys below) instead of the tables.")
def plan(model, memory, weights, max_model_len, max_num_seqs, block_size, max_num_batched_tokens, as_json):
    """Will it fit? Weights bytes per precision, KV bytes per token per KV cache group, and, with
    --memory, how many sequences of --max-model-len fit (or the longest context of --max-num-seqs
    sequences) per KV dtype and layout, sized as the engine sizes its pool. MODEL is a build, a HF
    folder (config.json is enough: no weights are read), a config.json, a .gguf file or an alias.

    \b
    --json keys (sizes in bytes, lengths in tokens):
      model, source (build|hf|gguf|alias), family, model_type, num_layers, hidden_size, num_heads,
      num_kv_heads, head_dim, attention (MHA|GQA|MQA), layer_windows [per layer, null = full],
      max_positions;
      weights [{precision, block_size, parameters, bytes, matmul_bytes, table_bytes, float32_bytes}],
      build_weights {precision, bytes, parameters} | null;
      kv [{kv_dtype, bytes_per_token, static_bytes, groups [{group, layers, window, bytes_per_token}]}];
      block_size, max_model_len, max_num_seqs, max_num_batched_tokens, memory_bytes, fit_weights,
      fit_weights_bytes, weights_fit;
      fits [{kv_dtype, layout (paged|contiguous), kv_budget_bytes, num_blocks, local_num_blocks,
      max_seqs, max_context, context_limit (memory|model), build}]; notes [text]."""
    from kvexport.exporter.plan import plan as run_plan, render

    p = run_plan(model, memory, weights=weights, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                 block_size=block_size, max_num_batched_tokens=max_num_batched_tokens)
    if as_json:
        import json

        click.echo(json.dumps(p.to_json(), indent=2))
        return
    render(p, Console(soft_wrap=True, emoji=False))


@main.command()
@click.argument("build_dir", type=_Path(exists=True, file_okay=False))
@click.argument("prompts", nargs=-1, required=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens to generate per prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--chat", is_flag=True, help="Apply the tokenizer's chat template to each prompt.")
@click.option("--stream", is_flag=True, help="Print tokens as they are generated (the prompts one after another).")
@engine_options
def generate(build_dir, prompts, max_tokens, temperature, top_p, top_k, seed, stop, chat, stream, **settings):
    """Generate text from a paged build with continuous batching.

    stdout carries the answers only: one per prompt, each ending in a newline; with several
    prompts each answer is preceded by a header line on stderr ("[2/3] 'prompt…'") and
    followed by a blank line on stdout. A failed request is an error on stderr, and the exit
    code is 2 once the others are answered."""
    from kvexport.manifest import model_source_refusal
    from kvexport.runtime.llm import LLM
    from kvexport.runtime.sampling_params import SamplingParams

    for i, text in enumerate(prompts + stop):
        if any("\ud800" <= c <= "\udfff" for c in text):  # argv bytes that are not UTF-8
            what = f"prompt {i + 1}" if i < len(prompts) else "--stop"
            raise click.BadParameter(f"{what} is not valid UTF-8 text: {_clip(ascii(text))}")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop))
    if (why := model_source_refusal(build_dir, "`kvexport generate BUILD ...`")) is not None:
        raise KvExportError(why)  # NOTE: before LLM(), whose words are for Python callers
    llm = LLM(build_dir, _engine_config(settings))
    out, n, failed = sys.stdout, len(prompts), 0

    def header(i: int) -> None:
        if n > 1:
            out.flush()
            console.print(f"[{i + 1}/{n}] {_quote(prompts[i])}", style="bold", markup=False)

    def finish(i: int, o) -> None:
        nonlocal failed
        if o.error:
            failed += 1
            _error(f"prompt {i + 1} ({_quote(prompts[i])}): {o.error}")
            return
        out.flush()
        console.print(f"[dim]({len(o.token_ids)} tokens, finish: {o.finish_reason})[/]")
        if n > 1 and i < n - 1:
            out.write("\n")

    if stream:
        for i, prompt in enumerate(prompts):
            header(i)
            for o in llm.stream(prompt, params, chat=chat):  # the last output is the finished one
                out.write(o.new_text)
                out.flush()
            if not o.error:
                out.write("\n")
            finish(i, o)
    else:
        for i, o in enumerate(llm.generate(list(prompts), params, chat=chat)):
            header(i)
            if not o.error:
                out.write(f"{o.text}\n")
            finish(i, o)
    if failed:
        sys.exit(2)


@main.command()
@click.argument("build_dir", type=_Path(exists=True, file_okay=False))
@click.option("--trace", default="mixed-64", show_default=True, help="A shipped trace name or a trace JSON file.")
@click.option("--limit", type=click.IntRange(min=1), help="Serve only the first N requests of the trace.")
@click.option("--json", "json_out", type=_Path(dir_okay=False), callback=_new_path,
              help="Also write the figures to this JSON file.")
@click.option("--arrival-rate", type=click.FloatRange(min=0, min_open=True, max=1e6), callback=_finite,
              help="Requests/s of a seeded Poisson arrival process [all at t=0].")
@click.option("--prefix-ttft", type=click.IntRange(min=1), metavar="TOKENS",
              help="Also measure TTFT of a request sharing a TOKENS-long prefix, prefix caching on vs off.")
@click.option("--chat", metavar="NxTxS",
              help="Instead of the trace: N interleaved conversations x T turns sharing an S-token system prompt, "
                   "run with KV offload off / host / host+disk / after a restart (docs/BENCHMARKS.md).")
@click.option("--chat-pool-conversations", type=click.IntRange(min=1), default=4, show_default=True,
              help="--chat: the KV pool (and max_num_seqs) holds about this many whole conversations.")
@click.option("--chat-turn2", is_flag=True,
              help="--chat: measure only a lone turn 2 after its blocks were evicted (median TTFT of 3), per mode.")
@engine_options
def bench(build_dir, trace, limit, json_out, arrival_rate, prefix_ttft, chat, chat_pool_conversations, chat_turn2,
          **settings):
    """Serve a fixed-seed request trace; report tokens/s, TTFT, TPOT, KV use, preemptions."""
    import json as _json

    if chat:
        return _chat_bench(build_dir, chat, chat_pool_conversations, json_out, _engine_config(settings), chat_turn2)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from kvexport.runtime.serving.bench import prefix_ttft as run_prefix_ttft
    from kvexport.runtime.serving.bench import run_bench

    cfg = _engine_config(settings)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("output tokens", total=None)
        result = run_bench(build_dir, cfg, trace, limit,
                           progress=lambda done, total: bar.update(task, completed=done, total=total),
                           arrival_rate=arrival_rate)
    if prefix_ttft:
        result["prefix_ttft"] = run_prefix_ttft(build_dir, cfg, prefix_len=prefix_ttft)
    text = _json.dumps(result, indent=2)
    click.echo(text)
    if json_out:
        with open(json_out, "w") as f:
            f.write(text + "\n")
    if errors := result["errors"]:  # the figures are printed; the run still failed
        _error(f"{len(errors)} of {result['requests']} requests failed, e.g.: {errors[0]}")
        sys.exit(2)


def _chat_bench(build_dir, chat: str, pool_conversations: int, json_out, cfg, turn2: bool = False) -> None:
    """`bench --chat`: the multi-turn benchmark of the KV tiers (runtime/serving/chat_bench.py)."""
    import json as _json

    from kvexport.runtime.serving.chat_bench import ChatShape, markdown, run_chat, turn2_ttft

    shape = ChatShape.parse(chat, pool_conversations=pool_conversations)
    if turn2:
        text = _json.dumps(turn2_ttft(build_dir, cfg, shape), indent=2)
        click.echo(text)
        if json_out:
            with open(json_out, "w") as f:
                f.write(text + "\n")
        return
    with console.status("chat bench") as status:
        result = run_chat(build_dir, cfg, shape,
                          progress=lambda mode, done, total: status.update(f"chat bench: {mode} {done}/{total} turns"))
    text = _json.dumps(result, indent=2)
    click.echo(text)
    click.echo(markdown(result))
    if json_out:
        with open(json_out, "w") as f:
            f.write(text + "\n")


@main.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes the server).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: any free port.")
@click.option("--served-model-name", help="The model name clients must send [the build directory's name].")
@click.option("--shutdown-grace", type=click.FloatRange(min=0), default=10.0, show_default=True, metavar="SECONDS",
              help="On SIGTERM/SIGINT, how long running requests may take to finish before they are ended (503).")
@click.option("--api-keys", envvar="KVEXPORT_API_KEYS", metavar="FILE",
              help="Require `Authorization: Bearer KEY`: a file of `KEY TENANT` lines; each tenant's prefix cache "
                   "is its own [$KVEXPORT_API_KEYS; none: no keys, one shared cache].")
@engine_options
def serve(build_dir, host, port, served_model_name, shutdown_grace, api_keys, **settings):
    """Serve a paged build over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from kvexport.runtime.serving.auth import ApiKeys
    from kvexport.runtime.serving.server import serve as run_server

    cfg = _engine_config(settings)
    keys = ApiKeys.load(api_keys) if api_keys else None  # before the port and the model: a bad file fails at once
    guard = f" ({len(keys.tenants)} tenant(s) with API keys)" if keys else ""
    run_server(build_dir, host, port, cfg, served_model_name, shutdown_grace=shutdown_grace, api_keys=keys,
               on_ready=lambda url: console.print(f"serving {escape(str(build_dir))} on {escape(url)}/v1{guard}",
                                                  highlight=False))


@main.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, type=click.Path(), help="Model repository to write.")
@click.option("--name", help="Triton model name [the build directory's name].")
@click.option("--copy-build/--link-build", default=False, show_default=True,
              help="Copy the build into the repository (self-contained), or point at it by relative path.")
@click.option("--instances", type=int, default=1, show_default=True, help="Model instances (one engine each).")
@click.option("--execution-env", type=click.Path(exists=True),
              help="Python environment that runs the model (EXECUTION_ENV_PATH) [python3 on tritonserver's PATH].")
@click.option("--force", is_flag=True,
              help="Replace a Triton repository kvexport wrote earlier at --out (never anything else).")
@engine_options
def triton(build_dir, out, name, copy_build, instances, execution_env, force, **settings):
    """Write a Triton Inference Server model repository serving a paged build (decoupled, streaming)."""
    from kvexport.runtime.serving.triton_repo import TritonRepoOptions, write_repository

    opts = TritonRepoOptions(engine=_engine_config(settings), name=name, copy_build=copy_build, instances=instances,
                             execution_env=execution_env, force=force)
    model_dir = write_repository(build_dir, out, opts)
    repo = escape(str(model_dir.parent))
    console.print(f"[bold green]Triton model repository ready:[/] {repo} (model {model_dir.name!r}); "
                  f"start it with `kvexport triton-serve {repo}` (or tritonserver --model-repository={repo}: "
                  f"see docs/DEPLOYMENT.md)")


@main.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--mode", type=click.Choice(["agg", "prefill", "decode"]), default="agg", show_default=True,
              help="Disaggregation role: agg (prompt and generation here), prefill (prompt and first token; KV "
                   "handed to a decode worker), decode (pulls the KV, generates). docs/DEPLOYMENT.md.")
@click.option("--namespace", default="kvexport", show_default=True, envvar="DYN_NAMESPACE",
              help="Dynamo namespace (the frontend's --namespace) [$DYN_NAMESPACE: Dynamo's Kubernetes operator sets it].")
@click.option("--component", help="Dynamo component name of the workers [prefill for --mode prefill, else backend].")
@click.option("--endpoint", default="generate", show_default=True, help="Dynamo endpoint name.")
@click.option("--served-model-name", help="The model name clients must send [the build directory's name].")
@click.option("--discovery-backend", type=click.Choice(["etcd", "file", "kubernetes", "mem"]),
              help="How workers and frontend find each other [$DYN_DISCOVERY_BACKEND, else etcd; file: "
                   "$DYN_FILE_KV, one machine].")
@click.option("--request-plane", type=click.Choice(["tcp", "nats"]), help="Request transport [$DYN_REQUEST_PLANE, else tcp].")
@click.option("--kv-transfer", type=click.Choice(["nixl", "request-plane"]), default="nixl", show_default=True,
              help="How prefill workers hand KV blocks to decode workers: NIXL (UCX), or inside the response.")
@click.option("--kv-transfer-timeout", type=click.FloatRange(0, 3600, min_open=True), default=60.0,
              show_default=True, help="Seconds a prefill worker keeps a request's KV for its decode worker.")
@engine_options
def dynamo(build_dir, mode, namespace, component, endpoint, served_model_name, discovery_backend, request_plane,
           kv_transfer, kv_transfer_timeout, **settings):
    """Serve a paged build as an NVIDIA Dynamo worker (behind `python -m dynamo.frontend`; KV-aware routing)."""
    from kvexport.runtime.serving.dynamo_worker import DynamoWorkerOptions, serve_dynamo

    opts = DynamoWorkerOptions(engine=_engine_config(settings), mode=mode, namespace=namespace, component=component,
                               endpoint=endpoint, served_model_name=served_model_name,
                               discovery_backend=discovery_backend, request_plane=request_plane,
                               kv_transfer=kv_transfer, kv_transfer_timeout_s=kv_transfer_timeout)
    serve_dynamo(build_dir, opts, on_ready=lambda name, path: console.print(
        f"dynamo worker: model {escape(repr(name))} on {escape(path)}", highlight=False))


@main.command("triton-serve")
@click.argument("repo", type=click.Path(exists=True, file_okay=False))
@click.option("--triton-env", type=click.Path(exists=True, file_okay=False),
              help="Python environment with nvidia-pytriton's tritonserver [$KVEXPORT_TRITON_ENV, this environment, "
                   "./.venv-triton, then `tritonserver` on PATH].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address of all three endpoints.")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option("--shutdown-grace", type=click.FloatRange(min=0), default=10.0, show_default=True, metavar="SECONDS",
              help="On SIGTERM/SIGINT, how long open requests may take to finish before they get an error.")
def triton_serve(repo, triton_env, host, http_port, grpc_port, metrics_port, shutdown_grace):
    """Run a repository written by `kvexport triton` on the local tritonserver, until SIGTERM/Ctrl-C."""
    from kvexport.runtime.serving.triton_local import Ports, serve_repository

    def ready(url: str) -> None:
        console.print(f"Triton serving {escape(str(repo))} on {escape(url)} (gRPC {escape(host)}:{grpc_port}, "
                      f"metrics {escape(host)}:{metrics_port}); Ctrl-C stops it", highlight=False)

    code = serve_repository(repo, triton_env, host, Ports(http_port, grpc_port, metrics_port), shutdown_grace,
                            on_ready=ready)
    console.print(f"tritonserver exited with code {code}", highlight=False)
    sys.exit(code)


if __name__ == "__main__":
    main()
