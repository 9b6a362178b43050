"""The engine's KV connector (runtime/kv_connector.py; its scheduler side runtime/core/kv_connector.py,
its worker side runtime/execution/kv_connector.py), the one seam KV blocks move through.

Scheduler side, on bare pools (block_size 4, local window 8; fresh pools hand out blocks 1, 2, ...):
the blocks of a prompt a lookup can use in each group (exact keys), allocation / publication /
release with exact block ids and `BlockStored` events per group, an allocation that evicts a
cached block saving it to the host tier first, persistence queuing every group's cached blocks
for the disk tier.

Both sides, on real engines of tiny builds (fp32; int8 KV; int4 KV: codes and in-row scales; a
hybrid gemma2 build: full and local groups; DeepSeek-V3 MLA: latent rows): a prompt's blocks
exported from one engine and imported into another arrive byte for byte in every group, under
the same keys (exact block ids, `BlockStored` events with parents and tokens), and are released;
`persist` writes every group's cached blocks to the disk tier."""

import numpy as np
import pytest

from kvexport import io
from kvexport.exporter.build import BuildOptions, build
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.core.block_hash import hash_full_blocks
from kvexport.runtime.core.block_pool import BlockPool, BlockStored
from kvexport.runtime.core.kv_connector import KVConnectorScheduler
from kvexport.runtime.core.kv_tiers import DISK, HOST, SaveBlock, TierIndex
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.execution import kv_disk
from kvexport.runtime.execution.kv_offload import block_tensors
from kvexport.runtime.kv_connector import BlockHold, BlockImport, BlockRef, KVUsage
from kvexport.runtime.sampling_params import SamplingParams

FULL, LOCAL = io.FULL_GROUP, io.LOCAL_GROUP
BS, W = 4, 8
TOKENS = list(range(100, 108))  # 2 full blocks
H = hash_full_blocks(TOKENS, BS)


def sched(full: int = 9, local: int = 7, tiers: TierIndex | None = None, hybrid: bool = True) -> KVConnectorScheduler:
    pools = {FULL: BlockPool(full, BS)}
    if hybrid:
        pools[LOCAL] = BlockPool(local, BS)
    return KVConnectorScheduler(pools, tiers, W if hybrid else None)


def publish_two(s: KVConnectorScheduler) -> tuple[list[int], list[int]]:
    """Both full blocks of TOKENS in the full group, the second in the local group; all held."""
    full, local = s.allocate(FULL, 2), s.allocate(LOCAL, 1)
    assert s.publish(FULL, full, H, parent_hashes=[None, H[0]], block_tokens=[TOKENS[:4], TOKENS[4:]]) == 2
    assert s.publish(LOCAL, local, H[1:], parent_hashes=[H[0]], block_tokens=[TOKENS[4:]]) == 1
    return full, local


# ---- scheduler side --------------------------------------------------------------------------
def test_prompt_blocks_name_each_groups_blocks_a_lookup_can_use():
    prompt = list(range(100, 123))  # 23 tokens: (23 - 1) // 4 = 5 full blocks; the last token is computed
    h = hash_full_blocks(prompt[:20], BS, "salt")
    full = [BlockRef(FULL, i, h[i]) for i in range(5)]
    # the next token (position 20) sees positions 13..20: local blocks 3 (12..15) and 4 (16..19)
    assert sched().prompt_blocks(prompt, "salt") == full + [BlockRef(LOCAL, 3, h[3]), BlockRef(LOCAL, 4, h[4])]
    assert sched(hybrid=False).prompt_blocks(prompt, "salt") == full
    assert sched().prompt_blocks(prompt[:4], "salt") == []  # 3 // 4 blocks
    assert [r.block_hash for r in sched().prompt_blocks(prompt)] != [r.block_hash for r in full + full[3:]]


def test_blocks_are_allocated_published_and_released_per_group():
    s = sched()
    s.record_events(LOCAL)
    full, local = publish_two(s)
    assert (full, local) == ([1, 2], [1])
    assert (s.cached(FULL, H[0]), s.cached(FULL, H[1]), s.cached(LOCAL, H[1]), s.cached(LOCAL, H[0])) == (1, 2, 1, None)
    assert s.pop_events(LOCAL) == [BlockStored(H[1], H[0], tuple(TOKENS[4:]))]
    assert s.pop_events(FULL) == []  # not recorded
    assert s.usage() == KVUsage(used_blocks=2, usable_blocks=8)  # the full group's
    holds = [BlockHold(FULL, full), BlockHold(LOCAL, local)]
    s.release(holds)
    assert holds == [] and s.usage() == KVUsage(0, 8)
    s.release(holds)  # a second release frees nothing
    assert s.pools[FULL].num_evictable_blocks == 2 and s.pools[LOCAL].num_evictable_blocks == 1  # cached still
    assert s.held([(FULL, H[0]), (LOCAL, H[0]), (LOCAL, H[1])]) == {(FULL, H[0]), (LOCAL, H[1])}
    assert s.allocate(LOCAL, 7) is None and s.pools[LOCAL].num_evictable_blocks == 1  # 6 usable: nothing taken
    assert s.take_ops() == ()  # no tiers


