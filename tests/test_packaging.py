"""Packaging (pyproject.toml, setup.cfg): the wheel builds without setuptools warnings,
carries the package data, and nothing is written into build/, the folder the README puts
kvexport builds in."""

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "setup.cfg", "README.md", "src", "exporter", "plugins", "runtime", "recipes"]
WARNINGS = ["would be ignored", "SetuptoolsWarning", "BuildBackendWarning", "SetuptoolsDeprecationWarning",
            "experimental"]


def test_wheel_builds_without_warnings_and_outside_build(tmp_path):
    if int(importlib.metadata.version("setuptools").split(".")[0]) < 69:
        pytest.skip("this environment's setuptools is older than pyproject.toml's build requirement (>=69)")
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:  # a copy: the build writes its scratch folder and egg-info next to the sources
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
        else:
            shutil.copy2(p, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                        "--disable-pip-version-check", "-v", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert [w for w in WARNINGS if w in log] == [], log[-3000:]
    assert not (src / "build").exists()
    (wheel,) = (tmp_path / "dist").glob("kvexport-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"kvexport/runtime/serving/traces/mixed-64.json", "kvexport/plugins/paged_attention/cpu/paged_attention_ort.cc",
            "kvexport/recipes/llama.yaml", "kvexport/outputs.py", "kvexport/exporter/build.py",
            "kvexport/plugins/paged_mla/cpu/paged_mla_ort.cc", "kvexport/plugins/paged_mla/cpu/paged_mla_ort.h",
            "kvexport/plugins/paged_mla/spec.py", "kvexport/cli/__main__.py", "kvexport/cli/inspect.py"} <= names


def test_gitignore_covers_build_outputs():
    lines = (ROOT / ".gitignore").read_text().splitlines()
    assert {"build/", ".setuptools-build/", "*.egg-info/", "dist/"} <= set(lines)


def test_no_root_folder_shadows_the_package():
    """Only src/kvexport/ is named like the package: python run from the repository root imports
    the installed package whole (CLI, contracts and the four mapped parts)."""
    assert not (ROOT / "kvexport").exists()
    assert (ROOT / "src" / "kvexport" / "__init__.py").is_file()


def test_readme_python_example_runs_from_the_repository_root(chat_build):
    """The README's Python example (`from kvexport import LLM, SamplingParams`, generate, stream)
    with the working directory at the checkout's root, against a tiny build with a tokenizer."""
    import re

    readme = (ROOT / "README.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "from kvexport import LLM" in b]
    # the example names build/smollm2-135m; the tiny build stands in for it (same API, token ids only)
    code = example.replace('"build/smollm2-135m"', repr(str(chat_build))).replace('kv_cache_memory="1GiB"', 'kv_cache_memory="16MiB"')
    code += "\nimport kvexport, kvexport.runtime, kvexport.exporter, kvexport.cli\nprint('FROM', kvexport.__file__)\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    origin = Path(r.stdout.rsplit("FROM ", 1)[1].strip()).resolve()
    assert origin.parent.name == "kvexport" and origin.parent.parent != ROOT, origin
