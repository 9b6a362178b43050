"""Graphs that take LoRA adapters at serve time (`kvexport build --lora-max-rank R`, kvexport/io.py LORA_INDEX;
issue 44 step 2): two real PEFT 0.21 adapters (different ranks, targets, rsLoRA, an alpha pattern) packed into the
graph's factors (exporter/lora.py pack), one batch of three sequences under the base, adapter 1 and adapter 2: each
sequence's logits are transformers + peft's for its adapter within the fp32 bound. The build validates and serves
the base through the runtime (no slots loaded); packing and planning refuse what a build cannot take, by name.
NOTE: the runtime does not load adapters yet (serving flags, adapter-keyed prefix cache: the next step)."""

import importlib.util

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kvexport import LLM, SamplingParams, io
from kvexport.errors import ConfigError, SourceError
from kvexport.exporter import lora
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.validate import TOLERANCE

from testkit import lora_adapters, parity
from testkit.families import TINY

# NOTE: peft imports triton: imported while tests are collected, it would set triton up out of interpreter mode
# before tests/plugins/conftest.py asks for it (the Triton kernel tests then fail), so the tests import it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed (.[test])")


def make_adapter(folder, out, seed, **kw):
    """A real PEFT adapter (testkit) and what exporter/lora.py reads of it."""
    return lora_adapters.make_adapter(folder, out, seed, **kw), lora.read(out)