def test_an_allocation_that_evicts_a_cached_block_saves_it_to_the_host_tier_first():
    tiers = TierIndex({FULL: 100, LOCAL: 50}, host_bytes=1000, disk_bytes=0)
    s = sched(full=3, tiers=tiers)  # 2 usable full blocks
    full, local = publish_two(s)
    s.release([BlockHold(FULL, full), BlockHold(LOCAL, local)])
    assert s.allocate(FULL, 1) == [1]  # the least recently released cached block, evicted
    assert s.take_ops() == (SaveBlock(FULL, 1, H[0], HOST),)
    assert s.cached(FULL, H[0]) is None and s.held([(FULL, H[0]), (FULL, H[1])]) == {(FULL, H[0]), (FULL, H[1])}


def test_persist_queues_every_groups_cached_blocks_for_the_disk_tier():
    s = sched(tiers=TierIndex({FULL: 100, LOCAL: 50}, host_bytes=0, disk_bytes=10_000))
    publish_two(s)
    s.persist()
    assert s.take_ops() == (SaveBlock(FULL, 1, H[0], DISK), SaveBlock(FULL, 2, H[1], DISK),
                            SaveBlock(LOCAL, 1, H[1], DISK))
    s.persist()  # already on disk
    assert s.take_ops() == ()
    host_only = sched(tiers=TierIndex({FULL: 100, LOCAL: 50}, host_bytes=1000, disk_bytes=0))
    publish_two(host_only)
    host_only.persist()
    assert not host_only.disk_on and host_only.take_ops() == ()


# ---- both sides, real engines ------------------------------------------------------------------
CFG = dict(kv_cache_memory="64KiB", max_num_batched_tokens=64, max_num_seqs=2)
PROMPT = [3 + (i * 7) % 120 for i in range(23)]  # 5 full blocks of 4 (+3 tokens)


@pytest.fixture(scope="module")
def builds(hf_folder, tmp_path_factory):
    root, made = tmp_path_factory.mktemp("kv-connector"), {}
    onnx = dict(block_size=BS, max_seq_len=64, validate=False, attention=io.Attention.ONNX)
    llama = lambda **kw: str(hf_folder("llama", num_key_value_heads=2, **kw))  # noqa: E731
    makers = {
        "fp32": lambda: build(llama(), root / "fp32", BuildOptions(**onnx)),
        "int8": lambda: build(llama(), root / "int8", BuildOptions(**onnx, kv_dtype=io.DType.INT8)),
        "int4": lambda: build(llama(hidden_size=128, num_attention_heads=4), root / "int4",
                              BuildOptions(**onnx, kv_dtype=io.DType.INT4)),
        "gemma2": lambda: build(str(hf_folder("gemma2")), root / "g2", BuildOptions(**onnx)),
        "mla": lambda: build(str(hf_folder("deepseek_v3")), root / "mla", BuildOptions(**onnx)),
    }

    def get(name):
        if name not in made:
            made[name] = makers[name]()[0]
        return made[name]

    return get


