"""A tokenizer with more ids than config.json's vocab_size (issue 48 §4; exporter/source.py
check_tokenizer): `kvexport build` exits 2 before any weight is loaded, naming both sizes, the ids
out of range and what to do. Before, the build exported its graphs and then failed in validation
with exit 1, "internal error ... IndexError: index out of range in self"."""

from __future__ import annotations

import re
import shutil

import pytest

from kvexport.exporter import source


def save_word_tokenizer(directory, num_ids: int) -> None:
    """A word-level tokenizer of ids 0..num_ids-1 (0 <unk>, 1 <s>, 2 </s>, then w3, w4, ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, num_ids)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


@pytest.mark.parametrize("num_ids, shown", [
    (130, "2 of its ids (128 'w128', 129 'w129') have no embedding"),
    (200, "72 of its ids (128 'w128', 129 'w129', 130 'w130', ...) have no embedding"),
])
def test_a_tokenizer_past_the_vocabulary_exits_2_before_loading_weights(hf_folder, tmp_path, monkeypatch, num_ids,
                                                                        shown):
    from click.testing import CliRunner

    from kvexport.cli import main

    def never(*a, **k):
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(source, "load_model", never)
    src = tmp_path / "model"
    shutil.copytree(hf_folder("llama"), src)  # vocab_size 128
    save_word_tokenizer(src, num_ids)
    out = tmp_path / "b"
    r = CliRunner().invoke(main, ["build", str(src), "--out", str(out), "--max-seq-len", "32"])
    msg = re.sub(r"\s+", " ", r.output)
    assert r.exit_code == 2, r.output
    assert (f"the tokenizer of {src} has {num_ids} token ids, more than config.json's vocab_size 128 (the model's "
            f"embedding rows): {shown}. Give the model the tokenizer its weights were trained with") in msg, msg
    assert "Traceback" not in r.output and not out.exists()


def test_a_tokenizer_within_the_vocabulary_builds_and_validates(hf_folder, tmp_path):
    from kvexport.exporter.build import BuildOptions, build

    src = tmp_path / "model"
    shutil.copytree(hf_folder("llama"), src)
    save_word_tokenizer(src, 128)  # ids 0..127: every one has its row
    out, manifest = build(str(src), tmp_path / "b", BuildOptions(block_size=4, max_seq_len=32))
    assert manifest.tokenizer and manifest.validation is not None
