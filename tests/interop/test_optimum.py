"""A contiguous build through optimum's ORTModelForCausalLM.generate, and its tokenizer folder
under transformers 4.57, in .venv-optimum (optimum pins transformers 4.x; scripts/install.sh)."""

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