def _prefilled(out, **kw) -> LLMEngine:
    eng = LLMEngine(out, EngineConfig(**CFG, **kw))
    rid = eng.add_request(list(PROMPT), SamplingParams(max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    eng.pop_output(rid)
    return eng


def _pool_bytes(eng: LLMEngine, group: str, block_id: int) -> np.ndarray:
    """The block as the backend's pools hold it (every tensor of the group sliced at the block)."""
    return np.concatenate([np.ascontiguousarray(t[:, block_id]).reshape(-1).view(np.uint8)
                           for g, t in block_tensors(eng.backend, eng.manifest) if g == group])


@pytest.mark.parametrize("name", ["fp32", "int8", "int4", "gemma2", "mla"])
def test_a_prompts_blocks_move_between_engines_byte_for_byte_in_every_group(builds, name):
    out = builds(name)
    src_engine = _prefilled(out)
    src = src_engine.kv_connector
    refs = src.prompt_blocks(PROMPT)
    h = hash_full_blocks(PROMPT[:20], BS)
    hybrid = name == "gemma2"
    assert src.groups == ((FULL, LOCAL) if hybrid else (FULL,))
    local = [BlockRef(LOCAL, i, h[i]) for i in (3, 4)] if hybrid else []  # window 8 (tiny gemma2) from position 20
    assert refs == [BlockRef(FULL, i, h[i]) for i in range(5)] + local
    exported, payload = src.export_blocks(refs)
    assert exported == refs and payload.dtype == np.uint8
    assert payload.nbytes == sum(src.block_bytes[r.group] for r in refs)
    # the payload is what the backend's pools hold, block by block
    assert np.array_equal(payload, np.concatenate([
        _pool_bytes(src_engine, r.group, src.scheduler.cached(r.group, r.block_hash)) for r in refs]))

    dst_engine = LLMEngine(out, EngineConfig(**CFG))
    dst = dst_engine.kv_connector
    dst.record_events()
    offsets = np.cumsum([0] + [src.block_bytes[r.group] for r in refs])
    blocks = [BlockImport(r.group, r.block_hash, h[r.block_index - 1] if r.block_index else None, int(off),
                          PROMPT[r.block_index * BS:(r.block_index + 1) * BS]) for r, off in zip(refs, offsets)]
    holds = dst.import_blocks(blocks, payload)
    assert holds == [BlockHold(FULL, [1, 2, 3, 4, 5])] + ([BlockHold(LOCAL, [1, 2])] if hybrid else [])
    assert dst.pop_events() == [BlockStored(h[i], h[i - 1] if i else None, tuple(PROMPT[i * BS:(i + 1) * BS]))
                                for i in range(5)]
    assert np.array_equal(dst.export_blocks(refs)[1], payload)  # every group, codes and scales alike
    assert dst.import_blocks(blocks, payload) == []  # held already: nothing written twice
    assert dst.usage().used_blocks == 5
    dst.release(holds)
    assert holds == [] and dst.usage().used_blocks == 0
    # the engine serves the prompt from the imported blocks
    rid = dst_engine.add_request(list(PROMPT), SamplingParams(max_tokens=1))
    while dst_engine.has_unfinished():
        dst_engine.step()
    assert dst_engine.pop_output(rid).num_cached_prompt_tokens == 20


def test_a_short_or_misplaced_hand_off_writes_nothing_and_leaks_no_block(builds):
    """Hostile trial on the KV seam (issue 48): a payload shorter than its blocks, or a block placed outside it
    (negative offset), is refused before anything is allocated. Before: the write failed on the short block after
    the group's fresh blocks were allocated, and they were never published nor freed (one leak per bad hand-off)."""
    from kvexport.runtime.serving.dynamo_disagg import _inline_ranges

    out = builds("fp32")
    src = _prefilled(out).kv_connector
    refs = src.prompt_blocks(PROMPT)
    _, payload = src.export_blocks(refs)
    h = hash_full_blocks(PROMPT[:20], BS)
    n = src.block_bytes[FULL]
    blocks = [BlockImport(FULL, r.block_hash, h[r.block_index - 1] if r.block_index else None, i * n,
                          PROMPT[r.block_index * BS:(r.block_index + 1) * BS]) for i, r in enumerate(refs)]
    dst = LLMEngine(out, EngineConfig(**CFG)).kv_connector
    for bad_payload, bad_blocks in ((payload[:-1], blocks), (payload, blocks[:-1] + [blocks[-1]._replace(offset=-n)])):
        with pytest.raises(ValueError, match="lies outside"):
            dst.import_blocks(bad_blocks, bad_payload)
        assert dst.usage().used_blocks == 0 and all(dst.scheduler.cached(FULL, r.block_hash) is None for r in refs)
    holds = dst.import_blocks(blocks, payload)  # the whole payload still goes in
    assert dst.usage().used_blocks == 5
    dst.release(holds)
    inline = __import__("base64").b64encode(bytes(range(16))).decode()
    assert _inline_ranges(inline, [(4, 4)]).tolist() == [4, 5, 6, 7]
    for bad in ([(-4, 4)], [(14, 4)]):
        with pytest.raises(ValueError, match="lies outside"):
            _inline_ranges(inline, bad)


def test_a_full_group_prefix_stops_at_its_first_missing_block(builds):
    src = _prefilled(builds("fp32")).kv_connector
    refs = src.prompt_blocks(PROMPT)
    other = BlockRef(FULL, 2, hash_full_blocks(list(range(12)), BS)[2])  # a key this engine never computed
    exported, payload = src.export_blocks(refs[:2] + [other] + refs[3:])
    assert exported == refs[:2] and payload.nbytes == 2 * src.block_bytes[FULL]


def test_persist_writes_every_groups_cached_blocks_to_the_disk_tier(builds, tmp_path):
    eng = _prefilled(builds("gemma2"), kv_offload_dir=str(tmp_path / "kv"))
    kv = eng.kv_connector
    cached = {(g, h) for g, pool in kv.scheduler.pools.items() for _, h in pool.cached_blocks()}
    assert {g for g, _ in cached} == {FULL, LOCAL}
    assert kv.persist(timeout_s=30)
    files = {p.name for p in (tmp_path / "kv" / kv_disk.BLOCKS).iterdir()}
    assert files == {f"{g}-{h.hex()}.kvb" for g, h in cached}
