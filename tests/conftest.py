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

import torch  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=96, max_position_embeddings=256)


def tiny_config(family: str, **overrides):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    if family == "gpt2":
        base = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256, n_inner=96)
        base.update(overrides)
        return GPT2Config(**base)
    from transformers import Gemma2Config, Gemma3TextConfig, Olmo2Config, Qwen3Config, SmolLM3Config

    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "phi3": Phi3Config,
           "qwen3": Qwen3Config, "olmo2": Olmo2Config, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig,
           "smollm3": SmolLM3Config, "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig,
           "qwen2_moe": Qwen2MoeConfig}[family]
    base = dict(TINY, num_key_value_heads=2)
    if family in ("qwen3", "olmo2", "gemma2", "gemma3_text", "smollm3",
                  "qwen3_moe", "mixtral", "qwen2_moe"):  # token ids inside the tiny vocab
        base.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family in ("gemma2", "gemma3_text"):  # their defaults are 256-wide heads and a 4096 window
        base.update(head_dim=16, sliding_window=8)
    if family == "mistral":
        base["sliding_window"] = None
    if family == "phi3":
        base.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    return cls(**base)


def make_hf_folder(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    # NOTE: random init gives tiny logits where greedy argmax ties are likely; scale the
    # output layer so logits have realistic spreads and token comparisons mean something.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(directory, safe_serialization=True)
    return Path(directory)



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
