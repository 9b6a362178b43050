"""The Python API `LLM` over a real tiny build: used from several threads at once (generate
and stream, batched together, each caller getting exactly its own outputs), a list of
SamplingParams (one per prompt, as vLLM takes), and wrong argument types and a model source
refused at once with an error naming the argument."""

import threading

import pytest

from kvexport import LLM, SamplingParams
from kvexport.errors import KvExportError
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.config import EngineConfig

PROMPTS = [[1, 5, 9, 3], [7, 7, 2, 11, 40, 41, 42], [100, 3], [8, 8, 8], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def tiny(hf_folder, tmp_path_factory):
    out, _ = build(str(hf_folder("llama")), tmp_path_factory.mktemp("llm") / "tiny",
                   BuildOptions(max_seq_len=128, validate=False))
    return out


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, kv_cache_memory="1MiB", max_num_seqs=8)


def _ids(outs):
    return [o.token_ids for o in outs]


def test_generate_from_several_threads(llm):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = _ids(llm.generate(PROMPTS, params))
    threads, got, errors = 4, {}, []
    start = threading.Barrier(threads)

    def run(i):
        try:
            start.wait()
            for rep in range(3):
                mine = PROMPTS[i:] + PROMPTS[:i]
                got[(i, rep)] = (_ids(llm.generate(mine, params)), want[i:] + want[:i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    assert len(got) == threads * 3 and all(g == w for g, w in got.values())
    assert not llm.engine.has_unfinished() and llm.engine.stats().kv_blocks_used == 0


def test_stream_next_to_generate_in_another_thread(llm):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = _ids(llm.generate(PROMPTS, params))
    streamed, errors = {}, []

    def stream(i):
        try:
            outs = list(llm.stream(PROMPTS[i], params))
            streamed[i] = ([t for o in outs for t in o.new_token_ids], outs[-1].token_ids, outs[-1].finished)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    other = _ids(llm.generate(PROMPTS[2:], params))
    for t in ts:
        t.join(120)
    assert not errors, errors
    assert other == want[2:]
    for i in range(2):  # every step's new tokens reached the stream, whoever ran the step
        assert streamed[i] == (want[i], want[i], True)


def test_a_list_of_sampling_params_one_per_prompt(llm):
    outs = llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=k, ignore_eos=True) for k in (2, 5, 3)])
    assert [len(o.token_ids) for o in outs] == [2, 5, 3]
    n2 = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2, n=2, temperature=1.0, seed=1, ignore_eos=True),
                                    SamplingParams(max_tokens=4, ignore_eos=True)])
    assert [len(o.token_ids) for o in n2] == [2, 2, 4]  # n outputs per prompt, consecutively
    with pytest.raises(KvExportError, match=r"params: 2 SamplingParams for 3 prompt\(s\)"):
        llm.generate(PROMPTS[:3], [SamplingParams(), SamplingParams()])
    with pytest.raises(KvExportError, match="params must be a SamplingParams or a list of them"):
        llm.generate(PROMPTS[:2], [SamplingParams(), {"max_tokens": 3}])
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("call, msg", [
    (lambda llm: llm.generate(None), "prompts must be a string, token ids, chat messages or a list"),
    (lambda llm: llm.generate(5), "prompts must be"),
    (lambda llm: llm.generate([[1, 2], 5]), r"prompts\[1\] must be a string or a list of token ids"),
    (lambda llm: llm.generate([1, 2], "greedy"), "params must be a SamplingParams"),
    (lambda llm: llm.generate([1, 2], {"max_tokens": 3}), "params must be a SamplingParams"),
    (lambda llm: list(llm.stream([1, 2], 5)), "params must be a SamplingParams"),
    (lambda llm: list(llm.stream(None)), "prompt must be a string or a list of token ids"),
])
def test_wrong_argument_types_name_the_argument(llm, call, msg):
    with pytest.raises(KvExportError, match=msg):
        call(llm)
    assert not llm.engine.has_unfinished()


def test_wrong_constructor_arguments(tiny, hf_folder, tmp_path):
    for bad in (5, None, 3.5, ["x"]):
        with pytest.raises(KvExportError, match="build_dir must be the path of a kvexport build"):
            LLM(bad)
    with pytest.raises(KvExportError, match="config must be an EngineConfig"):
        LLM(tiny, {"kv_cache_memory": "1MiB"})
    with pytest.raises(KvExportError, match="not both"):
        LLM(tiny, EngineConfig(), threads=1)
    # a model source: say so, and how to build it (before: "run `kvexport build MODEL --out <the source>`")
    src = hf_folder("llama")
    with pytest.raises(KvExportError, match="is a model source") as e:
        LLM(src)
    assert f"kvexport build {src} --out BUILD" in str(e.value) and f"--out {src}`" not in str(e.value)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(KvExportError, match=r"GGUF file.*kvexport build"):
        LLM(gguf)
    with pytest.raises(KvExportError, match="is a model alias.*kvexport build smollm2-135m --out BUILD"):
        LLM("smollm2-135m")
