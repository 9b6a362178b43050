"""The contract between the model runner and the execution backends.

`ModelInput` is one step's packed batch as the paged graphs take it (kvexport/io.py names
the tensors); `Backend` is what the runner needs from an execution backend. Backends
(runtime/execution/ort_backends.py: onnxruntime variants; runtime/execution/trt_backend.py: TensorRT; the
factory is runtime/execution/backends.py) import this module and never each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvexport import io


@dataclass(frozen=True, slots=True)
class ModelInput:
    """One step of the packed batch, as the graphs' paged inputs want it."""

    token_ids: np.ndarray  # [T] int64, sequence after sequence
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [S+1] int64
    seq_lens: np.ndarray  # [S] int64, KV length after this step
    block_tables: np.ndarray  # [S, max_blocks] int64, padded with io.PAD_BLOCK_ID
    slot_mapping: np.ndarray  # [T] int64
    # other KV cache groups (hybrid builds, kvexport/io.py): (group, block_tables [S, max_blocks], slot_mapping [T])
    groups: tuple[tuple[str, np.ndarray, np.ndarray], ...] = ()
    # [L] int64, ascending: the packed rows whose logits the step returns (io.LOGITS_INDICES);
    # None: each sequence's last token (`last_rows`)
    logits_indices: np.ndarray | None = None
    # hybrid builds (kvexport/io.py "Recurrent state"): [S] int64, the state slot each sequence reads
    # and whose new state the backend stores; None: a build without recurrent state
    state_slots: np.ndarray | None = None
    # [S] int64: each sequence's last tokens whose attention the step returns (io.OBSERVATION_LENS,
    # importance eviction); None: none (zeros are fed to a graph that takes it)
    observation_lens: np.ndarray | None = None
    # [T] int64: each token's LoRA adapter slot (io.LORA_INDEX, runtime/lora.py); None: every token the base
    # model (a LoRA build's backend feeds -1)
    lora_index: np.ndarray | None = None

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == len(self.seq_lens)

    @property
    def phase(self) -> io.Phase:
        """Which graph runs this step: decode when every sequence has one new token."""
        return io.Phase.DECODE if self.is_decode else io.Phase.PREFILL

    def feeds(self) -> dict[str, np.ndarray]:
        """The graphs' metadata inputs by name (kvexport/io.py), int64 and contiguous."""
        feeds = {io.INPUT_IDS: self.token_ids, io.POSITIONS: self.positions,
                 io.QUERY_START_LOC: self.query_start_loc, io.SEQ_LENS: self.seq_lens,
                 io.BLOCK_TABLES: self.block_tables, io.SLOT_MAPPING: self.slot_mapping}
        for group, tables, slots in self.groups:
            feeds[io.block_tables(group)], feeds[io.slot_mapping(group)] = tables, slots
        feeds[io.LOGITS_INDICES] = self.rows()  # NOTE: a backend drops it for a graph without it
        if self.state_slots is not None:
            feeds[io.STATE_SLOTS] = self.state_slots
        feeds[io.OBSERVATION_LENS] = (self.observation_lens if self.observation_lens is not None
                                      else np.zeros(len(self.seq_lens), np.int64))  # likewise
        if self.lora_index is not None:  # NOTE: a LoRA build's backend feeds -1 (the base) when absent
            feeds[io.LORA_INDEX] = self.lora_index
        return feeds

    def last_rows(self) -> np.ndarray:
        """[S] int64: each sequence's last packed token."""
        return self.query_start_loc[1:] - 1

    def rows(self, all_tokens: bool = False) -> np.ndarray:
        """The rows whose logits the step returns: `logits_indices`, else every token's with
        `all_tokens`, else each sequence's last."""
        if self.logits_indices is not None:
            return self.logits_indices
        return np.arange(len(self.token_ids), dtype=np.int64) if all_tokens else self.last_rows()

    def group_slots(self, group: str) -> np.ndarray:
        """slot_mapping of a KV cache group (io.FULL_GROUP: `slot_mapping`)."""
        return next((slots for g, _, slots in self.groups if g == group), self.slot_mapping)


class Backend(Protocol):
    """What the model runner needs from an execution backend (onnxruntime, TensorRT)."""

    num_blocks: int  # blocks in each pool (of the full KV cache group), the pad block included
    groups: tuple[str, ...]  # KV cache groups besides the full one whose inputs the graphs take (io.LOCAL_GROUP)
    full_block_tables: bool  # plugin attention: tables cover this step's blocks too (kvexport/io.py)
    pads_queries: bool  # a call costs its longest query chunk times its sequences (`onnx` attention)
    attention_impl: str  # what runs the attention, for reports ("onnx", "plugin (native CPU op)", ...)

    def execute(self, inp: ModelInput, all_tokens: bool = False) -> np.ndarray:
        """Run one step; store its K/V in the pool; return logits [S, vocab] (float32): the
        last token of each sequence, or every token's [T, vocab] with `all_tokens` (an
        --all-logits build's prefill; perplexity), or with `inp.logits_indices` the rows it
        lists [L, vocab] (`select_rows`)."""
        ...


def select_rows(logits: np.ndarray, inp: ModelInput, all_tokens: bool, graph_rows: str) -> np.ndarray:
    """The rows `inp.rows(all_tokens)` asks for, from logits a graph returned: graph_rows
    "indices" (it took io.LOGITS_INDICES: already them), "tokens" (every token's: an --all-logits
    prefill graph) or "last" (each sequence's last token). A build that cannot return the rows
    asked for raises KvExportError (the runtime asks for more than last rows only of builds that
    carry them: Manifest.scores_prompts)."""
    from kvexport.errors import KvExportError

    if graph_rows == "indices":
        return logits
    want = inp.rows(all_tokens)
    if graph_rows == "tokens":
        return logits[want] if len(want) != len(inp.token_ids) else logits
    if len(want) == len(inp.seq_lens) and np.array_equal(want, inp.last_rows()):
        return logits
    raise KvExportError("this build's graphs return only each sequence's last logits; rows beyond those (speculative "
                        "drafts, prompt logprobs) need a build made with this kvexport (`kvexport build --force`)")
