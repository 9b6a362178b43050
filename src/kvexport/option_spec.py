"""`Option`: how one field of an options dataclass is offered and checked — the one spec shared by
the build options (exporter/options.py `BuildOptions`) and the runtime settings (runtime/config.py
`EngineConfig`). Each declares its fields with `option(default, help, **spec)`; the command-line
flags, the recipe schema / Triton parameters and the per-field checks are generated from these
specs by their owners. Light to import (no torch, no onnx): `kvexport --help` reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Option:
    """How one options field is offered and checked."""

    help: str | None = None  # the CLI help ("{default}": the field's default); None: not a CLI flag
    choices: tuple = ()  # the values it may take (enum members for enum fields); (): any of its type
    # bounds of a numeric option, ints or floats (inclusive unless `open`); an upper bound None: none
    # (the runtime's counts; every build option has both)
    range: tuple[Any, Any] | None = None
    recipe: bool = True  # a recipe may set it
    spelled: dict[Any, str] = field(default_factory=dict)  # value -> how the CLI writes it (0 -> "channel")
    path: bool | str = False  # True: a file path, "dir": a folder (the CLI checks it exists)
    where: str = ""  # after "is not supported" (a choice of the type the build cannot make)
    # runtime settings (runtime/config.py):
    group: str = ""  # the concern it belongs to (cache, limits, execution, tiers, eviction, speculation, state)
    unit: str = ""  # what its number counts (tokens, sequences, bytes, blocks, ...); "" where it is no quantity
    hint: str = ""  # what a range message adds in parentheses ("0: a plain sliding window")
    open: bool = False  # `range` excludes its bounds (a share in (0, 1))
    parse: Callable[[Any], Any] | None = None  # a value's own reader (a size: "2GiB"), raising ConfigError


def option(default: Any, help: str | None = None, **spec: Any) -> Any:
    """An options field: its default and its Option spec."""
    return field(default=default, metadata={"option": Option(help, **spec)})


def spec_of(f: dataclasses.Field) -> Option:
    """The Option spec of a field declared with `option()`."""
    return f.metadata["option"]
