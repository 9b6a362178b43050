"""Interop fixtures: one contiguous smollm2-135m build (real weights, unvalidated: the interop
tests compare with transformers themselves), transformers' greedy tokens for the same prompts,
and the separate environments the other tools need (scripts/install.sh --dev creates them)."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OPTIMUM_PYTHON = Path(os.environ.get("KVEXPORT_OPTIMUM_PYTHON", REPO / ".venv-optimum" / "bin" / "python"))
PROMPTS = ("The capital of France is", "def fibonacci(n):")
NEW_TOKENS = 12


def need(condition: bool, why: str) -> None:
    """Skip with `why` when `condition` fails; in CI (CI set) fail instead: install.sh provides it."""
    if not condition:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="session")
def contiguous_build(tmp_path_factory):
    from kvexport import io
    from kvexport.exporter.build import BuildOptions, build

    out, _ = build("smollm2-135m", tmp_path_factory.mktemp("interop") / "smollm2-contig",
                   BuildOptions(layout=io.KVLayout.CONTIGUOUS, max_seq_len=512, validate=False))
    return out


@pytest.fixture(scope="session")
def reference(contiguous_build):
    """{prompt: (prompt ids, transformers' greedy new ids)} on the model the build came from."""
    import torch
    from transformers import AutoTokenizer

    from kvexport.exporter import source

    src = source.resolve("smollm2-135m")
    model = source.load_model(src)
    tok = AutoTokenizer.from_pretrained(contiguous_build / "tokenizer")
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, min_new_tokens=NEW_TOKENS)
        out[prompt] = (ids[0].tolist(), gen[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="session")
def optimum_python():
    need(OPTIMUM_PYTHON.is_file(), f"no optimum environment at {OPTIMUM_PYTHON}: run scripts/install.sh --dev "
                                   f"(it creates .venv-optimum with optimum-onnx and transformers 4.57)")
    return OPTIMUM_PYTHON
