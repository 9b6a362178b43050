"""What every `kvexport` command shares (kvexport/cli/__init__.py and its command modules build.py,
serve.py, deploy.py): the stderr console and its error line, the option types and callbacks
that refuse bad values naming the option, the runtime settings as options (`engine_options`) and
the build options as options (`build_options`), each generated from its one definition.

NOTE: this module imports nothing heavy (no torch, onnx, transformers): `kvexport --help` imports it,
and the commands import what they run inside their bodies.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import time
from pathlib import Path
from typing import Iterator

import click
from rich.console import Console
from rich.markup import escape

from kvexport.exporter import options as build_spec

# NOTE: user text (paths, prompts, error messages) reaches this console only through escape()
# or markup=False; emoji=False keeps ":name:" in a path or prompt as typed
console = Console(stderr=True, soft_wrap=True, emoji=False)


def print_error(message: str) -> None:
    """An error line on stderr; the message is printed literally (never read as rich markup)."""
    console.print(f"[bold red]error:[/] {escape(message)}")


def clip(text: str, limit: int = 60) -> str:
    """`text` cut to `limit` characters (a 54 KB prompt is not echoed back in an error)."""
    return text if len(text) <= limit else f"{text[:limit - 1]}… ({len(text)} characters)"


def quote(text: str, limit: int = 50) -> str:
    """`text` quoted as Python would, its first `limit` characters only: 'word word…' (54000 characters)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}… ({len(text)} characters)"


def engine_options(f):
    """The runtime settings as options, generated from their one definition (runtime/config.py
    EngineConfig: each field's flag, type or choices, default and help), for every command that
    runs an engine. Values are checked by EngineConfig itself (its messages name the setting)."""
    from dataclasses import fields

    from kvexport.option_spec import spec_of
    from kvexport.runtime.config import EngineConfig, flag, value_type

    opts = []
    for fld in fields(EngineConfig):
        spec, default, t = spec_of(fld), fld.default, value_type(fld)
        if t is bool:
            opts.append(click.option(flag(fld), fld.name, default=default, show_default=True, help=spec.help))
        elif t is tuple:  # comma-separated integers
            opts.append(click.option(flag(fld), fld.name, default=",".join(map(str, default)), callback=_int_list,
                                     help=spec.help))
        else:
            typ = click.Choice(spec.choices) if spec.choices else t if t in (int, float) else str
            opts.append(click.option(flag(fld), fld.name, type=typ, default=default, show_default=default is not None,
                                     help=spec.help))
    for o in reversed(opts):
        f = o(f)
    return f


def _int_list(ctx, param, value: str) -> tuple[int, ...]:
    """A click callback: "1,2,4" -> (1, 2, 4)."""
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated integers, e.g. 1,2,4,8", param=param) from None


def engine_config(settings: dict):
    """Pop the engine_options() values out of a command's keyword arguments."""
    from dataclasses import fields

    from kvexport.runtime.config import EngineConfig

    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: settings.pop(k) for k in list(settings) if k in names})


def rich_progress():
    """A progress callback for build(): one spinner line per step, with its duration."""

    @contextlib.contextmanager
    def step(name: str) -> Iterator[None]:
        t = time.perf_counter()
        with console.status(f"{escape(name)}…"):
            yield
        console.print(f"[green]✓[/] {escape(name)} [dim]({time.perf_counter() - t:.1f}s)[/]")

    return step


def finite(ctx, param, value: float | None) -> float | None:
    """A click callback: click's float types take "nan" and "inf"; options here never do."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", param=param)
    return value


class SafePath(click.Path):
    """click.Path, refusing by name what os.stat would raise on: a NUL character, text that is
    no file name (lone surrogates: never from argv, whose bytes always encode back)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and "\0" in value:
            self.fail(f"{quote(value)} contains a NUL character", param, ctx)
        try:
            os.fsencode(value)
        except UnicodeEncodeError:
            self.fail(f"{ascii(value)} cannot be a file name", param, ctx)
        return super().convert(value, param, ctx)


def option_range(name: str) -> click.IntRange:
    """The click type of a numeric build option: its range from exporter/options.py BuildOptions."""
    lo, hi = build_spec.range_of(name)
    return click.IntRange(lo, hi)


def build_options(f):
    """The build options as options, generated from their one definition (exporter/options.py
    BuildOptions: each field's flag, choices or range and help, its default in the help). A
    boolean is a flag that turns it from its default (--force, --no-validate); every option is
    None when not given, so a recipe's value stands (`build_settings`)."""
    opts = []
    for fld in build_spec.cli_fields():
        spec, default = build_spec.spec_of(fld), fld.default
        shown = default.value if isinstance(default, enum.Enum) else default
        kw = dict(help=spec.help.replace("{default}", str(shown)))
        if isinstance(default, bool):
            kw.update(is_flag=True, default=None)
        elif spec.path:
            folder = spec.path == "dir"
            kw.update(type=SafePath(exists=True, dir_okay=folder, file_okay=not folder, readable=True))
        elif spec.range is not None:
            kw.update(type=option_range(fld.name))
        elif build_spec.choice_words(fld):
            kw.update(type=click.Choice(build_spec.choice_words(fld)))
        else:  # free text the build checks itself (--hidden-states)
            kw.update(type=click.STRING)
        opts.append(click.option(build_spec.flag(fld), fld.name, **kw))
    for o in reversed(opts):
        f = o(f)
    return f


def build_settings(given: dict) -> dict:
    """The build_options() values given on the command line, typed as BuildOptions takes them
    (a flag given turns its option from the default: --no-validate is validate=False)."""
    fields = {fld.name: fld for fld in build_spec.cli_fields()}
    out = {}
    for name, value in given.items():
        fld = fields[name]
        if isinstance(fld.default, bool):
            if value:  # a flag only ever turns its option from the default
                out[name] = not fld.default
        elif value is not None:
            out[name] = build_spec.from_words(fld, value)
    return out


def new_path(ctx, param, value: str | None) -> str | None:
    """A click callback for a path kvexport creates or replaces (--out, --json): refused here,
    naming the option, when it cannot be made (a NUL, a name too long, a file where a folder
    must be, a folder this process cannot write)."""
    if value is None:
        return None
    if "\0" in value or not value.strip():
        raise click.BadParameter("give a path (not empty, no NUL character)", param=param)
    path = Path(value)
    if any(len(os.fsencode(part)) > 255 for part in path.parts):  # SafePath checked that they encode
        raise click.BadParameter(f"a name in {clip(value)!r} is longer than 255 bytes", param=param)
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise click.BadParameter(f"{parent} is a file, not a folder", param=param)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise click.BadParameter(f"cannot write in {parent} (permission denied)", param=param)
    return value

