"""CLI fixtures: a tiny llama with a character-level tokenizer (so text prompts work), and its
paged build; `invoke` runs the CLI in process and keeps stdout and stderr apart."""

import shutil
import string

import pytest
from click.testing import CliRunner

from kvexport.cli import main

CHARS = sorted(set(string.printable) - set("\x0b\x0c\r"))  # ids 3.. (0 <unk>, 1 <s>, 2 </s>): 103 < vocab 128


def save_char_tokenizer(directory) -> None:
    """One token per printable ASCII character (anything else is <unk>); decoding joins them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


@pytest.fixture(scope="session")
def text_model(hf_folder, tmp_path_factory):
    """A tiny llama HF folder with the character tokenizer."""
    d = tmp_path_factory.mktemp("text-model") / "llama"
    shutil.copytree(hf_folder("llama", num_key_value_heads=2), d)
    save_char_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def text_build(text_model, tmp_path_factory):
    """Its paged build (64-token context, 4-token blocks, default attention), unvalidated."""
    from kvexport.exporter.build import BuildOptions, build

    out, _ = build(str(text_model), tmp_path_factory.mktemp("text-build") / "b",
                   BuildOptions(block_size=4, max_seq_len=64, validate=False))
    return out


@pytest.fixture
def invoke():
    """invoke(*args) -> click Result with .stdout / .stderr / .output (both) and .exit_code."""

    def run(*args, **kw):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True, **kw)

    return run
