"""Bad recipes and configs fail with a clear error naming the key or field, before any heavy
work: a recipe key given twice (YAML would keep the last), a recipe nested thousands deep
(RecursionError, "internal error", before), `num_key_value_heads: 0` (ZeroDivisionError
inside transformers, before), and a config claiming far more layers than the weights hold
(transformers built them all first: minutes, then a MemoryError)."""

import json
import shutil

import pytest

from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build
from kvexport.recipes import load_recipe


@pytest.mark.parametrize("text, words", [
    ("dtype: fp32\nlayout: paged\ndtype: fp16\n", "key 'dtype' is given twice (line 3)"),
    ("engines:\n  max_num_seqs: 4\n  max_num_seqs: 8\n", "key 'max_num_seqs' is given twice (line 3)"),
    ("engines: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 16 levels deep"),
    ("engines: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "nested more than 16 levels deep"),
])
def test_recipe_refusals_name_the_key(tmp_path, text, words):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_recipe(path)
    assert f"recipe {path}: {words}" in str(e.value)


def test_recipe_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("engines: {<<: {max_num_seqs: 4}, max_num_seqs: 8}\n")  # YAML's own override, not a repeat
    assert load_recipe(path).engines == {"max_num_seqs": 8}


def _patched(hf_folder, tmp_path, **fields):
    d = tmp_path / "src"
    shutil.copytree(hf_folder("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("fields, words", [
    # read with config.json (exporter/config_fields.py): the field and its range
    (dict(num_key_value_heads=0), "config field 'num_key_value_heads' of {src}/config.json must be an integer in "
                                  "1..1,024, got 0"),
    (dict(head_dim=0), "config field 'head_dim' of {src}/config.json must be an integer in 1..4,096, got 0"),
    (dict(num_hidden_layers=100_000), "config field 'num_hidden_layers' of {src}/config.json must be an integer in "
                                      "1..1,024, got 100000"),
    # in range, but more than the safetensors headers hold
    (dict(num_hidden_layers=1000), "config field 'num_hidden_layers' of {src} is 1000, but its weights hold 2 "
                                   "decoder layer(s) (layer indices 0..1)"),
])
def test_config_refusals_name_the_field_before_loading(hf_folder, tmp_path, monkeypatch, fields, words):
    from kvexport.exporter import source

    def never(*a, **k):
        raise AssertionError("the weights were loaded before the config was checked")

    monkeypatch.setattr(source, "load_model", never)  # the heavy work: transformers builds the model
    src = _patched(hf_folder, tmp_path, **fields)
    with pytest.raises(ConfigError) as e:
        build(src, tmp_path / "b", BuildOptions(max_seq_len=32, validate=False))
    assert words.format(src=src) in str(e.value) and not (tmp_path / "b").exists()
