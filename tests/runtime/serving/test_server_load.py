"""A small version of bench/load_test.py: concurrent streaming requests to a live
`kvexport serve` (smollm2-135m, 127.0.0.1); none lost, none duplicated, each one a
complete completion."""


import pytest

from testkit.bench import script as bench_script  # noqa: E402



@pytest.fixture(scope="module")
def load_test():
    return bench_script("load_test")


@pytest.mark.slow
def test_concurrent_streams_none_lost_or_duplicated(load_test, smollm2_build, tmp_path):
    # max_num_seqs below the request count: some requests wait for a batch slot
    with load_test.served(smollm2_build, kv_cache_memory="64MiB", max_num_seqs=16, threads=2,
                          log_path=tmp_path / "serve.log") as base:
        report = load_test.run_load(base, n=24, max_tokens=6, timeout=240)
    assert report["problems"] == [] and report["completed"] == 24, report
    assert report["output_tokens"] == 24 * 6


def test_check_finds_lost_and_duplicated(load_test):
    good = {"index": 0, "ids": {"a"}, "text": "x", "finish_reasons": ["length"], "usage": {"completion_tokens": 2},
            "done": 1, "error": None}
    assert load_test.check([good], 1, 2) == []
    dup = dict(good, index=1)
    twice = dict(good, index=2, ids={"b"}, finish_reasons=["length", "length"], done=2)
    problems = load_test.check([good, dup, twice], 4, 2)
    assert any("lost" in p for p in problems) and any("also seen" in p for p in problems)
    assert any("finish reasons" in p for p in problems) and any("[DONE]" in p for p in problems)
