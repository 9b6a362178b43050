"""The `kvexport` command line. Each command parses its arguments and calls one library
function; options beyond a few flags live in recipes."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Iterator

import click
from rich.console import Console

from . import io
from .errors import KvExportError

console = Console(stderr=True, soft_wrap=True)


def _env_defaults() -> None:
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    # kvexport only reads local folders, files and packaged aliases: never the model hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _Cli(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvExportError as e:
            console.print(f"[bold red]error:[/] {e}")
            sys.exit(2)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvexport")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose: bool) -> None:
    """kvexport: Hugging Face causal LMs -> prefill/decode ONNX graphs with explicit KV cache."""
    _env_defaults()
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def engine_options(f):
    """The runtime settings as options, generated from their one definition
    (kvexport/runtime/config.py: EngineConfig's fields, defaults and SETTINGS help), for
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
        with console.status(f"{name}…"):
            yield
        console.print(f"[green]✓[/] {name} [dim]({time.perf_counter() - t:.1f}s)[/]")

    return step


@main.command()
@click.argument("model", required=False)
@click.option("--out", type=click.Path(), help="Build directory (default: build/<model name>).")
@click.option("--layout", type=click.Choice([l.value for l in io.KVLayout]), help="KV-cache layout [paged].")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), help="Weights/activations dtype [fp32].")
@click.option("--attention", type=click.Choice([a.value for a in io.Attention]),
              help="Paged attention: standard ONNX ops, or kvexport::PagedAttention plugin nodes [onnx].")
@click.option("--kv-dtype", type=click.Choice(["fp32", "fp16", "int8"]),
              help="KV-cache dtype [same as --dtype]; int8 uses calibrated per-head scales.")
@click.option("--calibration-text", type=click.Path(exists=True, dir_okay=False),
              help="int8 KV: text to calibrate the scales on [bundled Shakespeare: Hamlet].")
@click.option("--calibration-tokens", type=int, help="int8 KV: tokens of the text to use [2048].")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "onnx"]),
              help="The backend the build is for, as the runtime's --backend: onnxruntime (ONNX graphs), or tensorrt "
                   "(also TensorRT engines; needs --attention plugin, TensorRT and a GPU); onnx = onnxruntime "
                   "[onnxruntime].")
@click.option("--block-size", type=int, help="Tokens per KV block for the paged layout [16].")
@click.option("--max-seq-len", type=int, help="Longest context served [model's max positions, capped at 32768].")
@click.option("--all-logits", is_flag=True, default=None, help="Prefill returns logits for every token (perplexity).")
@click.option("--recipe", help="A recipe YAML file, or a shipped recipe name (llama, mistral, qwen2, phi3, gpt2).")
@click.option("--allow-pickle", is_flag=True, help="Accept pickled *.bin weights (loaded with weights_only=True).")
@click.option("--force", is_flag=True, help="Replace an existing build directory.")
@click.option("--no-validate", is_flag=True, help="Skip the comparison with transformers.")
def build(model, out, layout, dtype, attention, kv_dtype, calibration_text, calibration_tokens, backend, block_size,
          max_seq_len, all_logits, recipe, allow_pickle, force, no_validate):
    """Export a model (HF folder, .gguf file or alias) into a validated build directory."""
    from kvexport.exporter.build import BuildOptions, build as run_build
    from kvexport.exporter.source import DEFAULT_MODEL
    from kvexport.recipes import Recipe, load_recipe

    r = load_recipe(recipe) if recipe else Recipe()
    kw = r.options()
    given = {"layout": layout, "dtype": dtype, "attention": attention, "kv_dtype": kv_dtype,
             "calibration_text": calibration_text, "calibration_tokens": calibration_tokens, "backend": backend,
             "block_size": block_size, "max_seq_len": max_seq_len, "all_logits": all_logits}
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
    console.print(f"[bold green]build ready:[/] {path}")


def _print_validation(manifest) -> None:
    v = manifest.validation
    if v is None:
        console.print("[yellow]validation skipped[/]")
        return
    console.print(f"validation vs transformers: {v.prompts} prompts (lengths {list(v.prompt_lengths)}), "
                  f"{v.steps} decode steps: max |Δ logits| {v.max_abs_diff:.2e} "
                  f"(tolerance {v.tolerance}), greedy tokens identical: "
                  f"{'yes' if v.greedy_identical else 'no'} ({100 * v.token_agreement:.1f}% agree)")
    if (n := v.native_op) is not None:
        console.print(f"  with the native CPU PagedAttention op: max |Δ logits| {n.max_abs_diff:.2e}, greedy tokens "
                      f"identical: {'yes' if n.greedy_identical else 'no'} ({100 * n.token_agreement:.1f}% agree)")


@main.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--max-num-seqs", type=int, default=64, show_default=True, help="Sequences per step, max.")
@click.option("--max-num-batched-tokens", type=int, default=2048, show_default=True, help="Tokens per prefill step, max.")
@click.option("--max-num-blocks", type=int, default=16384, show_default=True, help="KV pool blocks, max.")
@click.option("--max-seq-len", type=int, help="Longest context [the build's].")
def engines(build_dir, max_num_seqs, max_num_batched_tokens, max_num_blocks, max_seq_len):
    """Build TensorRT engines for an existing `--attention plugin` build (needs TensorRT and a GPU)."""
    from kvexport.exporter.tensorrt_build import EngineBuildOptions, add_engines

    m = add_engines(build_dir, EngineBuildOptions(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                                  max_num_blocks=max_num_blocks, max_seq_len=max_seq_len))
    assert m.engines is not None  # add_engines records them
    console.print(f"[bold green]engines ready:[/] {', '.join(e.file for e in m.engines.engines.values())}")


