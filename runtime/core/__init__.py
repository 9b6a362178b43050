"""kvexport.runtime.core: the KV cache and the scheduler, no tensors.

BlockPool (block_pool.py: physical blocks, ref counts, free list, prefix hashes by
block_hash.py) -> one manager per cache spec (one attention group, kv_cache_manager.py; a full and a
local group, windowed_kv_cache_manager.py; a hybrid's recurrent state, state_manager.py over
state_pool.py) behind the KV cache coordinator (kv_cache_coordinator.py), the one object of the
Protocol (kv_cache_interface.py) -> Scheduler
(scheduler.py, over the requests of request.py) -> the step types (outputs.py) and the engine's
typed statistics (stats.py). The features the
scheduler serves are policies (policies.py: eviction, speculation, tier prefetch, shared prompts;
streaming.py; prompt_scores.py). memory.py sizes the pool; errors.py holds the KV protocol error.
kv_tiers.py indexes the host and disk tiers; kv_connector.py is the KV connector's scheduler side
(block ids and keys of every group, for whatever moves blocks: runtime/kv_connector.py)."""
