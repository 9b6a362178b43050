"""Shipped recipes load into the typed Recipe and build options; bad recipes are refused."""

import pytest

from kvexport import io
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions
from kvexport.exporter.families import FAMILIES
from kvexport.recipes import Recipe, load_recipe, shipped_recipes


def test_one_shipped_recipe_per_family():
    names = {p.stem for p in shipped_recipes()}
    assert {f.recipe.removesuffix(".yaml") for f in FAMILIES.values()} <= names
    for p in shipped_recipes():
        r = load_recipe(p)
        kw = r.options()
        kw["layout"] = io.KVLayout(kw["layout"])
        kw["dtype"] = io.DType(kw["dtype"])
        BuildOptions(**kw)  # valid options


def test_recipe_by_name():
    assert load_recipe("gpt2").layout == "contiguous"


@pytest.mark.parametrize("text,word", [("layout: [1, 2\n", "YAML"), ("- a\n", "mapping"),
                                        ("blocksize: 3\n", "unknown option"), ("block_size: yes\n", "block_size")])
def test_bad_recipes(tmp_path, text, word):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=word):
        load_recipe(p)


def test_empty_recipe_is_all_defaults(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("")
    assert load_recipe(p) == Recipe()


def test_recipe_carries_plugin_int8_and_engine_options(tmp_path):
    from kvexport.exporter.tensorrt_build import EngineBuildOptions

    p = tmp_path / "r.yaml"
    p.write_text("attention: plugin\nkv_dtype: int8\ndtype: fp16\ncalibration_tokens: 512\nbackend: tensorrt\n"
                 "engines:\n  max_num_seqs: 16\n  max_num_blocks: 4096\n")
    kw = load_recipe(p).options()
    assert kw["engines"] == EngineBuildOptions(max_num_seqs=16, max_num_blocks=4096)
    opts = BuildOptions(**{**kw, "attention": io.Attention(kw["attention"]), "kv_dtype": io.DType(kw["kv_dtype"]),
                           "dtype": io.DType(kw["dtype"])})
    assert opts.backend == "tensorrt" and opts.engines.max_num_seqs == 16 and opts.calibration_tokens == 512
    p.write_text("engines:\n  max_seqs: 16\n")
    with pytest.raises(ConfigError, match="unknown option.*max_seqs"):
        load_recipe(p).options()


def test_recipe_carries_the_weights_form_and_serving_accuracy(tmp_path):
    """A recipe names the exact int4 form (Q4_1-exact codes, float serving) as flags would."""
    p = tmp_path / "r.yaml"
    p.write_text("weights: int4\nquant_method: rtn\nweight_block_size: 32\nweight_matmul_accuracy: float\n")
    opts = BuildOptions(**load_recipe(p).options())
    assert (opts.weight_quantization().method, opts.weight_matmul_accuracy) == ("rtn", "float")
    p.write_text("weights: int4\nweight_matmul_accuracy: fp8\n")
    with pytest.raises(ConfigError, match="weight_matmul_accuracy must be one of auto, int8, float"):
        load_recipe(p)
