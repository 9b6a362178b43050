"""`kvexport build --hidden-states` (kvexport/io.py HIDDEN_STATES, issue 45 §1): the paged graphs also return every
token's hidden states at the listed layer boundaries, each equal to transformers' `output_hidden_states[b]` (the
residual stream entering layer b; b = L the final normed state) within the fp32 bound, for llama, gemma3_text
(embedding scale, sandwich norms, windows) and qwen3_moe; the manifest records the boundaries; the build still
validates and serves; bad values are refused by name."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvexport import LLM, SamplingParams, io
from kvexport import manifest as mf
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.validate import TOLERANCE

from testkit import parity
from testkit.families import CASES_2025, TINY

CASES = {"llama": ({}, "0,1,2"), "gemma3_text": (CASES_2025["gemma3_text"], "eagle3"),
         "qwen3_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=24), "mtp")}


def run_prefill(build_dir, m, prompt: list[int]) -> np.ndarray:
    """The prefill graph of an `onnx`-attention paged build on one fresh sequence (empty pools): hidden_states."""
    entry = m.graphs["prefill"]
    sess = ort.InferenceSession(str(build_dir / entry.file), providers=["CPUExecutionProvider"])
    n, bs = len(prompt), m.kv.block_size
    blocks = (n + bs - 1) // bs
    table = np.arange(1, blocks + 1, dtype=np.int64)[None]  # block 0: the pad block
    feeds = {io.INPUT_IDS: np.array(prompt, np.int64), io.POSITIONS: np.arange(n, dtype=np.int64),
             io.QUERY_START_LOC: np.array([0, n], np.int64), io.SEQ_LENS: np.array([n], np.int64),
             io.LOGITS_INDICES: np.array([n - 1], np.int64), io.OBSERVATION_LENS: np.zeros(1, np.int64)}
    for t in entry.inputs:
        if t.name.startswith(io.BLOCK_TABLES):
            feeds[t.name] = table
        elif t.name.startswith(io.SLOT_MAPPING):
            feeds[t.name] = np.arange(bs, bs + n, dtype=np.int64)
        elif t.name not in feeds:  # a pool: [kv_heads, blocks, block_size, row]
            shape = [d if isinstance(d, int) else blocks + 1 for d in t.shape]
            feeds[t.name] = np.zeros(shape, np.dtype(t.dtype))
    return sess.run([io.HIDDEN_STATES], feeds)[0]


@pytest.mark.parametrize("family", list(CASES))
def test_hidden_states_are_transformers_hidden_states(hf_folder, tmp_path, family):
    overrides, which = CASES[family]
    folder = hf_folder(family, **overrides)
    out, m = build(str(folder), tmp_path / "b", BuildOptions(max_seq_len=64, block_size=4,
                                                             attention=io.Attention.ONNX, hidden_states=which))
    assert m.validation.passed, m.validation
    layers = m.graphs["prefill"].hidden_layers
    num_layers = m.model.spec["num_layers"]
    assert layers == io.hidden_state_layers(which, num_layers) == mf.load(out).graphs["decode"].hidden_layers
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = parity.random_prompts(1, TINY["vocab_size"], 11, 12, seed=5)[0]
    with torch.no_grad():
        ref = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    got = run_prefill(out, m, prompt)
    assert got.shape == (len(prompt), len(layers), m.model.spec["hidden_size"])
    for j, layer in enumerate(layers):
        want = ref[layer][0].numpy()
        assert np.abs(got[:, j] - want).max() <= TOLERANCE["fp32"] * max(1.0, float(np.abs(want).max())), layer
    got_text = LLM(out).generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    assert got_text == parity.hf_greedy(model, [prompt], 4)[0]  # serving ignores the extra output


@pytest.mark.parametrize("which, words", [
    ("eagle3", "a 2-layer model does not have"), ("2,1", "ascending"), ("0,3", "in 0..2"), ("x", "comma list")])
def test_bad_values_are_refused(hf_folder, tmp_path, which, words):
    with pytest.raises(ConfigError, match=words) as e:
        build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(max_seq_len=64, hidden_states=which))
    assert "--hidden-states" in str(e.value)


def test_contiguous_builds_refuse_them():
    with pytest.raises(ConfigError, match="--hidden-states needs --layout paged"):
        BuildOptions(layout=io.KVLayout.CONTIGUOUS, hidden_states="mtp")


def test_cli_flag(hf_folder, tmp_path):
    from click.testing import CliRunner

    from kvexport.cli import main

    r = CliRunner().invoke(main, ["build", str(hf_folder("llama")), "--out", str(tmp_path / "b"), "--max-seq-len",
                                  "64", "--no-validate", "--hidden-states", "0,2"])
    assert r.exit_code == 0, r.output
    assert mf.load(tmp_path / "b").graphs["prefill"].hidden_layers == (0, 2)
    r = CliRunner().invoke(main, ["build", str(hf_folder("llama")), "--out", str(tmp_path / "c"),
                                  "--hidden-states", "eagle3"])
    assert r.exit_code == 2 and "--hidden-states eagle3 reads layers" in r.output, r.output
