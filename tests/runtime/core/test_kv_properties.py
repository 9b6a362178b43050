"""Properties of the KV memory layers under random request traffic (hypothesis stateful
testing): add requests (prompts that often share prefixes), append tokens, fork, slide a
window, free; with prefix caching on and off.

The machine also simulates the KV itself: every slot holds (salt, tokens up to and
including its position), written when a token is "computed". So a prefix hit that maps
a request to the wrong block, or a write into a block someone else reads, shows up as a
content mismatch, not just as a bad count.

After every step:
- each block's ref count equals the number of requests whose table holds it, and a
  request holds a block at most once;
- a block held by two or more requests is full and computed in each of them, and is
  cached (or was shared by fork);
- free (uncached) + evictable (cached, unreferenced) + used = usable blocks, each
  counted independently from ref counts and keys;
- every computed position in reach of each request reads back its own KV.
At teardown, once every request is freed, every block is free or evictable and all of
them, never the pad block, can be handed out again.
"""

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvexport.io import PAD_BLOCK_ID
from kvexport.runtime.core.block_pool import BlockPool
from kvexport.runtime.core.kv_cache_manager import KVCacheManager

BS = 4
NUM_BLOCKS = 12  # 11 usable: small enough that allocations fail and evict often
WINDOW = 7
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 0, 0, 0, 0, 9], [5] * 12]
tokens_st = st.lists(st.integers(0, 5), max_size=9)

SETTINGS = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@dataclass
class Req:
    tokens: list[int]  # every token with KV computed (prompt, then output)
    salt: str | None
    first_needed: int = 0  # positions before this were released by the window


