"""Print kvexport's requirements from pyproject.toml, one per line: the dependencies, then those of each extra named
on the command line (an extra that names kvexport's own extras, `kvexport[dynamo]`, gives theirs). scripts/install.sh
installs them with `pip install -r`, so kvexport itself, installed before with --no-deps, is not reinstalled while
the native op compiles from it."""

import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]


def expand(reqs: list[str]) -> list[str]:
    out = []
    for r in reqs:
        if r.replace(" ", "").startswith(project["name"] + "["):
            for extra in r.split("[", 1)[1].split("]", 1)[0].split(","):
                out += expand(project["optional-dependencies"][extra.strip()])
        else:
            out.append(r)
    return out


print("\n".join(expand(project["dependencies"] + [r for e in sys.argv[1:] for r in project["optional-dependencies"][e]])))