def run_prefill(build_dir, m, prompts: list[list[int]], slots: list[int], factors: dict) -> np.ndarray:
    """The prefill graph of an `onnx`-attention build on fresh sequences (empty pools), each token under its
    sequence's slot: the logits of each sequence's last token."""
    entry = m.graphs["prefill"]
    sess = ort.InferenceSession(str(build_dir / entry.file), providers=["CPUExecutionProvider"])
    bs = m.kv.block_size
    per_seq = max((len(p) + bs - 1) // bs for p in prompts)
    lens = [len(p) for p in prompts]
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tables = np.array([[1 + s * per_seq + j for j in range(per_seq)] for s in range(len(prompts))], np.int64)
    slot_map = np.concatenate([tables[s][np.arange(n) // bs] * bs + np.arange(n) % bs for s, n in enumerate(lens)])
    feeds = {io.INPUT_IDS: np.concatenate(prompts).astype(np.int64),
             io.POSITIONS: np.concatenate([np.arange(n) for n in lens]).astype(np.int64),
             io.QUERY_START_LOC: starts, io.SEQ_LENS: np.array(lens, np.int64), io.BLOCK_TABLES: tables,
             io.SLOT_MAPPING: slot_map.astype(np.int64), io.LOGITS_INDICES: starts[1:] - 1,
             io.OBSERVATION_LENS: np.zeros(len(prompts), np.int64),
             io.LORA_INDEX: np.concatenate([np.full(n, s, np.int64) for n, s in zip(lens, slots)]), **factors}
    for t in entry.inputs:
        if t.name not in feeds:  # a pool: [kv_heads, blocks, block_size, row]
            shape = [d if isinstance(d, int) else 1 + len(prompts) * per_seq for d in t.shape]
            feeds[t.name] = np.zeros(shape, np.dtype(t.dtype))
    return sess.run([io.LOGITS], feeds)[0]


@pytest.fixture(scope="module")
def lora_build(hf_folder, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    folder = hf_folder("llama")
    out, m = build(str(folder), d / "b", BuildOptions(max_seq_len=64, block_size=4, attention=io.Attention.ONNX,
                                                      lora_max_rank=8))
    return folder, out, m, d


def test_a_batch_under_base_and_two_adapters_gives_peft_logits(lora_build):
    folder, out, m, d = lora_build
    assert m.validation.passed, m.validation  # the runtime's backend fed the base (no slots)
    assert m.lora["max_rank"] == 8 and m.lora["targets"] == list(lora.ALL_TARGETS)
    ref1, a1 = make_adapter(folder, d / "a1", 1, r=4, lora_alpha=8, use_rslora=True,
                            target_modules=["q_proj", "v_proj", "down_proj"])
    ref2, a2 = make_adapter(folder, d / "a2", 2, r=8, lora_alpha=16, alpha_pattern={"o_proj": 4},
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"])
    prompts = parity.random_prompts(3, TINY["vocab_size"], 6, 14, seed=7)
    got = run_prefill(out, m, prompts, [-1, 0, 1], lora.pack(m.lora, [a1, a2]))
    with torch.no_grad(), ref1.disable_adapter():
        base = ref1(torch.tensor([prompts[0]])).logits[0, -1].numpy()
    with torch.no_grad():
        want = [base, ref1(torch.tensor([prompts[1]])).logits[0, -1].numpy(),
                ref2(torch.tensor([prompts[2]])).logits[0, -1].numpy()]
    for s in range(3):
        assert np.abs(got[s] - want[s]).max() <= TOLERANCE["fp32"], s
    with torch.no_grad(), ref2.disable_adapter():
        unadapted = ref2(torch.tensor([prompts[2]])).logits[0, -1].numpy()
    assert np.abs(want[2] - unadapted).max() > 100 * TOLERANCE["fp32"], "the adapter changes nothing: a weak test"
    # the same adapters in the other slots, one slot loaded twice: slots are independent
    got = run_prefill(out, m, prompts, [1, 1, 0], lora.pack(m.lora, [a2, a1]))
    assert np.abs(got[1] - want[1]).max() <= TOLERANCE["fp32"] and np.abs(got[2] - want[2]).max() <= TOLERANCE["fp32"]


def test_the_runtime_serves_the_base(lora_build):
    folder, out, m, _ = lora_build
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = parity.random_prompts(2, TINY["vocab_size"], 5, 12, seed=8)
    got = LLM(out).generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in got] == parity.hf_greedy(model, prompts, 5)


def test_packing_refuses_what_the_build_cannot_take(hf_folder, tmp_path):
    folder = hf_folder("llama")
    plan = lora.serve_plan(_spec(folder), 4, "q_proj,v_proj")
    _, big = make_adapter(folder, tmp_path / "big", 3, r=8, target_modules=["q_proj"])
    with pytest.raises(SourceError, match="--lora-max-rank 4"):
        lora.pack(plan, [big])
    _, other = make_adapter(folder, tmp_path / "o", 3, r=4, target_modules=["o_proj"])
    with pytest.raises(SourceError, match="rebuild with --lora-targets naming o_proj"):
        lora.pack(plan, [other])
    _, wide = make_adapter(hf_folder("llama", hidden_size=96), tmp_path / "w", 3, r=4, target_modules=["q_proj"])
    with pytest.raises(SourceError, match="another base"):
        lora.pack(plan, [wide])


def _spec(folder):
    from kvexport.exporter import source
    from kvexport.exporter.families import read_spec

    return read_spec(source.load_config(source.resolve(str(folder))))


@pytest.mark.parametrize("kw, words", [
    (dict(lora_targets="q_proj"), "--lora-targets needs --lora-max-rank"),
    (dict(lora_max_rank=8, layout=io.KVLayout.CONTIGUOUS), "--lora-max-rank needs --layout paged"),
    (dict(lora_max_rank=8, backend="tensorrt", dtype=io.DType.FP16), "--backend tensorrt: --lora-max-rank"),
    (dict(hidden_states="mtp", backend="tensorrt", dtype=io.DType.FP16), "--backend tensorrt: --hidden-states"),
])
def test_options_refused_together(kw, words):
    with pytest.raises(ConfigError, match=words):
        BuildOptions(**kw)


def test_plans_refused_by_name(hf_folder):
    with pytest.raises(ConfigError, match="not one of"):
        lora.serve_plan(_spec(hf_folder("llama")), 8, "q_proj,lm_head")
    moe = hf_folder("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=24)
    with pytest.raises(ConfigError, match="not supported for qwen3_moe"):
        lora.serve_plan(_spec(moe), 8, None)
