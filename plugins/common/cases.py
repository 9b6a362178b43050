"""The paged metadata of a random ragged batch, for every op's `reference.make_case` (kernel tests,
the native ops' tests, the GPU checks): shuffled block tables with holes and an optional shared
prefix, seq_lens, query_start_loc and slot_mapping. The op's make_case draws the pools and the
step's tensors around it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    num_blocks: int  # blocks in the pool (block 0: the pad block, never in a table's used part)
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [S] int64: ctx_lens + q_lens
    query_start_loc: torch.Tensor  # [S + 1] int64
    slot_mapping: torch.Tensor  # [T] int64: pool slot of each new token

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def paged_batch(block_size: int, q_lens: list[int], ctx_lens: list[int], num_blocks: int | None,
                shared_prefix_blocks: int, gen: torch.Generator) -> PagedBatch:
    """Sequence s has ctx_lens[s] tokens already in the pool and q_lens[s] new ones. Block ids are
    shuffled (one torch.randperm of `gen`; tables have holes: unused ids in between); the first
    `shared_prefix_blocks` full blocks of every sequence are the same physical blocks (a shared
    prompt prefix, as prefix caching produces). num_blocks None: twice what the batch needs, + 3."""
    totals = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_per = [-(-t // block_size) for t in totals]
    shared = min([shared_prefix_blocks] + [c // block_size for c in ctx_lens]) if shared_prefix_blocks else 0
    need = 1 + shared + sum(b - shared for b in blocks_per)
    num_blocks = num_blocks or 2 * need + 3
    assert num_blocks >= need
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 = pad block
    shared_ids = [ids.pop() for _ in range(shared)]
    tables = torch.zeros((len(q_lens), max(blocks_per, default=0) + 1), dtype=torch.int64)
    for s, nb in enumerate(blocks_per):
        tables[s, :nb] = torch.tensor(shared_ids + [ids.pop() for _ in range(nb - shared)], dtype=torch.int64)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    slots = [int(tables[s, j // block_size]) * block_size + j % block_size
             for s, (c, q) in enumerate(zip(ctx_lens, q_lens)) for j in range(c, c + q)]
    return PagedBatch(num_blocks, tables, torch.tensor(totals, dtype=torch.int64),
                      torch.tensor(starts, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64))
