"""`kvexport` commands that make and examine a build: build, engines (TensorRT), calibrate,
inspect, plan. Each parses its arguments and calls one exporter function."""

from __future__ import annotations

import click
from rich.console import Console
from rich.markup import escape

from kvexport.exporter.limits import WEIGHT_PRECISIONS
from kvexport.recipes import Recipe, load_recipe, shipped_recipes

from .options import SafePath, build_options, build_settings, console, new_path, option_range, rich_progress


@click.command()
@click.argument("model", required=False)
@click.option("--out", type=SafePath(), callback=new_path, help="Build directory (default: build/<model name>).")
@build_options
@click.option("--recipe", help="A recipe YAML file, or a shipped recipe name "
              f"({', '.join(p.stem for p in shipped_recipes())}).")  # recipes/*.yaml, so the list cannot go stale
def build(model, out, recipe, **given):
    """Export a model (HF folder, .gguf file or alias) into a validated build directory."""
    from kvexport.exporter.build import BuildOptions, build as run_build
    from kvexport.exporter.source import DEFAULT_MODEL

    if model is not None and not model.strip():
        raise click.BadParameter("is empty: give a model folder, a .gguf file or an alias (or leave it out for "
                                 f"the default, {DEFAULT_MODEL})", param_hint="MODEL")
    r = load_recipe(recipe) if recipe else Recipe()
    opts = BuildOptions(**(r.options() | build_settings(given)))  # the command line wins over the recipe
    model = model or r.model or DEFAULT_MODEL
    out = out or r.out
    path, manifest = run_build(model, out, opts, progress=rich_progress())
    _print_validation(manifest)
    console.print(f"[bold green]build ready:[/] {escape(str(path))}")


def _print_validation(manifest) -> None:
    """One verdict line per validation check (exporter/validate.py verdicts)."""
    from kvexport.exporter.validate import verdicts

    if manifest.validation is None:
        console.print("[yellow]validation skipped[/]")
    for line in verdicts(manifest):
        console.print(line, style="green" if ": PASS (" in line else "red", markup=False)


@click.command()
@click.argument("build_dir", type=SafePath(exists=True, file_okay=False))
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


@click.command()
@click.argument("build_dir", type=SafePath(exists=True, file_okay=False))
@click.option("--text", type=SafePath(exists=True, dir_okay=False, readable=True),
              help="Calibration text [bundled Shakespeare: Hamlet].")
@click.option("--tokens", type=option_range("calibration_tokens"), default=2048, show_default=True,
              help="Tokens of the text to run.")
@click.option("--model", "model_source", help="Source model [the one recorded in the manifest].")
@click.option("--no-validate", is_flag=True, help="Skip re-validating against transformers.")
def calibrate(build_dir, text, tokens, model_source, no_validate):
    """Recompute a build's calibrated KV constants from a text and rewrite them in place: int8 KV's
    per-channel scales (MLA: the latent's), int4 KV's key transform (offsets and channel scales)."""
    from kvexport.exporter.calibrate import calibrate as run
    from kvexport.exporter.calibrate import describe

    manifest = run(build_dir, text, tokens, model_source, validate=not no_validate, progress=rich_progress())
    console.print(describe(manifest), markup=False)
    _print_validation(manifest)


@click.command()
@click.argument("build_dir", type=SafePath(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True,
              help="Print a machine-readable summary (JSON on stdout) instead of the tables.")
@click.option("--verify", is_flag=True,
              help="First hash the weights file (and TensorRT engines) and compare each with the sha256 the "
                   "manifest records; exit 2 on a mismatch. Reads every byte (about 1.5 s per GiB).")
def inspect(build_dir, as_json, verify):
    """Print a build's manifest: graph I/O, parameters, KV bytes per token, validation, and the
    polygraphy / trtexec command lines for it."""
    from kvexport.cli.inspect import render, summary

    if verify:
        from kvexport.verify import report

        for line in report(build_dir):  # ChecksumError: exit 2 naming the file
            click.echo(line, err=as_json)
    if as_json:
        import json

        click.echo(json.dumps(summary(build_dir), indent=2))
        return
    render(build_dir, Console(soft_wrap=True, emoji=False))


@click.command()
@click.argument("model")
@click.option("--memory", metavar="SIZE",
              help="Memory for weights + KV cache: 24GiB, 80GB, bytes, or 30% of the memory available now.")
@click.option("--weights", type=click.Choice(WEIGHT_PRECISIONS),
              help="Weights the fit subtracts [the build's; fp16 for a model].")
@click.option("--max-model-len", type=click.IntRange(2, option_range("max_seq_len").max),
              help="Tokens per sequence (prompt + output) [the build's max_seq_len; the model's max positions, "
                   "capped at 32768].")
@click.option("--max-num-seqs", type=click.IntRange(min=1),
              help="Also give the longest context each of this many sequences can have.")
@click.option("--block-size", type=option_range("block_size"), help="Tokens per KV block (paged) [the build's; 16].")
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
      max_seqs, max_context, context_limit (memory|model), build}]; notes [text];
      state_bytes_per_seq, linear_layers (hybrids' recurrent state per sequence; 0, 0 otherwise)."""
    from kvexport.exporter.plan import plan as run_plan, render

    p = run_plan(model, memory, weights=weights, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                 block_size=block_size, max_num_batched_tokens=max_num_batched_tokens)
    if as_json:
        import json

        click.echo(json.dumps(p.to_json(), indent=2))
        return
    render(p, Console(soft_wrap=True, emoji=False))


COMMANDS = (build, engines, calibrate, inspect, plan)
