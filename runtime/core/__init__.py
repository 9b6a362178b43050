"""kvexport.runtime.core: the KV cache and the scheduler, no tensors.

BlockPool (block_pool.py: physical blocks, ref counts, free list, prefix hashes by
block_hash.py) -> KV cache managers behind one Protocol (kv_cache_interface.py: one group,
kv_cache_manager.py; a full and a local group, hybrid_kv_cache_manager.py) -> Scheduler
(scheduler.py) -> the step types (outputs.py). memory.py sizes the pool; errors.py holds
the KV protocol error."""
