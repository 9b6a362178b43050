"""The runtime settings are defined once (runtime/config.py): every CLI command that runs
an engine offers the same options with the same defaults, the Triton parameters are the
same fields as strings (and round-trip), and bad values are clear errors naming the field."""

import pytest
from click.testing import CliRunner

from kvexport.cli import main
from kvexport.errors import ConfigError
from kvexport.runtime.config import EngineConfig


def _options(command):
    return {p.name: p.default for p in main.commands[command].params if p.name in EngineConfig.__slots__}


def test_every_serving_command_has_the_same_settings_and_defaults():
    d = EngineConfig()
    from dataclasses import fields

    want = {f.name: getattr(d, f.name) for f in fields(EngineConfig)}
    want["cuda_graph_batch_sizes"] = ""  # its option takes comma-separated integers
    for command in ("generate", "bench", "serve", "triton"):
        assert _options(command) == want, command


def test_strings_round_trip():
    c = EngineConfig(kv_cache_memory="1GiB", max_num_seqs=8, max_model_len=256, enable_prefix_caching=False,
                     threads=2, cuda_graph_batch_sizes=(1, 2, 4), speculative_cost_model=False)
    assert EngineConfig.from_strings(c.to_strings()) == c
    assert EngineConfig.from_strings(EngineConfig().to_strings()) == EngineConfig()
    assert EngineConfig.from_strings({"threads": "0"}).threads is None  # Triton's "0 = all cores"


@pytest.mark.parametrize("kw,field", [({"max_num_seqs": 0}, "max_num_seqs"), ({"threads": -3}, "threads"),
                                      ({"backend": "cuda"}, "backend"), ({"kv_cache_memory": "lots"}, "size"),
                                      ({"max_model_len": 1}, "max_model_len"), ({"max_num_batched_tokens": True},
                                                                                "max_num_batched_tokens")])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kw)


def test_bad_strings_name_the_setting():
    with pytest.raises(ConfigError, match="unknown runtime setting"):
        EngineConfig.from_strings({"max_num_seq": "4"})
    with pytest.raises(ConfigError, match="max_num_seqs='many'"):
        EngineConfig.from_strings({"max_num_seqs": "many"})


def test_cli_refuses_out_of_range_settings(tmp_path):
    r = CliRunner().invoke(main, ["generate", str(tmp_path), "hi", "--threads", "-3"])
    assert r.exit_code == 2 and "threads must be an integer >= 1" in r.output
    r = CliRunner().invoke(main, ["serve", str(tmp_path), "--cuda-graph-batch-sizes", "1,x"])
    assert r.exit_code == 2 and "comma-separated integers" in r.output


def test_each_declared_range_and_choice_is_checked_naming_the_setting():
    """The per-field checks come from the declaration (issue 43 §1): one past each bound, or a
    value outside the choices, is refused naming the setting and what it must be."""
    from dataclasses import fields

    from kvexport.option_spec import spec_of
    from kvexport.runtime.config import value_type

    for f in fields(EngineConfig):
        s, t = spec_of(f), value_type(f)
        if s.choices:
            with pytest.raises(ConfigError, match=f"{f.name} must be one of {', '.join(s.choices)}, got 'bogus'"):
                EngineConfig(**{f.name: "bogus"})
        elif t is int:
            lo, hi = s.range
            for v in (lo - 1, *(() if hi is None else (hi + 1,)), True, "1"):
                with pytest.raises(ConfigError, match=f"^{f.name} must be an integer "):
                    EngineConfig(**{f.name: v})
    with pytest.raises(ConfigError, match=r"kv_budget_fraction must be a number in \(0, 1\)"):
        EngineConfig(kv_eviction="snapkv", kv_budget_fraction=1.0)
    with pytest.raises(ConfigError, match="cuda_graph_batch_sizes must be a tuple of integers >= 1"):
        EngineConfig(cuda_graph_batch_sizes=(1, 0))