class KVMachine(RuleBasedStateMachine):
    caching = True

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BS, enable_prefix_caching=self.caching)
        self.m = KVCacheManager(self.pool)
        self.reqs: dict[str, Req] = {}
        self.kv: dict[int, tuple] = {}  # slot -> (salt, token prefix) the slot's KV stands for
        self.forked: set[int] = set()  # blocks shared by fork (may be uncached)
        self.next_id = 0

    # ---- helpers --------------------------------------------------------------------
    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _snapshot(self):
        p = self.pool
        return (
            p.num_free_blocks,
            p.num_evictable_blocks,
            [p.ref_count(b) for b in range(1, NUM_BLOCKS)],
            [p.block_hash(b) for b in range(1, NUM_BLOCKS)],
            {rid: (self.m.block_table(rid), self.m.num_slots(rid)) for rid in self.reqs},
        )

    def _compute(self, rid: str, start: int) -> None:
        """Write the KV of positions start..len(tokens)-1, then publish full blocks."""
        req = self.reqs[rid]
        n = len(req.tokens) - start
        for pos, slot in zip(range(start, len(req.tokens)), self.m.slot_mapping(rid, start, n)):
            block = slot // BS
            assert block != PAD_BLOCK_ID
            assert self.pool.ref_count(block) == 1, "writing into a shared block"
            assert self.pool.block_hash(block) is None, "writing into a cached block"
            self.kv[slot] = (req.salt, tuple(req.tokens[: pos + 1]))
        self.m.cache_blocks(rid, req.tokens, len(req.tokens))

    def _pick(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.reqs)))

    # ---- rules ------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), tail=tokens_st, salt=st.sampled_from([None, None, "s"]))
    def add(self, prefix, tail, salt):
        tokens = prefix + tail
        if not tokens:
            return
        computed = self.m.get_computed_blocks(tokens, salt)
        assert computed.num_computed_tokens < len(tokens)
        for pos in range(computed.num_computed_tokens):
            slot = computed.block_ids[pos // BS] * BS + pos % BS
            assert self.kv[slot] == (salt, tuple(tokens[: pos + 1])), "prefix hit with wrong KV"
        rid = self._new_id()
        before = self._snapshot()
        new = self.m.allocate_slots(rid, len(tokens) - computed.num_computed_tokens, computed_blocks=computed)
        if new is None:
            assert self._snapshot() == before and rid not in self.m
            return
        assert PAD_BLOCK_ID not in new
        self.reqs[rid] = Req(tokens=list(tokens), salt=salt)
        self._compute(rid, computed.num_computed_tokens)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 5), min_size=1, max_size=6))
    def append(self, data, new_tokens):
        rid = self._pick(data)
        before = self._snapshot()
        new = self.m.allocate_slots(rid, len(new_tokens))
        if new is None:
            assert self._snapshot() == before
            return
        assert PAD_BLOCK_ID not in new
        req = self.reqs[rid]
        start = len(req.tokens)
        req.tokens.extend(new_tokens)
        self._compute(rid, start)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def fork(self, data):
        parent_id = self._pick(data)
        parent = self.reqs[parent_id]
        child_id = self._new_id()
        shared = self.m.fork(parent_id, child_id)
        assert shared == len(parent.tokens) // BS * BS
        self.forked.update(b for b in self.m.block_table(child_id) if b != PAD_BLOCK_ID)
        self.reqs[child_id] = Req(parent.tokens[:shared], parent.salt, min(parent.first_needed, shared))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def slide_window(self, data):
        rid = self._pick(data)
        req = self.reqs[rid]
        released = self.m.free_outside_window(rid, len(req.tokens), WINDOW)
        assert PAD_BLOCK_ID not in released
        req.first_needed = max(req.first_needed, len(req.tokens) - WINDOW + 1)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = self._pick(data)
        self.m.free(rid)
        del self.reqs[rid]

    # ---- invariants -------------------------------------------------------------------
    @invariant()
    def ref_counts_equal_owners(self):
        owners = Counter()
        for rid, req in self.reqs.items():
            table = self.m.block_table(rid)
            held = [b for b in table if b != PAD_BLOCK_ID]
            assert len(held) == len(set(held)), "a request holds a block twice"
            assert len(table) == -(-len(req.tokens) // BS) and self.m.num_slots(rid) == len(req.tokens)
            owners.update(held)
            for i, b in enumerate(table):
                if b != PAD_BLOCK_ID:
                    assert (i + 1) * BS > req.first_needed, "a released block is still held"
        for b in range(1, NUM_BLOCKS):
            assert self.pool.ref_count(b) == owners[b]
        self.forked &= set(owners)
        for b, n in owners.items():
            if n > 1:
                assert self.pool.block_hash(b) is not None or b in self.forked
                for rid, req in self.reqs.items():
                    table = self.m.block_table(rid)
                    if b in table:
                        assert (table.index(b) + 1) * BS <= len(req.tokens), "a shared block is not full"

    @invariant()
    def counts_add_up(self):
        refs = [self.pool.ref_count(b) for b in range(1, NUM_BLOCKS)]
        keys = [self.pool.block_hash(b) for b in range(1, NUM_BLOCKS)]
        used = sum(r > 0 for r in refs)
        evictable = sum(r == 0 and k is not None for r, k in zip(refs, keys))
        free = sum(r == 0 and k is None for r, k in zip(refs, keys))
        assert used + evictable + free == NUM_BLOCKS - 1
        assert self.pool.num_used_blocks == used
        assert self.pool.num_evictable_blocks == evictable
        assert self.pool.num_free_blocks == free + evictable
        if not self.caching:
            assert evictable == 0

    @invariant()
    def kv_reads_back(self):
        for rid, req in self.reqs.items():
            start, end = req.first_needed, len(req.tokens)
            for pos, slot in zip(range(start, end), self.m.slot_mapping(rid, start, end - start)):
                assert self.kv[slot] == (req.salt, tuple(req.tokens[: pos + 1]))

    def teardown(self):
        for rid in list(self.reqs):
            self.m.free(rid)
        assert self.pool.num_used_blocks == 0
        assert self.pool.num_free_blocks == NUM_BLOCKS - 1
        everything = self.pool.get_new_blocks(NUM_BLOCKS - 1)
        assert sorted(everything) == list(range(1, NUM_BLOCKS))
        assert self.pool.get_new_blocks(1) is None


class KVMachineNoCaching(KVMachine):
    caching = False


TestKVWithPrefixCaching = KVMachine.TestCase
TestKVWithPrefixCaching.settings = SETTINGS
TestKVWithoutPrefixCaching = KVMachineNoCaching.TestCase
TestKVWithoutPrefixCaching.settings = SETTINGS
