"""`kvexport` commands that run a build on this machine: generate, bench, serve (the
OpenAI-compatible HTTP server). Each parses its arguments, builds the EngineConfig from
`engine_options`, and calls one runtime function."""

from __future__ import annotations

import sys

import click
from rich.markup import escape

from kvexport.runtime.serving.tool_parsers import TOOL_PARSERS, tool_parser

from .options import SafePath, clip, console, engine_config, engine_options, finite, new_path, print_error, quote
from ..errors import ConfigError, KvExportError


@click.command()
@click.argument("build_dir", type=SafePath(exists=True, file_okay=False))
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
@click.option("--lora", metavar="NAME", default=None,
              help="Run the prompts under the LoRA adapter NAME, one of --lora-modules [the base model].")
@engine_options
def generate(build_dir, prompts, max_tokens, temperature, top_p, top_k, seed, stop, chat, stream, lora, **settings):
    """Generate text from a paged build with continuous batching.

    stdout carries the answers only: one per prompt, each ending in a newline; with several
    prompts each answer is preceded by a header line on stderr ("[2/3] 'prompt…'") and
    followed by a blank line on stdout. A failed request is an error on stderr, and the exit
    code is 2 once the others are answered."""
    from kvexport.manifest import model_source_refusal
    from kvexport.runtime.config import parse_lora_modules
    from kvexport.runtime.llm import LLM
    from kvexport.runtime.sampling_params import SamplingParams

    for i, text in enumerate(prompts + stop):
        if any("\ud800" <= c <= "\udfff" for c in text):  # argv bytes that are not UTF-8
            what = f"prompt {i + 1}" if i < len(prompts) else "--stop"
            raise click.BadParameter(f"{what} is not valid UTF-8 text: {clip(ascii(text))}")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop), lora=lora)
    if (why := model_source_refusal(build_dir, "`kvexport generate BUILD ...`")) is not None:
        raise KvExportError(why)  # NOTE: before LLM(), whose words are for Python callers
    config = engine_config(settings)
    served = list(parse_lora_modules(config.lora_modules)) if config.lora_modules else []
    if lora is not None and lora not in served:  # NOTE: before the build loads; else each prompt would fail alike
        raise click.BadParameter(f"no adapter {lora!r} is given by --lora-modules"
                                 f"{' (' + ', '.join(served) + ')' if served else ''}; add it there as {lora}=PATH",
                                 param_hint="--lora")
    llm = LLM(build_dir, config)
    out, n, failed = sys.stdout, len(prompts), 0

    def header(i: int) -> None:
        if n > 1:
            out.flush()
            console.print(f"[{i + 1}/{n}] {quote(prompts[i])}", style="bold", markup=False)

    def finish(i: int, o) -> None:
        nonlocal failed
        if o.error:
            failed += 1
            print_error(f"prompt {i + 1} ({quote(prompts[i])}): {o.error}")
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


@click.command()
@click.argument("build_dir", type=SafePath(exists=True, file_okay=False))
@click.option("--trace", default="mixed-64", show_default=True, help="A shipped trace name or a trace JSON file.")
@click.option("--limit", type=click.IntRange(min=1), help="Serve only the first N requests of the trace.")
@click.option("--json", "json_out", type=SafePath(dir_okay=False), callback=new_path,
              help="Also write the figures to this JSON file.")
