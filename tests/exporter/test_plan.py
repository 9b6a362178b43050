"""`kvexport plan` (exporter/plan.py) against figures worked by hand: Llama-3-70B (GQA, full
attention), a Gemma-3-1b-shaped config (22 windowed + 4 full layers: two KV cache groups) and
Mistral-7B with a 4096-token window (one group, freed behind the window), all from bare
config.json files (no weights); then the plan and the engine on real tiny builds: the same
pools, block for block, and weight estimates equal to the bytes a build stores."""

import dataclasses
import json

import pytest

from kvexport import io
from kvexport.errors import ConfigError, SourceError, UnsupportedModelError
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.plan import plan
from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.windowed_kv_cache_manager import windowed_manager
from kvexport.runtime.core.kv_cache_manager import KVCacheManager

GiB = 2**30
LLAMA3_70B = dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192,
                  rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)
# gemma-3-1b's shape: every 6th layer full attention (layers 5, 11, 17, 23), the rest window 512
GEMMA3_1B = dict(model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=256, intermediate_size=6912, vocab_size=262144,
                 max_position_embeddings=32768, sliding_window=512, sliding_window_pattern=6, rope_theta=1e6,
                 rope_local_base_freq=1e4, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
MISTRAL_7B = dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
                  sliding_window=4096, rope_theta=1e4, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)