@main.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--text", type=click.Path(exists=True, dir_okay=False),
              help="Calibration text [bundled Shakespeare: Hamlet].")
@click.option("--tokens", type=int, default=2048, show_default=True, help="Tokens of the text to run.")
@click.option("--model", "model_source", help="Source model [the one recorded in the manifest].")
@click.option("--no-validate", is_flag=True, help="Skip re-validating against transformers.")
def calibrate(build_dir, text, tokens, model_source, no_validate):
    """Recompute an int8-KV build's per-head scales from a text and rewrite them in place."""
    from kvexport.exporter.calibrate import calibrate as run

    manifest = run(build_dir, text, tokens, model_source, validate=not no_validate)
    q = manifest.kv.quantization
    console.print(f"scales from {q['calibration']['tokens']} tokens of {q['calibration']['text']} "
                  f"({q['scheme']})")
    _print_validation(manifest)


@main.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
def inspect(build_dir):
    """Print a build's manifest: graph I/O, parameters, KV bytes per token, validation."""
    from kvexport.inspect import render

    render(build_dir, Console(soft_wrap=True))


@main.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("prompts", nargs=-1, required=True)
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--chat", is_flag=True, help="Apply the tokenizer's chat template to each prompt.")
@click.option("--stream", is_flag=True, help="Print tokens as they are generated (first prompt only).")
@engine_options
def generate(build_dir, prompts, max_tokens, temperature, top_p, top_k, seed, stop, chat, stream, **settings):
    """Generate text from a paged build with continuous batching."""
    from kvexport.runtime.llm import LLM
    from kvexport.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop))
    llm = LLM(build_dir, _engine_config(settings))
    out = sys.stdout
    if stream:
        for o in llm.stream(prompts[0], params, chat=chat):
            out.write(o.new_text)
            out.flush()
        out.write("\n")
        return
    for prompt, o in zip(prompts, llm.generate(list(prompts), params, chat=chat)):
        if o.error:
            console.print(f"[red]{prompt!r}: {o.error}[/]")
            continue
        out.write(f"{o.text}\n")
        console.print(f"[dim]({len(o.token_ids)} tokens, finish: {o.finish_reason})[/]")


@main.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--trace", default="mixed-64", show_default=True, help="A shipped trace name or a trace JSON file.")
@click.option("--limit", type=int, help="Serve only the first N requests of the trace.")
@click.option("--json", "json_out", type=click.Path(), help="Also write the figures to this JSON file.")
@click.option("--arrival-rate", type=float, help="Requests/s of a seeded Poisson arrival process [all at t=0].")
@click.option("--prefix-ttft", type=int, metavar="TOKENS",
              help="Also measure TTFT of a request sharing a TOKENS-long prefix, prefix caching on vs off.")
@engine_options
def bench(build_dir, trace, limit, json_out, arrival_rate, prefix_ttft, **settings):
    """Serve a fixed-seed request trace; report tokens/s, TTFT, TPOT, KV use, preemptions."""
    import json as _json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from kvexport.runtime.bench import prefix_ttft as run_prefix_ttft
    from kvexport.runtime.bench import run_bench

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


@main.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes the server).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--served-model-name", help="The model name clients must send [the build directory's name].")
@engine_options
def serve(build_dir, host, port, served_model_name, **settings):
    """Serve a paged build over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from kvexport.runtime.server import serve as run_server

    cfg = _engine_config(settings)
    console.print(f"serving {build_dir} on http://{host}:{port}/v1")
    run_server(build_dir, host, port, cfg, served_model_name)


@main.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, type=click.Path(), help="Model repository to write.")
@click.option("--name", help="Triton model name [the build directory's name].")
@click.option("--copy-build/--link-build", default=False, show_default=True,
              help="Copy the build into the repository (self-contained), or point at it by relative path.")
@click.option("--instances", type=int, default=1, show_default=True, help="Model instances (one engine each).")
@click.option("--execution-env", type=click.Path(exists=True),
              help="Python environment that runs the model (EXECUTION_ENV_PATH) [python3 on tritonserver's PATH].")
@click.option("--force", is_flag=True, help="Replace an existing repository.")
@engine_options
def triton(build_dir, out, name, copy_build, instances, execution_env, force, **settings):
    """Write a Triton Inference Server model repository serving a paged build (decoupled, streaming)."""
    from kvexport.runtime.triton_repo import TritonRepoOptions, write_repository

    opts = TritonRepoOptions(engine=_engine_config(settings), name=name, copy_build=copy_build, instances=instances,
                             execution_env=execution_env, force=force)
    model_dir = write_repository(build_dir, out, opts)
    console.print(f"[bold green]Triton model repository ready:[/] {model_dir.parent} (model {model_dir.name!r}); "
                  f"start it with `tritonserver --model-repository={model_dir.parent}` (see docs/DEPLOYMENT.md)")


if __name__ == "__main__":
    main()
