"""The figures of builds whose layers differ (issue 34): a gated DeltaNet hybrid (qwen3_5_text: 3 linear layers
without KV, 1 gated attention layer) and Gemma 4 (KV shared across layers, local and global layers of their own
KV shapes). The manifest's kv.bytes_per_token counts the layers that hold KV (the engine's sizing); the sample
inputs saved in a build are the graphs' own inputs (their pools, a hybrid's state pools) and run in
onnxruntime; `kvexport plan` counts a hybrid's weights layer by layer (the bytes the build stores) and its fit
gives each sequence its recurrent state beside its KV, with the engine's pools for the KV budget it reports."""

import dataclasses

import onnxruntime as ort
import pytest

from kvexport import io
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.plan import plan
from kvexport.exporter.samples import sample_feeds
from kvexport.manifest import load
from kvexport.runtime.config import EngineConfig
from testkit.builds import stored_tensors
from testkit.families import CASES_HYBRID


@pytest.fixture(scope="module")
def builds(hf_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-hybrid")
    opts = BuildOptions(block_size=4, max_seq_len=64, validate=False, attention=io.Attention.ONNX)
    hybrid = str(hf_folder("qwen3_5_text", **CASES_HYBRID["qwen3_5_text"]))
    return {"hybrid": build(hybrid, root / "hybrid", opts)[0],
            "hybrid-int4": build(hybrid, root / "hybrid-int4", dataclasses.replace(opts, weights="int4"))[0],
            "gemma4": build(str(hf_folder("gemma4_text")), root / "gemma4", opts)[0]}


def test_manifest_bytes_per_token_counts_the_layers_holding_kv(builds):
    from kvexport.runtime.engine import LLMEngine

    hybrid, gemma4 = load(builds["hybrid"]), load(builds["gemma4"])
    assert hybrid.kv.bytes_per_token == 2 * 2 * 16 * 4  # layer 3 only: K and V x 2 heads x 16 x fp32
    engine = LLMEngine(builds["hybrid"], EngineConfig(kv_cache_memory="1MiB", threads=1))
    assert engine.backend.num_blocks == 2**20 // (4 * hybrid.kv.bytes_per_token)  # the engine sizes by it
    # Gemma 4: layers 0, 1 (local: 2 KV heads x 16) and 2 (global: 1 KV head x 32) write KV; 3..5 read theirs
    kv_layers, dims = io.kv_layout(gemma4.model.spec, gemma4.kv.num_kv_heads, gemma4.kv.head_dim)
    assert kv_layers == (0, 1, 2) and dims[:3] == ((2, 16), (2, 16), (1, 32))
    assert gemma4.kv.bytes_per_token == 2 * (2 * 16 + 2 * 16 + 32) * 4


@pytest.mark.parametrize("name", ["hybrid", "gemma4"])
def test_samples_are_the_graphs_inputs_and_run(builds, name):
    m = load(builds[name])
    for phase in io.Phase:
        feeds = sample_feeds(m, phase)
        session = ort.InferenceSession(str(builds[name] / f"{phase.value}.onnx"), providers=["CPUExecutionProvider"])
        assert set(feeds) == {i.name for i in session.get_inputs()}
        logits = session.run([io.LOGITS], feeds)[0]
        assert logits.shape[-1] == m.model.vocab_size and (logits == logits).all()
    if name == "hybrid":
        assert feeds[io.STATE_SLOTS].tolist() == [0, 1] and feeds[io.recurrent_state(2)].shape == (2, 4, 8, 12)
        assert "key_cache.0" not in feeds and feeds["key_cache.3"].shape[0] == 2


@pytest.mark.parametrize("name", ["hybrid", "hybrid-int4"])
def test_weight_estimate_of_a_hybrid_is_the_bytes_it_stores(builds, name):
    """Linear layers: in_proj / out_proj matmuls, float32 conv taps, A, dt_bias and norm; the attention layer's
    q_proj holds its output gate: the estimate equals the parameters and the tensors in weights.data. int4: the
    attention and MLP matmuls are quantized, the linear layers' in_proj / out_proj stay float (as built)."""
    m = load(builds[name])
    stored = stored_tensors(builds[name])
    e = next(e for e in plan(str(builds[name])).weights if e.precision == (m.weights.precision or m.dtype))
    assert (e.parameters, e.bytes) == (m.weights.parameters, sum(stored.values()))


def test_the_fit_gives_each_sequence_its_state_and_the_engine_the_kv_budget(builds):
    from kvexport.runtime.engine import LLMEngine

    m = load(builds["hybrid"])
    state = 3 * (3 * 80 + 4 * 8 * 12) * 4
    checkpoints = EngineConfig().state_checkpoints
    budget, seqs = 1_000_000, 3
    p = plan(str(builds["hybrid"]), m.weights.bytes + budget, max_num_seqs=seqs, max_num_batched_tokens=16)
    own = next(f for f in p.fits if f.build)
    assert {f.layout for f in p.fits} == {"paged"}  # hybrids build paged only
    assert own.state_bytes == (checkpoints + seqs) * state
    assert own.kv_budget_bytes == budget - own.state_bytes
    engine = LLMEngine(builds["hybrid"], EngineConfig(kv_cache_memory=own.kv_budget_bytes, max_num_seqs=seqs,
                                                      max_num_batched_tokens=16, threads=1))
    assert own.num_blocks == engine.pool.num_blocks
    # without a sequence count: as many sequences of 64 tokens as their KV and state fit
    free = plan(str(builds["hybrid"]), m.weights.bytes + budget).fits[0]
    per_seq = 64 * m.kv.bytes_per_token + state
    assert free.max_seqs <= (budget - checkpoints * state) // per_seq < free.max_seqs + 2
    assert any("prefix-cache checkpoints" in n for n in p.notes)