def _config(tmp_path, cfg: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def _fit(p, kv_dtype: str, layout: str = "paged"):
    return next(f for f in p.fits if (f.kv_dtype, f.layout) == (kv_dtype, layout))


def test_llama3_70b_kv_bytes_and_weights_by_hand(tmp_path):
    p = plan(str(_config(tmp_path, LLAMA3_70B)))
    kv = {k.kv_dtype: k for k in p.kv}
    # 2 (K, V) x 80 layers x 8 KV heads x 128 x 2 bytes = 327,680 = 320 KiB per token (64 heads: GQA 8:1)
    assert kv["fp16"].bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680 == 320 * 1024
    assert [(g.group, g.layers, g.window) for g in kv["fp16"].groups] == [("full", 80, None)]
    assert (kv["fp32"].bytes_per_token, kv["int8"].bytes_per_token) == (655_360, 163_840)
    # int8: static scales [8, 128] float32 for K and V of 80 layers, outside the pool
    assert (kv["int8"].static_bytes, kv["fp16"].static_bytes) == (2 * 80 * 8 * 128 * 4, 0) == (655_360, 0)
    assert p.attention == "GQA" and p.max_model_len == 8192
    # per layer: qkv 8192 x (64 + 2 x 8) x 128 = 83,886,080; o 8192 x 8192 = 67,108,864;
    # gate/up/down 3 x 8192 x 28672 = 704,643,072; 2 norms 16,384 -> 855,654,400 x 80 = 68,452,352,000;
    # untied embeddings and head 2 x 128256 x 8192 = 2,101,346,304; final norm 8,192
    w = {e.precision: e for e in p.weights}
    assert w["fp16"].parameters == 68_452_352_000 + 2_101_346_304 + 8_192 == 70_553_706_496
    norms = 80 * 2 * 8192 + 8192  # float32 in every build
    rope = 8192 * 128 * 4  # cos + sin [8192, 64] float32
    assert w["fp16"].bytes == (70_553_706_496 - norms) * 2 + norms * 4 + rope == 141_114_245_120
    # int4: matmul codes half a byte + a float32 scale per 32 rows of K (1/8 byte per weight);
    # embeddings and head int8 codes + scales (1 + 1/8 byte)
    matmul = 855_638_016 * 80
    assert w["int4"].bytes == matmul // 2 + matmul // 8 + 2_101_346_304 * 9 // 8 + norms * 4 + rope == 45_155_385_344
    # int8's default form is per output channel (exporter/limits.py DEFAULT_WEIGHT_FORM): codes + one float32
    # scale per column (N = 10240 + 8192 + 57344 + 8192 a layer); the head stays in int8 blocks of 32
    assert w["int8"].bytes == matmul + 80 * 83_968 * 4 + 2_101_346_304 * 9 // 8 + norms * 4 + rope == 70_851_395_584


def test_llama3_70b_on_24gib_and_80gib(tmp_path):
    cfg = str(_config(tmp_path, LLAMA3_70B))
    small = plan(cfg, "24GiB")
    assert small.weights_fit is False and small.fit_weights == "fp16"
    assert all(f.max_seqs == 0 and f.kv_budget_bytes == 0 for f in small.fits)
    assert "do not fit in 24.0 GiB; no weight precision does" in small.notes[0]  # int4 is 42.1 GiB
    big = plan(cfg, "80GiB", weights="int4", max_num_seqs=8)
    budget = 80 * GiB - 45_155_385_344
    assert big.weights_fit and _fit(big, "fp16").kv_budget_bytes == budget == 40_743_960_576
    # paged fp16: budget // (16 tokens x 327,680) = 7771 blocks (pad included); 8192 tokens = 512 blocks each
    f16 = _fit(big, "fp16")
    assert (f16.num_blocks, f16.max_seqs) == (7771, 15) and (7771 - 1) // 512 == 15
    assert (f16.max_context, f16.context_limit) == (8192, "model")  # 8 x 8192 tokens fit: the model's limit
    f32 = _fit(big, "fp32")  # 3885 blocks: 8 sequences of 3884 // 8 = 485 blocks = 7760 tokens
    assert (f32.num_blocks, f32.max_seqs, f32.max_context, f32.context_limit) == (3885, 7, 7760, "memory")
    i8 = _fit(big, "int8")  # the scales come off the budget first
    assert (i8.kv_budget_bytes, i8.num_blocks, i8.max_seqs) == (budget - 655_360, 15_542, 30)
    assert _fit(big, "fp16", "contiguous").max_seqs == budget // (8192 * 327_680) == 15


def test_gemma3_local_and_global_groups_by_hand(tmp_path):
    p = plan(str(_config(tmp_path, GEMMA3_1B)), max_model_len=8192)
    assert p.attention == "MQA"
    assert p.layer_windows == tuple(None if i % 6 == 5 else 512 for i in range(26))
    kv = {k.kv_dtype: k for k in p.kv}["fp16"]
    # 22 windowed layers x 2 x 1 KV head x 256 x 2 bytes; 4 full layers likewise
    assert [(g.group, g.layers, g.window, g.bytes_per_token) for g in kv.groups] == [
        ("local", 22, 512, 22_528), ("full", 4, None, 4_096)]
    assert kv.bytes_per_token == 26_624
    # tied: embeddings 262144 x 1152 = 301,989,888; per layer qkv 1152 x 6 x 256 = 1,769,472, o 1024 x 1152 =
    # 1,179,648, mlp 3 x 1152 x 6912 = 23,887,872, 4 norms + q/k norms 5,120 -> 26,842,112 x 26; final norm 1,152
    w = {e.precision: e for e in p.weights}["fp16"]
    assert w.parameters == 301_989_888 + 26 * 26_842_112 + 1_152 == 999_885_952
    norms = 26 * 5_120 + 1_152
    rope = 2 * 8192 * 256 * 4  # global and local RoPE tables
    assert w.bytes == (999_885_952 - norms) * 2 + norms * 4 + rope == 2_016_817_664

    # 1 GiB of KV: the engine's split for N sequences gives the local group 1 + 33 N + 32 blocks of 360,448 bytes
    # (window 512 = 32 blocks + 1, 512 batched tokens = 32 blocks) and the full group the rest in 65,536-byte blocks
    fit = plan(str(_config(tmp_path, GEMMA3_1B)), w.bytes + GiB, max_model_len=8192)
    f16 = _fit(fit, "fp16")
    assert f16.kv_budget_bytes == GiB
    # N = 23: local 792 blocks, full (2^30 - 792 x 360,448) // 65,536 = 12,028 >= 1 + 23 x 512; N = 24: 11,846 < 12,289
    assert (f16.max_seqs, f16.num_blocks, f16.local_num_blocks) == (23, 12_028, 792)
    assert _fit(fit, "fp16", "contiguous").max_seqs == GiB // (8192 * 26_624) == 4  # every layer, every token
    # the runtime's managers over those pools hold the 23 sequences: 512-token chunks, released behind the window
    m, sizes = windowed_manager(GiB, 16, 4_096, 22_528, 512, max_num_seqs=23, max_num_batched_tokens=512)
    assert (sizes.full_blocks, sizes.local_blocks) == (12_028, 792)
    for s in range(23):
        for done in range(0, 8192, 512):
            assert m.allocate_slots(f"s{s}", 512, m.get_computed_blocks([]) if done == 0 else None) is not None
            m.free_outside_window(f"s{s}", done + 512, 512)


def test_mistral_window_one_group_agrees_with_the_scheduler(tmp_path):
    cfg = str(_config(tmp_path, MISTRAL_7B))
    p = plan(cfg, max_model_len=16384)
    assert p.layer_windows == (4096,) * 32 and [(g.group, g.window) for g in p.kv[1].groups] == [("full", 4096)]
    assert p.kv[1].bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    w = {e.precision: e for e in p.weights}["fp16"]
    # embeddings + head 2 x 32000 x 4096; per layer 4096 x 6144 + 4096 x 4096 + 3 x 4096 x 14336 + 8192 norms
    assert w.parameters == 2 * 131_072_000 + 32 * 218_112_000 + 4096 == 7_241_732_096
    assert w.bytes == (7_241_732_096 - 266_240) * 2 + 266_240 * 4 + 16384 * 128 * 4 == 14_492_385_280
    # 4 GiB of fp16 KV: 2048 blocks of 16 tokens x 131,072 bytes (pad included), 2047 usable = 32,752 tokens
    fit = plan(cfg, w.bytes + 4 * GiB, max_model_len=16384, max_num_seqs=7)
    f16 = _fit(fit, "fp16")
    assert f16.num_blocks == 2048
    # blocks behind the window are freed: each sequence holds <= 256 + 1 blocks, plus 32 for a 512-token step:
    # 1 + 7 x 257 + 32 = 1832 <= 2048 (8: 2089 > 2048), where keeping every block would hold 2047 // 1024 = 1
    assert f16.max_seqs == 7
    # ... and 7 sequences may grow to the pool's 32,752 tokens: the scheduler caps any sequence at the pool
    assert (f16.max_context, f16.context_limit) == (32_752, "memory")
    assert _fit(plan(cfg, w.bytes + 4 * GiB, max_model_len=16384, max_num_seqs=8), "fp16").max_context == 4080
    assert _fit(plan(cfg, w.bytes + 4 * GiB, max_model_len=32768), "fp16").max_seqs == 0  # > 32,752 tokens
    assert _fit(fit, "fp16", "contiguous").max_seqs == 4 * GiB // (16384 * 131_072) == 2
    # the runtime's manager over 2048 blocks serves the 7: 512-token chunks, freed behind the window
    kv = KVCacheManager(BlockPool(2048, 16))
    for s in range(7):
        for done in range(0, 16384, 512):
            assert kv.allocate_slots(f"s{s}", 512, kv.get_computed_blocks([]) if done == 0 else None) is not None
            kv.free_outside_window(f"s{s}", done + 512, 4096)


def test_a_folder_with_only_config_json_and_errors_name_what_to_fix(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    _config(folder, LLAMA3_70B)
    assert plan(str(folder)).kv[1].bytes_per_token == 327_680 and plan(str(folder)).source == "hf"
    with pytest.raises(SourceError, match="does not exist: give a build directory, a HF model folder"):
        plan(str(tmp_path / "nope"))
    with pytest.raises(SourceError, match="neither kvexport.json .* nor config.json"):
        plan(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="'model_type' is 'mamba'"):
        plan(str(_config(tmp_path, {"model_type": "mamba"}, "mamba.json")))
    with pytest.raises(ConfigError, match="--memory: size 'lots'"):
        plan(str(folder), "lots")
    with pytest.raises(ConfigError, match="--memory '0' is 0 bytes"):
        plan(str(folder), "0")
    with pytest.raises(ConfigError, match="--weights must be one of fp32, fp16, int8, int4"):
        plan(str(folder), "80GiB", weights="int2")


@pytest.fixture(scope="module")
def builds(hf_folder, tmp_path_factory):
    """Tiny paged builds: mistral with a window of 8 (one group), gemma3_text windowed + full (two),
    llama with int4 weights (blocks of 32, round-to-nearest)."""
    root = tmp_path_factory.mktemp("plan")
    opts = BuildOptions(block_size=4, max_seq_len=64, validate=False, attention=io.Attention.ONNX)
    return {"mistral": build(str(hf_folder("mistral", sliding_window=8)), root / "mistral", opts)[0],
            "gemma3": build(str(hf_folder("gemma3_text", layer_types=["sliding_attention", "full_attention"])),
                            root / "gemma3", opts)[0],
            "llama-int4": build(str(hf_folder("llama")), root / "llama-int4",
                                dataclasses.replace(opts, weights="int4"))[0]}


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_the_engine_and_the_plan_allocate_the_same_pools(builds, name):
    from kvexport.manifest import load
    from kvexport.runtime.engine import EngineConfig, LLMEngine

    m = load(builds[name])
    budget, seqs, step = 200_000, 3, 16
    p = plan(str(builds[name]), m.weights.bytes + budget, max_num_seqs=seqs, max_num_batched_tokens=step)
    own = next(f for f in p.fits if f.build)
    assert (own.kv_dtype, own.layout, own.kv_budget_bytes) == ("fp32", "paged", budget)
    settings = EngineConfig(kv_cache_memory=budget, max_num_seqs=seqs, max_num_batched_tokens=step, threads=1)
    engine = LLMEngine(builds[name], settings)
    assert own.num_blocks == engine.pool.num_blocks == engine.backend.num_blocks
    local = getattr(engine.kv.attention, "local_pool", None)  # the attention groups behind the coordinator
    assert own.local_num_blocks == (local.num_blocks if local is not None else None)
    assert (own.local_num_blocks is None) == (name == "mistral")
    assert (p.build_weights.precision, p.build_weights.bytes) == ("fp32", m.weights.bytes)


@pytest.mark.parametrize("name", ["mistral", "gemma3", "llama-int4"])
def test_weight_estimates_are_the_bytes_a_build_stores(builds, name):
    """The estimate of the build's own precision: its parameters exactly, and the bytes of every
    tensor in weights.data (the file adds only the 4 KiB alignment of each)."""
    from kvexport.manifest import load
    from testkit.builds import stored_tensors

    m = load(builds[name])
    stored = stored_tensors(builds[name])
    e = next(e for e in plan(str(builds[name])).weights if e.precision == (m.weights.precision or m.dtype))
    assert (e.parameters, e.bytes) == (m.weights.parameters, sum(stored.values()))
    assert e.bytes <= m.weights.bytes < e.bytes + 4096 * len(stored)
