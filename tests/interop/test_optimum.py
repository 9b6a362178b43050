"""A contiguous build through optimum's ORTModelForCausalLM.generate, and its tokenizer folder
under transformers 4.57, in .venv-optimum (optimum pins transformers 4.x; scripts/install.sh --dev)."""

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import NEW_TOKENS, PROMPTS

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("optimum_generate.py")


@pytest.fixture(scope="module")
def optimum_run(optimum_python, contiguous_build):
    r = subprocess.run([str(optimum_python), str(SCRIPT), str(contiguous_build), str(NEW_TOKENS), *PROMPTS],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_optimum_generate_matches_transformers(optimum_run, reference):
    assert [run["prompt"] for run in optimum_run["runs"]] == list(PROMPTS)
    for run in optimum_run["runs"]:
        ids, new = reference[run["prompt"]]
        assert run["prompt_ids"] == ids
        assert run["new_ids"] == new, run["prompt"]


def test_tokenizer_folder_loads_under_transformers_4(optimum_run, contiguous_build):
    from transformers import AutoTokenizer

    assert optimum_run["transformers"].startswith("4.")
    assert optimum_run["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = AutoTokenizer.from_pretrained(contiguous_build / "tokenizer")  # transformers 5, this venv
    assert optimum_run["special"] == [tok.bos_token, tok.eos_token, tok.pad_token] == \
        ["<|im_start|>", "<|im_end|>", "<|im_end|>"]
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert optimum_run["chat"] == chat and chat.endswith("<|im_start|>assistant\n")


# NOTE: not phi3 / gemma2: optimum-onnx 0.1's ORTModelForCausalLM sizes the empty first-step past
# with num_attention_heads for model types outside its GQA list (modeling_decoder.py), so their
# GQA graphs (2 KV heads here) are fed 4 (docs/INTEROP.md)
FAMILIES = ("llama", "gpt2", "qwen2", "mistral")


def test_optimum_runs_tiny_models_of_each_family(optimum_python, hf_folder, tmp_path):
    """Tiny random models of several families, built contiguous: optimum's greedy tokens equal
    transformers' (one optimum process for all)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvexport import io
    from kvexport.exporter.build import BuildOptions, build

    ids, n = [5, 17, 33, 42, 9, 71], 8
    want, builds = {}, []
    for family in FAMILIES:
        extra = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        src = hf_folder(family, **extra)
        out, _ = build(str(src), tmp_path / family, BuildOptions(layout=io.KVLayout.CONTIGUOUS, max_seq_len=64,
                                                                 validate=False))
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        x = torch.tensor([ids])
        with torch.no_grad():
            want[str(out)] = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False)[0, len(ids):].tolist()
        builds.append(str(out))
    r = subprocess.run([str(optimum_python), str(SCRIPT), "--ids", str(n), ",".join(map(str, ids)), *builds],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])["runs"]
    assert got == want
