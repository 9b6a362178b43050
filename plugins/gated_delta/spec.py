"""The `kvexport::GatedDeltaRule` op: the gated delta rule of a gated DeltaNet layer (Qwen3.5,
Qwen3-Next, OLMo-Hybrid) over packed variable-length sequences, each reading its recurrent state from the
state pool by slot — inputs, outputs, attributes, tolerances.

One spec, shared by every implementation (the float64 reference, the native CPU op, the Triton
kernel, the TensorRT plugin) and by the exporter's `--attention plugin` graphs of hybrid families
(exporter/linear_attention.py): one node per linear-attention layer, as PagedAttention is one node
per attention layer. Names shared with the other ops (domain, version) and the state I/O live in
`kvexport.io` ("Recurrent state").

Notation: Hk query/key heads, Hv value heads (a multiple of Hk: value head h reads q/k head
h // (Hv / Hk), transformers' repeat_interleave), Dk / Dv head dims.

Semantics (reference.py is the executable definition):

    for each sequence s with q_len = qsl[s+1] - qsl[s] new tokens and ctx = seq_lens[s] - q_len
    tokens before them:
      S = 0 if ctx == 0 (a fresh sequence, or one recomputed after preemption) else
          recurrent_state[state_slots[s]]                                   [Hv, Dk, Dv]
      for each new token t (in order), value head h, its q/k head c = h // (Hv / Hk):
          q = l2norm(query[t, c]) * scale;  k = l2norm(key[t, c])          (l2norm when use_qk_l2norm)
          S_h = exp(g[t, h]) * S_h
          delta = beta[t, h] * (value[t, h] - S_hᵀ k)                      [Dv]
          S_h = S_h + k ⊗ delta
          output[t, h] = S_hᵀ q                                            [Dv]
      new_recurrent_state[s] = S
    l2norm(x) = x / sqrt(sum(x²) + 1e-6) (transformers' / FLA's l2norm). Prefill implementations may
    run the chunked (WY / UT) form of the same rule; it equals the recurrence in exact arithmetic.

Inputs (in order)::

    0 query            [num_tokens, Hk, Dk]  float32 (float16 / bfloat16 on TensorRT) after the short conv
    1 key              [num_tokens, Hk, Dk]  same dtype
    2 value            [num_tokens, Hv, Dv]  same dtype
    3 g                [num_tokens, Hv]      float32: log decay (<= 0): -exp(A_log) * softplus(a + dt_bias)
    4 beta             [num_tokens, Hv]      float32: sigmoid(b), the update's strength (2 sigmoid(b), in
                                             [0, 2], for OLMo-Hybrid's linear_allow_neg_eigval)
    5 recurrent_state  [num_state_slots, Hv, Dk, Dv]  float32: the layer's state pool (io.recurrent_state(j))
    6 state_slots      [num_seqs] int64      each sequence's slot (io.STATE_SLOTS)
    7 seq_lens         [num_seqs] int64      tokens after this step (ctx = seq_lens - q_len; 0: zero state)
    8 query_start_loc  [num_seqs + 1] int64  cumulative new-token offsets (as PagedAttention's)

Outputs::

    0 output               [num_tokens, Hv, Dv]      query dtype
    1 new_recurrent_state  [num_seqs, Hv, Dk, Dv]    float32 (io.new_recurrent_state(j))

NOTE: the new state is an output, not written into the pool in place (unlike PagedAttention's
aliased KV pools): the runtime stores a step's new states only after the step succeeded
(runtime/execution/state_store.py), so a failed step — which the model runner re-runs in halves
to find the culprit — leaves every slot as it was, and prefix-cache checkpoint slots are never
touched by a graph. The state is Hv·Dk·Dv floats per sequence and layer, copied once per step:
small against the step's work (one pass over it per token).

NOTE: the causal short conv stays in standard ONNX before the node (exporter/linear_attention.py):
it is K multiply-adds per channel and token (elementwise, memory-bound: onnxruntime runs it at
memory speed), its state is the last K-1 inputs, which the graph gathers anyway; in the op it would
add a second state pool to every implementation for no measurable gain.

Attributes (per node): num_k_heads, num_v_heads, k_head_dim, v_head_dim, scale (the query scale,
Dk ** -0.5 for Qwen3.5 / Qwen3-Next), use_qk_l2norm (1: q and k are l2-normalised in the op).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvexport import io
from kvexport.errors import ConfigError

OP_TYPE = "GatedDeltaRule"
NAMESPACE = io.PLUGIN_DOMAIN  # "kvexport"; also the ONNX domain of the node
VERSION = io.PLUGIN_VERSION  # "1"
PLUGIN_ID = f"{NAMESPACE}::{OP_TYPE}"  # tensorrt.plugin id

INPUTS = ("query", "key", "value", "g", "beta", "recurrent_state", "state_slots", "seq_lens", "query_start_loc")
OUTPUTS = ("output", "new_recurrent_state")
NUM_INPUTS = 9
L2NORM_EPS = 1e-6  # transformers' / FLA's l2norm epsilon

ACT_DTYPES = ("float32", "float16", "bfloat16")

# max |implementation - reference| over outputs and new states, by activation dtype; the reference
# computes in float64, implementations carry the state in float32 (outputs of magnitude ~1, states
# of a few units after hundreds of tokens).
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}


@dataclass(frozen=True)
class GatedDeltaAttrs:
    """Attributes of one GatedDeltaRule node (one linear layer); also the TensorRT plugin's fields."""

    num_k_heads: int  # Hk: query/key heads
    num_v_heads: int  # Hv: value heads (a multiple of Hk)
    k_head_dim: int  # Dk, elements
    v_head_dim: int  # Dv, elements
    scale: float  # query scale after l2norm (Dk ** -0.5)
    use_qk_l2norm: int = 1  # 1: q, k l2-normalised in the op (transformers' use_qk_l2norm_in_kernel)

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GatedDeltaRule: {name} must be an integer >= 1, got {value!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(f"GatedDeltaRule: num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads "
                              f"({self.num_k_heads})")
        if not self.scale > 0:
            raise ConfigError(f"GatedDeltaRule: scale must be > 0, got {self.scale}")
        if self.use_qk_l2norm not in (0, 1):
            raise ConfigError(f"GatedDeltaRule: use_qk_l2norm must be 0 or 1, got {self.use_qk_l2norm!r}")

    @property
    def group(self) -> int:
        """Value heads per q/k head."""
        return self.num_v_heads // self.num_k_heads

    def state_shape(self, rows: int) -> tuple[int, int, int, int]:
        """[rows, Hv, Dk, Dv]: a state pool (rows = slots) or a step's new states (rows = sequences)."""
        return (rows, self.num_v_heads, self.k_head_dim, self.v_head_dim)

    def onnx_attributes(self) -> dict:
        """Attributes of the ONNX node (TensorRT's ONNX parser passes them to the plugin as
        fields; plugin_namespace / plugin_version select the registered plugin)."""
        d = asdict(self)
        d["plugin_namespace"] = NAMESPACE
        d["plugin_version"] = VERSION
        return d

    @classmethod
    def from_onnx_attributes(cls, attrs: dict) -> "GatedDeltaAttrs":
        known = {k: v for k, v in attrs.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def for_layer(cls, la) -> "GatedDeltaAttrs":
        """The attributes of a hybrid's linear layers (exporter.linear_attention.LinearAttnSpec);
        scale rounded to float32 as the ONNX attribute holds it."""
        import numpy as np

        return cls(la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim,
                   float(np.float32(la.k_head_dim ** -0.5)), 1)
