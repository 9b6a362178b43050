"""One decoder of typed values from parsed JSON / YAML, shared by the manifest (kvexport.json,
kvexport/manifest.py) and build recipes (recipes/__init__.py): a value is checked against a type
annotation (int, float, str, bool, X | None, tuple[...], list[...], dict[...], a dataclass), JSON
lists become tuples where the annotation says tuple, mappings become dataclasses where it names one,
and the first value that does not fit raises the caller's error naming its dotted path
('engines.limits.max_num_seqs', 'graphs.decode.inputs[0].shape[1]').

The caller chooses the words (`Words`): the manifest speaks of JSON ("an int", "an object"), a
recipe to a person editing YAML ("an integer", "a mapping of option: value"), and each caller
turns (path, what) into its own error type.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ConfigError


class FieldError(Exception):
    """A value at `path` that does not fit (`what`: "is missing", "must be an int, got 'x'")."""

    def __init__(self, path: str, what: str, final: bool = False):
        super().__init__(f"{path} {what}")
        self.path, self.what = path, what
        self.final = final  # a value of the right type that is still wrong: no other type of a union is tried


@dataclass(frozen=True)
class Words:
    """How a decoder's messages name types and say what is wrong."""

    types: dict[type, str | None]  # int -> "an int"; dict -> "an object"; type(None) -> "null" (None: unnamed)
    # a key the dataclass does not have: (path of the key, the key, the known names) -> (path, what)
    unknown: Callable[[str, str, tuple[str, ...]], tuple[str, str]] = (
        lambda path, key, known: (path, "is not a field this kvexport knows"))
    # a scalar's own problem beyond its type, at its path (a choice, a range, an empty string); None: fine
    check: Callable[[str, Any], str | None] = lambda path, value: None
    make: Callable[[str, str], Exception] = FieldError  # (path, what) -> the exception raised
    # a dataclass's own checks failed (ConfigError e): (path of the object, e) -> (path, what)
    invalid: Callable[[str, ConfigError], tuple[str, str]] = lambda path, e: (path, f"is invalid: {e}")
    special: dict[type, Callable[[Any, str], Any]] = field(default_factory=dict)  # types decoded by a function


_OK = {bool: lambda v: isinstance(v, bool), int: lambda v: isinstance(v, int) and not isinstance(v, bool),
       float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), str: lambda v: isinstance(v, str)}


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """A class's resolved field annotations (cached)."""
    return typing.get_type_hints(cls)


def got(value: Any) -> str:
    """`value` as a message quotes it, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def type_name(tp: Any, words: Words) -> str:
    """`tp` in `words`: "an int or null", "a list of strings"."""
    if tp is type(None):
        return words.types[type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a, words) for a in typing.get_args(tp)
                           if not (a is type(None) and words.types.get(a) is None))
    if typing.get_origin(tp) in (tuple, list) or tp in (tuple, list):
        args = typing.get_args(tp)
        return f"a list of {type_name(args[0], words).split(' ', 1)[-1]}s" if args else "a list"
    return words.types.get(tp, words.types[dict])


def decode(tp: Any, value: Any, path: str, words: Words) -> Any:
    """`value` checked against type `tp` (raises words.make(path, what) naming the first misfit)."""
    try:
        return _decode(tp, value, path, words)
    except FieldError as e:
        if words.make is FieldError:
            raise
        raise words.make(e.path, e.what) from None


def _decode(tp: Any, value: Any, path: str, words: Words) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                try:
                    return _decode(a, value, path, words)
                except FieldError as e:
                    # wrong inside a nested object, or an object that is not a valid `a`: the error to report
                    nested = isinstance(value, dict) and isinstance(a, type) and dataclasses.is_dataclass(a)
                    if e.path != path or nested or e.final:
                        raise
        raise FieldError(path, f"must be {type_name(tp, words)}, got {got(value)}")
    if tp in words.special:
        return words.special[tp](value, path)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _fields(tp, value, path, words)
    if tp in _OK:
        if not _OK[tp](value):
            raise FieldError(path, f"must be {type_name(tp, words)}, got {got(value)}")
        if (problem := words.check(path, value)) is not None:
            raise FieldError(path, problem, final=True)
        return value
    container = origin or tp
    if container in (tuple, list):
        if not isinstance(value, list):
            raise FieldError(path, f"must be {type_name(tp, words)}, got {got(value)}")
        item = args[0] if args else Any
        items = [_decode(item, v, f"{path}[{i}]", words) for i, v in enumerate(value)]
        return tuple(items) if container is tuple else items
    if container is dict:
        if not isinstance(value, dict):
            raise FieldError(path, f"must be {words.types[dict]}, got {got(value)}")
        item = args[1] if args else Any
        return {k: _decode(item, v, f"{path}.{k}", words) for k, v in value.items()}
    raise TypeError(f"type {tp!r} of {path!r} has no decoding")  # a schema bug, not user input


def _fields(cls: type, data: Any, path: str, words: Words) -> Any:
    if not isinstance(data, dict):
        raise FieldError(path or "(top level)", f"must be {words.types[dict]}, got {got(data)}")
    fields = dataclasses.fields(cls)
    known = tuple(f.name for f in fields)
    sub = (lambda name: f"{path}.{name}") if path else (lambda name: name)
    for name in data:
        if name not in known:
            raise FieldError(*words.unknown(sub(name), name, known))
    hint, kwargs = hints(cls), {}
    for f in fields:
        if f.name in data:
            kwargs[f.name] = _decode(hint[f.name], data[f.name], sub(f.name), words)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise FieldError(sub(f.name), "is missing")
    try:
        return cls(**kwargs)
    except ConfigError as e:  # the dataclass's own checks (EngineBuildOptions)
        raise FieldError(*words.invalid(path, e)) from None