@click.option("--arrival-rate", type=click.FloatRange(min=0, min_open=True, max=1e6), callback=finite,
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
@click.option("--json-schema", "json_schema", type=SafePath(exists=True, dir_okay=False),
              help="Constrain every request's output to this JSON schema file (structured output, as response_format "
                   "json_schema; a request ends where its document does): run the trace with and without it for the "
                   "decode overhead, with a schema whose documents outlast the trace's outputs.")
@engine_options
def bench(build_dir, trace, limit, json_out, arrival_rate, prefix_ttft, chat, chat_pool_conversations, chat_turn2,
          json_schema, **settings):
    """Serve a fixed-seed request trace; report tokens/s, TTFT, TPOT, KV use, preemptions."""
    import json as _json

    if chat and json_schema:
        raise ConfigError("--json-schema applies to a trace, not to --chat; give one of them")
    if chat:
        return _chat_bench(build_dir, chat, chat_pool_conversations, json_out, engine_config(settings), chat_turn2)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from kvexport.runtime.serving.bench import prefix_ttft as run_prefix_ttft
    from kvexport.runtime.serving.bench import run_bench

    cfg = engine_config(settings)
    schema_text = None
    if json_schema:
        schema_text = _read_schema(json_schema)
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("output tokens", total=None)
        result = run_bench(build_dir, cfg, trace, limit,
                           progress=lambda done, total: bar.update(task, completed=done, total=total),
                           arrival_rate=arrival_rate, json_schema=schema_text)
    if prefix_ttft:
        result["prefix_ttft"] = run_prefix_ttft(build_dir, cfg, prefix_len=prefix_ttft)
    text = _json.dumps(result, indent=2)
    click.echo(text)
    if json_out:
        with open(json_out, "w") as f:
            f.write(text + "\n")
    if errors := result["errors"]:  # the figures are printed; the run still failed
        print_error(f"{len(errors)} of {result['requests']} requests failed, e.g.: {errors[0]}")
        sys.exit(2)


def _read_schema(path) -> str:
    """The text of `kvexport bench --json-schema FILE`: a JSON document (ConfigError naming the option
    otherwise; whether xgrammar takes it is checked when it compiles)."""
    import json as _json

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 22)
        _json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--json-schema {path}: not a readable JSON schema file ({e}); give a JSON file") from None
    return text


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


@click.command()
@click.argument("build_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes the server).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: any free port.")
@click.option("--served-model-name", help="The model name clients must send [the build directory's name].")
@click.option("--shutdown-grace", type=click.FloatRange(min=0), default=10.0, show_default=True, metavar="SECONDS",
              help="On SIGTERM/SIGINT, how long running requests may take to finish before they are ended (503).")
@click.option("--api-keys", envvar="KVEXPORT_API_KEYS", metavar="FILE",
              help="Require `Authorization: Bearer KEY`: a file of `KEY TENANT` lines; each tenant's prefix cache "
                   "is its own [$KVEXPORT_API_KEYS; none: no keys, one shared cache].")
@click.option("--cache-salt-key", envvar="KVEXPORT_CACHE_SALT_KEY", metavar="FILE",
              help="Take only cache_salts a gateway signed with a key in FILE, and refuse requests without one "
                   "(tenants behind a gateway; docs/DEPLOYMENT.md) [$KVEXPORT_CACHE_SALT_KEY; none: salts as sent].")
@click.option("--tool-call-parser", metavar="NAME",
              help=f"Read tool calls in this format: {', '.join(sorted(TOOL_PARSERS))} [the one the chat template "
                   f"tells].")
@click.option("--allow-runtime-lora", is_flag=True,
              help="Take vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (a client names a PEFT folder "
                   "on this machine; not with --api-keys); the build needs --lora-max-rank.")
@engine_options
def serve(build_dir, host, port, served_model_name, shutdown_grace, api_keys, cache_salt_key, tool_call_parser,
          allow_runtime_lora, **settings):
    """Serve a paged build over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from kvexport.runtime.serving.auth import ApiKeys
    from kvexport.runtime.serving.cache_salts import SaltKey
    from kvexport.runtime.serving.server import serve as run_server

    cfg = engine_config(settings)
    keys = ApiKeys.load(api_keys) if api_keys else None  # before the port and the model: a bad file fails at once
    salt_key = SaltKey.load(cache_salt_key) if cache_salt_key else None  # likewise
    if tool_call_parser is not None:
        tool_parser(tool_call_parser)  # likewise: an unknown name fails naming the registered ones
    if allow_runtime_lora and keys is not None:
        raise click.BadParameter("not with --api-keys: every key holder could load adapters from this machine's disk "
                                 "(keys have no admin role yet); serve adapters with --lora-modules",
                                 param_hint="--allow-runtime-lora")
    guard = f" ({len(keys.tenants)} tenant(s) with API keys)" if keys else ""
    guard += " (cache_salts: gateway-signed only)" if salt_key else ""
    run_server(build_dir, host, port, cfg, served_model_name, shutdown_grace=shutdown_grace, api_keys=keys,
               salt_key=salt_key, tool_call_parser=tool_call_parser, allow_runtime_lora=allow_runtime_lora,
               on_ready=lambda url: console.print(f"serving {escape(str(build_dir))} on {escape(url)}/v1{guard}",
                                                  highlight=False))


COMMANDS = (generate, bench, serve)
