"""Build recipes: YAML files that carry any `kvexport build` option, loaded into a typed,
validated Recipe. One recipe per supported family ships in this folder.

The schema is generated from `BuildOptions` (exporter/options.py): a Recipe has `model`, `out` and
every option whose spec allows a recipe to set it (not `allow_pickle`), as the YAML writes it
("paged", not io.KVLayout.PAGED); its choices and ranges are the options' own, and the `engines`
mapping is EngineBuildOptions'. Values are checked by the decoder the manifest uses too
(kvexport/decode.py), so a wrong key or value raises ConfigError naming it (`engines.max_num_seqs`)."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any

import yaml

from kvexport.decode import Words, decode, got
from kvexport.errors import ConfigError
from kvexport.exporter.options import from_words, recipe_fields, spec_of, value_type
from kvexport.manifest_engines import PRECISIONS, EngineBuildOptions

RECIPE_DIR = Path(__file__).resolve().parent


def _yaml_type(f: dataclasses.Field) -> type:
    """How a recipe writes the option: an enum by its value (a string), the engines as a mapping."""
    t = value_type(f)
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return str
    return dict if t is EngineBuildOptions else t


_OPTIONS = recipe_fields()
_BY_NAME = {f.name: f for f in _OPTIONS}
# dotted key -> the values it may take, as YAML writes them
CHOICES: dict[str, tuple] = {
    **{f.name: tuple(v.value if isinstance(v, enum.Enum) else v for v in spec_of(f).choices)
       for f in _OPTIONS if spec_of(f).choices},
    "engines.precision": PRECISIONS}
RANGES = {f.name: spec_of(f).range for f in _OPTIONS if spec_of(f).range is not None}


def _value_problem(key: str, value: Any) -> str | None:
    """A recipe value's problem beyond its type: an empty string, a choice, a range."""
    if isinstance(value, str) and ("\0" in value or not value.strip()):
        return f"must be a non-empty string without NUL characters, got {got(value)}"
    choices = CHOICES.get(key)
    if choices is not None and value not in choices:
        return f"must be one of {', '.join(map(str, choices))}, got {got(value)}"
    if key in RANGES:
        lo, hi = RANGES[key]
        if not lo <= value <= hi:
            return f"must be in {lo}..{hi}, got {value}"
    elif isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return f"must be >= 0, got {value}"
    return None


# the recipe's words for the shared decoder: a person editing YAML
_WORDS = Words(types={bool: "true or false", int: "an integer", str: "a string", float: "a number",
                      dict: "a mapping of option: value", type(None): None},
               unknown=lambda path, key, known: (f"{path.rsplit('.', 1)[0]}:",
                                                 f"unknown option {key!r}; known: {', '.join(known)}"),
               check=_value_problem, make=lambda path, what: ConfigError(f"{path} {what}"),
               invalid=lambda path, e: (f"{path}:", str(e)))


def _post_init(self) -> None:
    for f in dataclasses.fields(self):
        v = getattr(self, f.name)
        if v is None:
            continue
        t = _yaml_type(_BY_NAME[f.name]) if f.name in _BY_NAME else str
        decode(t, v, f.name, _WORDS)
        if t is dict:  # checked as the typed options it becomes
            decode(EngineBuildOptions, v, f.name, _WORDS)


def _options(self) -> dict:
    """The fields that are set, as BuildOptions keyword arguments (typed: enums, and the
    `engines` mapping an EngineBuildOptions)."""
    kw = {k: from_words(_BY_NAME[k], v) for k, v in dataclasses.asdict(self).items()
          if v is not None and k not in ("model", "out")}
    if "engines" in kw:  # checked when the Recipe was made
        kw["engines"] = EngineBuildOptions(**kw["engines"])
    return kw


# Recipe(model=None, out=None, <every recipe option>=None): None = not set (BuildOptions' default)
Recipe = dataclasses.make_dataclass(
    "Recipe", [("model", str | None, None),  # model path or alias; the CLI argument wins when given
               ("out", str | None, None),  # build directory; --out wins when given
               *((f.name, _yaml_type(f) | None, None) for f in _OPTIONS)],
    frozen=True, slots=True, namespace={"__post_init__": _post_init, "options": _options,
                                        "__doc__": "A build recipe: model, out and BuildOptions as YAML writes them."})
Recipe.__module__ = __name__


MAX_DEPTH = 16  # YAML nesting a recipe may have (its deepest option, engines.X, is 2 levels)


class _RecipeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses what safe_load takes silently or crashes on: a key given
    twice in one mapping (safe_load keeps the last) and nesting deeper than MAX_DEPTH (safe_load
    recurses per level, so a few thousand levels end in RecursionError)."""

    _depth = 0

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"nested more than {MAX_DEPTH} levels deep (line {mark.line + 1}); a recipe is a "
                                  f"flat mapping of option: value (engines: a mapping of its options)")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *anchor": merged keys may be overridden, as YAML says
            key = self.construct_object(key_node, deep=True)
            try:
                dup = key in seen
            except TypeError:  # an unhashable key: SafeConstructor reports it
                break
            if dup:
                raise ConfigError(f"key {got(key)} is given twice (line {key_node.start_mark.line + 1}); give each "
                                  f"option once")
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_recipe(path: str | Path) -> Recipe:
    """A recipe file, or the name of a shipped one ("llama" -> recipes/llama.yaml)."""
    p = Path(path)
    if not p.is_file() and (RECIPE_DIR / f"{path}.yaml").is_file():
        p = RECIPE_DIR / f"{path}.yaml"
    try:
        data = yaml.load(p.read_text(), Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(f"recipe {p}: {e}") from None
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, a NUL in the path
        raise ConfigError(f"cannot read recipe {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {p} is not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {p} must be a mapping of option: value")
    fields = [f.name for f in dataclasses.fields(Recipe)]
    unknown = sorted(map(str, set(data) - set(fields)))
    if unknown:
        raise ConfigError(f"recipe {p}: unknown option(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    try:
        return Recipe(**data)
    except ConfigError as e:
        raise ConfigError(f"recipe {p}: {e}") from None


def shipped_recipes() -> list[Path]:
    return sorted(RECIPE_DIR.glob("*.yaml"))
