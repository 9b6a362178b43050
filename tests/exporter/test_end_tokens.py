"""End tokens (exporter/end_tokens.py): a build records generation_config.json's eos_token_id
next to config.json's and the runtime stops on both, where transformers' generate stops (same
tokens, a tiny random llama whose generation_config adds a token it produces under greedy
decoding); a build made before the field stops on config.json's eos alone; an end token
outside the vocabulary is a warning naming it; a malformed one an error naming the field."""

import json
import logging
import shutil

import pytest
import torch

from kvexport import LLM, SamplingParams, manifest
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build

PROMPT = [1, 5, 9, 3, 17]
STEPS = 12


def _greedy(folder, max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate on the folder (it reads generation_config.json)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def two_eos(hf_folder, tmp_path_factory):
    """(folder, build, extra eos X, transformers' tokens): generation_config.json says [2, X], X
    the greedy token at step 4 (one not produced earlier), config.json says 2."""
    folder = tmp_path_factory.mktemp("eos-hf") / "tiny"
    shutil.copytree(hf_folder("llama"), folder)
    free = _greedy(folder, STEPS)  # generation_config.json still [2]: runs all STEPS
    assert len(free) == STEPS and 2 not in free
    step = next(i for i in range(4, STEPS) if free[i] not in free[:i])
    extra = free[step]
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, extra]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    want = _greedy(folder, STEPS)
    assert want == free[:step + 1]  # transformers stops at X, X included
    out, _ = build(str(folder), tmp_path_factory.mktemp("eos") / "tiny", BuildOptions(max_seq_len=64, validate=False))
    return folder, out, extra, want


def test_stops_where_transformers_generate_stops(two_eos):
    _, out, extra, want = two_eos
    m = manifest.load(out)
    assert m.model.spec["eos_token_ids"] == [2] and m.model.spec["generation_eos_token_ids"] == [2, extra]
    assert m.model.eos_token_ids == (2, extra)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, extra]
    llm = LLM(out, kv_cache_memory="1MiB")
    (got,) = llm.generate([PROMPT], SamplingParams(max_tokens=STEPS))
    assert list(got.token_ids) == want and got.finish_reason == "stop"
    (past,) = llm.generate([PROMPT], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert len(past.token_ids) == STEPS and list(past.token_ids[:len(want)]) == want


def test_build_before_the_field_stops_on_config_eos(two_eos, tmp_path):
    _, out, extra, want = two_eos
    old = tmp_path / "old"
    shutil.copytree(out, old)
    data = json.loads((old / "kvexport.json").read_text())
    del data["model"]["generation_eos_token_ids"]  # what builds made before it hold
    (old / "kvexport.json").write_text(json.dumps(data))
    assert manifest.load(old).model.eos_token_ids == (2,)
    (got,) = LLM(old, kv_cache_memory="1MiB").generate([PROMPT], SamplingParams(max_tokens=STEPS))
    assert len(got.token_ids) == STEPS and list(got.token_ids[:len(want)]) == want
    assert got.finish_reason == "length"


def test_end_token_outside_vocabulary_is_a_warning_naming_it(hf_folder, tmp_path, caplog):
    folder = tmp_path / "tiny"
    shutil.copytree(hf_folder("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5000]}))
    with caplog.at_level(logging.WARNING, logger="kvexport.exporter.end_tokens"):
        _, m = build(str(folder), tmp_path / "b", BuildOptions(max_seq_len=32, validate=False))
    assert m.model.eos_token_ids == (2, 5000)
    (msg,) = [r.getMessage() for r in caplog.records if "outside the vocabulary" in r.getMessage()]
    assert "end token 5000 (generation_config.json 'eos_token_id'" in msg and "vocab_size 128" in msg


@pytest.mark.parametrize("value", ["2", [2, -1], [2, 1.5], True])
def test_malformed_end_token_is_an_error_naming_the_field(hf_folder, tmp_path, value):
    folder = tmp_path / "tiny"
    shutil.copytree(hf_folder("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    with pytest.raises(ConfigError, match=r"field 'eos_token_id' of .*generation_config.json must be a token id"):
        build(str(folder), tmp_path / "b", BuildOptions(max_seq_len=32, validate=False))
    assert not (tmp_path / "b").exists()


def test_gguf_end_ids_from_metadata(tmp_path):
    import gguf

    from kvexport.exporter import end_tokens, source

    path = tmp_path / "tiny.gguf"  # the metadata alone: what end_tokens reads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_eos_token_id(2)
    w.add_uint32("tokenizer.ggml.eot_token_id", 7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = source.resolve(str(path))
    assert end_tokens.generation_eos(src) == (2, 7)  # eos, then end of turn
