"""`kvexport bench` on a tiny build: every figure is produced and consistent (no timing
assertions: speed lives in the benchmark's output, not in tests)."""

import json

import pytest
from click.testing import CliRunner

from kvexport import io
from kvexport.cli import main
from kvexport.errors import ConfigError
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.serving.bench import arrival_times, prefix_ttft
from kvexport.runtime.engine import EngineConfig


@pytest.fixture(scope="module")
def tiny(hf_folder, tmp_path_factory):
    src = hf_folder("llama", num_key_value_heads=2, max_position_embeddings=1024)  # the trace's prompts reach 512
    out, _ = build(str(src), tmp_path_factory.mktemp("bench") / "b",
                   BuildOptions(block_size=4, max_seq_len=1024, validate=False, attention=io.Attention.ONNX))
    return out


def test_bench_cli_reports_every_figure(tiny, tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["bench", str(tiny), "--limit", "12", "--kv-cache-memory", "16MiB",
                                  "--json", str(out), "--arrival-rate", "50", "--prefix-ttft", "64"])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["requests"] == 12 and not res["errors"] and res["config"]["arrival_rate"] == 50
    kv = res["kv"]
    # paged blocks waste at most the tail of each sequence's last block; contiguous
    # reservations of the whole context (1024) or of prompt + max_tokens waste more
    assert kv["mean_waste"] < kv["contiguous_exact_mean_waste"] < kv["contiguous_max_len_mean_waste"]
    t = res["time_s"]
    assert 0 < t["model"] < t["steps"] and 0 < t["outside_model_share_of_step"] < 1
    p = res["prefix_ttft"]
    assert p["with_prefix_caching"]["cached_prompt_tokens"] == [64] * 3  # 16 full blocks of 4
    assert p["without_prefix_caching"]["cached_prompt_tokens"] == [0] * 3


def test_arrivals_are_seeded_poisson():
    a = arrival_times(1000, 10.0, seed=1)
    assert a == arrival_times(1000, 10.0, seed=1) and a == sorted(a)
    assert 80 < a[-1] < 120  # 1000 arrivals at 10/s
    assert arrival_times(3, None, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError):
        arrival_times(3, -1.0, 0)


def test_prefix_test_longer_than_the_context_is_refused(tiny):
    with pytest.raises(ConfigError, match="context"):
        prefix_ttft(tiny, EngineConfig(), prefix_len=1000)
