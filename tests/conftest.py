"""Test-wide environment: no hub, no telemetry, every cache in a temp dir; and tiny
random models of each family, saved as real HF folders (config.json + safetensors)."""

import os
import shutil
import tempfile

_TMP = tempfile.mkdtemp(prefix="kvexport-tests-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["ORT_DISABLE_TELEMETRY"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
for var in ("HF_HOME", "TRITON_CACHE_DIR", "CUPY_CACHE_DIR", "XDG_CACHE_HOME"):
    os.environ[var] = os.path.join(_TMP, var.lower())

import pytest  # noqa: E402

from pathlib import Path  # noqa: E402

from testkit.families import make_hf_folder  # noqa: E402  (the tiny configs per family)


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """make(family, **config overrides) -> path of a saved tiny random HF model (cached)."""
    cache = {}

    def make(family: str, **overrides):
        key = (family, repr(sorted(overrides.items())))  # repr: overrides may hold lists and dicts
        if key not in cache:
            d = tmp_path_factory.mktemp(f"hf-{family}")
            cache[key] = make_hf_folder(family, d, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def smollm2_build(tmp_path_factory):
    """One paged smollm2-135m build (max_seq_len 512, unvalidated) shared by the server tests."""
    from kvexport import io
    from kvexport.exporter.build import BuildOptions, build

    out, _ = build("smollm2-135m", tmp_path_factory.mktemp("smollm2") / "smollm2-135m",
                   BuildOptions(max_seq_len=512, validate=False, attention=io.Attention.ONNX))
    return out


@pytest.fixture(scope="session")
def cpu_op():
    """The native CPU PagedAttention library (scripts/build_cpu_ops.sh, run by install.sh).
    Skipped with the reason when it is not built; in CI (CI set) a missing library fails."""
    from kvexport.plugins.paged_attention import native

    path = native.library()
    if path is None:
        msg = (f"the native CPU PagedAttention op is not built ({native.default_library()}): "
               f"run scripts/build_cpu_ops.sh (needs g++ and npm)")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def tree_snapshot(root: Path) -> dict:
    """Everything at and under `root`, for "byte-identical after" checks: relative path ->
    (type, bytes or link target, permission bits); links are not followed."""
    import stat

    snap = {}
    paths = [root]
    if root.is_dir() and not root.is_symlink():
        for d, dirs, files in os.walk(root):  # links to folders are listed, not followed
            paths += [Path(d) / n for n in dirs + files]
    for p in paths:
        st = os.lstat(p)
        rel = str(p.relative_to(root))
        if stat.S_ISLNK(st.st_mode):
            snap[rel] = ("link", os.readlink(p), 0)
        elif stat.S_ISREG(st.st_mode):
            snap[rel] = ("file", p.read_bytes(), stat.S_IMODE(st.st_mode))
        else:
            snap[rel] = (stat.S_IFMT(st.st_mode), None, stat.S_IMODE(st.st_mode))
    return snap


@pytest.fixture
def snapshot():
    """tree_snapshot(root): see there."""
    return tree_snapshot


@pytest.fixture(scope="session")
def chat_build(hf_folder, tmp_path_factory):
    """A tiny llama build (context 64) with smollm2-135m's tokenizer and chat template: text
    prompts and chat requests run end to end in milliseconds."""
    from kvexport.exporter.build import BuildOptions, build
    from kvexport.exporter.source import load_tokenizer, resolve

    folder = tmp_path_factory.mktemp("chat-hf") / "tiny-chat"
    shutil.copytree(hf_folder("llama", vocab_size=49152), folder)
    load_tokenizer(resolve("smollm2-135m")).save_pretrained(folder)
    out, _ = build(str(folder), tmp_path_factory.mktemp("chat") / "tiny-chat",
                   BuildOptions(max_seq_len=64, validate=False))
    return out
