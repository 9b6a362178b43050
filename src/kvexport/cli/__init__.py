"""The `kvexport` command line. Each command parses its arguments and calls one library
function; options beyond a few flags live in recipes.

    __init__.py  the group (`main`, the console entry point): logging, the stop signals, exit codes
    __main__.py  `python -m kvexport.cli`
    options.py   what the commands share: the console, option types and callbacks, engine_options
    build.py     build, engines, calibrate, inspect, plan
    inspect.py   `kvexport inspect`'s views of a manifest and the other tools' command lines
    serve.py     generate, bench, serve
    deploy.py    triton, triton-serve, dynamo, dynamo-broker

NOTE: library code (exporter, runtime, the contracts in kvexport/) never imports this package;
the command modules import options, never this module.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import click
from rich.markup import escape

from . import build, deploy, serve
from .options import clip, console, engine_options, print_error
from ..errors import KvExportError

__all__ = ["main", "engine_options", "Terminated"]


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
            print_error(f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
            sys.exit(2)
        except Exception as e:  # a bug: one clear line, the traceback only with -v
            if _received:  # the stop signal, surfaced as another error (ImportError when it cut an import)
                _exit_stopped()
            logging.getLogger(__name__).info("traceback of the internal error", exc_info=True)
            print_error(f"internal error, a bug in kvexport: {type(e).__name__}: {clip(str(e), 300)}\n"
                        f"rerun with -v for the traceback and report it")
            sys.exit(1)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvexport")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose: bool) -> None:
    """kvexport: Hugging Face causal LMs -> prefill/decode ONNX graphs with explicit KV cache."""
    _env_defaults()
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


for _command in (*build.COMMANDS, *serve.COMMANDS, *deploy.COMMANDS):
    main.add_command(_command)

