"""Every command that runs an engine offers the runtime settings generated from their one
declaration (runtime/config.py `EngineConfig`, issue 43 §1): each setting's flag is listed exactly
once in its --help, with its help text and its default, as the declaration gives them."""

from dataclasses import fields

import click
import pytest
from click.testing import CliRunner

from kvexport.cli import main
from kvexport.option_spec import spec_of
from kvexport.runtime.config import EngineConfig, flag, value_type

COMMANDS = ("generate", "bench", "serve", "triton", "dynamo")  # every command with engine_options


def _shown_default(f) -> str | None:
    """The [default: ...] click prints for the setting's option (None: none printed)."""
    if value_type(f) is bool:  # the flag's name for True, --no-... for False
        return flag(f).split("/")[0 if f.default else 1].removeprefix("--")
    if value_type(f) is tuple:
        return None  # comma-separated integers, empty by default
    return None if f.default is None else '""' if f.default == "" else str(f.default)


def _entries(help_text: str) -> list[str]:
    """The Options section's entries, one string each (an option's lines joined, spaces collapsed)."""
    entries: list[str] = []
    for line in help_text.split("Options:", 1)[1].splitlines():
        if line.startswith("  -"):
            entries.append(line)
        elif entries and line.strip():
            entries[-1] += " " + line
    return [" ".join(e.split()) for e in entries]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_every_setting_once_with_its_default(command):
    r = CliRunner().invoke(main, [command, "--help"], terminal_width=10_000)  # help text unwrapped
    assert r.exit_code == 0, r.output
    entries = _entries(r.output)
    for f in fields(EngineConfig):
        named = [e for e in entries if e.startswith(flag(f).replace("/", " / ") + " ")]  # --a / --no-a for booleans
        assert len(named) == 1, (command, flag(f), named)
        line = named[0]
        assert " ".join(spec_of(f).help.split()) in line, (command, f.name)
        shown = _shown_default(f)
        if shown is not None:
            assert line.endswith(f"[default: {shown}]"), (command, f.name, line)
        else:
            assert "[default:" not in line, (command, f.name, line)


@pytest.mark.parametrize("command", COMMANDS)
def test_options_are_the_declaration(command):
    """Name, flags, default and type of each option come from the field's declaration."""
    params = {p.name: p for p in main.commands[command].params}
    for f in fields(EngineConfig):
        p, spec, t = params[f.name], spec_of(f), value_type(f)
        assert "/".join(p.opts + p.secondary_opts) == flag(f)
        assert p.default == (",".join(map(str, f.default)) if t is tuple else f.default)
        if spec.choices:
            assert isinstance(p.type, click.Choice) and tuple(p.type.choices) == spec.choices
        elif t in (int, float):
            assert p.type == click.INT if t is int else p.type == click.FLOAT


def test_every_setting_is_declared_with_help_and_group():
    for f in fields(EngineConfig):
        spec = spec_of(f)
        assert spec.help and spec.group, f.name
        assert value_type(f) in (int, float, bool, str, tuple), f.name
