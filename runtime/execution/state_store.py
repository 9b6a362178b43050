"""The recurrent state pools of a hybrid build (gated DeltaNet or short-conv layers: kvexport/io.py
"Recurrent state"): per linear layer one conv-state and one delta-rule-state array of `num_slots` rows
(an LFM2 short-conv layer: the conv state's alone), in host memory beside the KV pools. The scheduler
side hands out the row numbers (runtime/core/state_pool.py); this side holds the numbers' contents,
feeds the graphs the pools and the step's slots, stores the states a step returns, and copies slots
(prefix-cache checkpoints).

NOTE: like the `onnx` attention's KV, a step's graphs read the pools and return the new states; the
backend stores them only after the call succeeded, so a step that fails (and is re-run in halves by
the model runner to find the culprit) leaves every slot as it was.
"""

from __future__ import annotations

import numpy as np

from kvexport import io

DEFAULT_SLOTS = 16  # rows made at first; the arrays grow when a step names a higher slot


class StateStore:
    """The state pools of one build, `io.state_names` order."""

    def __init__(self, num_linear: int, dims: io.StateDims, num_slots: int = DEFAULT_SLOTS):
        self.num_linear, self.dims = num_linear, dims
        self.names = io.state_names(num_linear, dims.recurrent)
        self.out_names = io.new_state_names(num_linear, dims.recurrent)
        self.pools = [np.zeros((num_slots, *s), np.float32) for s in dims.shapes * num_linear]

    @classmethod
    def for_model(cls, model_spec: dict, num_slots: int = DEFAULT_SLOTS) -> "StateStore | None":
        """The store of a build whose manifest model spec has linear layers, else None."""
        found = io.state_dims(model_spec)
        return cls(*found, num_slots=num_slots) if found is not None else None

    @property
    def num_slots(self) -> int:
        return self.pools[0].shape[0]

    @property
    def bytes_per_slot(self) -> int:
        """io.state_bytes_per_sequence: what one slot holds."""
        return io.state_bytes_per_sequence(self.num_linear, self.dims)

    def reserve(self, num_slots: int) -> None:
        """At least `num_slots` rows (new rows zero; existing ones kept)."""
        if num_slots > self.num_slots:
            grow = max(num_slots, 2 * self.num_slots) - self.num_slots
            self.pools = [np.concatenate([p, np.zeros((grow, *p.shape[1:]), p.dtype)]) for p in self.pools]

    def feeds(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """io.STATE_SLOTS and every state pool, for a step whose sequences read `slots` [S]."""
        if len(slots):
            self.reserve(int(slots.max()) + 1)
        return {io.STATE_SLOTS: slots, **dict(zip(self.names, self.pools))}

    def store(self, slots: np.ndarray, new_states) -> None:
        """pool[slots[s]] = new[s] for every pool (the step's outputs in `out_names` order).
        NOTE: distinct slots per step (one per sequence), so the assignment has no order to respect."""
        for pool, new in zip(self.pools, new_states):
            pool[slots] = new

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, shape) of one slot's row of each pool, in order: what `read` returns back to back."""
        return [(str(p.dtype), tuple(int(x) for x in p.shape[1:])) for p in self.pools]

    def read(self, slot: int) -> np.ndarray:
        """Slot `slot` of every pool, back to back (1-D uint8, a copy): a checkpoint's bytes for the
        KV tiers and the disaggregated hand-off (execution/kv_offload.py, io.STATE_GROUP)."""
        self.reserve(slot + 1)
        return np.concatenate([np.ascontiguousarray(p[slot]).reshape(-1).view(np.uint8) for p in self.pools])

    def write(self, slot: int, payload: np.ndarray) -> None:
        """Slot `slot` of every pool from `read`'s bytes (in place: the pools keep their arrays)."""
        self.reserve(slot + 1)
        at = 0
        for p in self.pools:
            n = p[slot].nbytes
            p[slot] = payload[at:at + n].view(p.dtype).reshape(p.shape[1:])
            at += n
        assert at == payload.size, "a payload holds exactly one slot of every pool"

    def copy(self, src: int, dst: int) -> None:
        """Slot dst holds what slot src holds (a prefix-cache checkpoint saved or restored)."""
        self.reserve(max(src, dst) + 1)
        for pool in self.pools:
            pool[dst] = pool[src]


def restore_checkpoints(store: StateStore | None, chunks) -> None:
    """Before a step's compute: each chunk resuming from a prefix-cache checkpoint gets its state
    (ScheduledRequest.state.restore_from) copied into its running slot."""
    for s in chunks:
        if store is not None and s.state is not None and s.state.restore_from is not None:
            store.copy(s.state.restore_from, s.state.slot)


def save_checkpoints(store: StateStore | None, chunks, failed) -> None:
    """After a step's compute: each chunk ending on a checkpoint boundary (state.save_to) has its
    new state copied there; chunks that failed (`failed`: request ids) save nothing."""
    for s in chunks:
        if store is not None and s.state is not None and s.state.save_to is not None and s.request_id not in failed:
            store.copy(s.state.slot, s.state.save_to)
