"""Gated DeltaNet linear-attention layers (Qwen3.5, Qwen3-Next, OLMo-Hybrid): the spec a hybrid model's
config declares, one layer's weights, and the layer's subgraph in standard ONNX ops, with its recurrent
state as explicit graph I/O (kvexport/io.py "Recurrent state").

A hybrid interleaves these layers with full-attention layers (gated in Qwen) per `config.layer_types`
("linear_attention" / "full_attention"). The attention layers keep the paged KV cache; a linear
layer keeps, per sequence, a fixed-size state: the causal short convolution's last kernel - 1
inputs [K-1, conv_dim] and the delta rule's matrix per value head [Hv, Dk, Dv]. The runtime
holds them in a state pool (runtime/core/state_pool.py), one slot per running sequence.

The layer, as transformers' Qwen3_5GatedDeltaNet computes it::

    x ─> [qkv | z | b | a] = x @ W       (one matmul: Qwen3-Next's grouped qkvz/ba re-laid out, OLMo-Hybrid's
                                          separate q/k/v/g/b/a projections stacked; CHECKPOINT_LAYOUTS)
    qkv ─> causal depthwise conv (kernel K, the state's K-1 inputs first) ─> silu ─> q, k [Hk, Dk], v [Hv, Dv]
    q, k ─> l2norm; q × Dk^-0.5; repeat to Hv heads
    beta = sigmoid(b) × beta_scale (OLMo's allow_neg_eigval: 2); g = -exp(A_log) × softplus(a + dt_bias)  (log decay)
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S_{t-1}ᵀ k_t exp(g_t)))ᵀ;  o_t = S_tᵀ q_t   (per value head)
    o ─> RMSNorm(o) × w × silu(z) ─> out_proj     (the norm's eps: the model's, or the family's own: OLMo's 1e-5)

Two forms of the rule, per build (`--attention`): `plugin` emits one kvexport::GatedDeltaRule node per
linear layer (plugins/gated_delta/: the native CPU op, Triton kernel, TensorRT plugin), fed the packed
q, k, v, decay and beta after the conv and reading the state pool by slot itself; `onnx` writes the
rule in standard ops, as follows.
Prefill runs the chunked (WY / UT) form of the rule (transformers' torch_chunk_gated_delta_rule):
within a chunk of C tokens the updates are condensed by T = (I + L)^-1 (L: the strictly lower
k_beta·kᵀ decays), computed exactly as the product (I - L)(I + L²)(I + L⁴)... (L is nilpotent,
L^C = 0: six factors cover C <= 64), and an ONNX Loop scans the chunks carrying the state. The
decode graph (one token per sequence) runs the recurrent update directly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np
from onnx import TensorProto, helper

from kvexport import io
from kvexport.errors import ConfigError, UnsupportedModelError

LINEAR, FULL = "linear_attention", "full_attention"
CHUNK = 64  # tokens per chunk of the chunked rule (transformers' and FLA's chunk_size)
POW_STEPS = 6  # Neumann factors (I + X^(2^j)), j < 6: exact for chunks of up to 2^6 = 64 tokens
# config field -> LinearAttnSpec field
_FIELDS = {"linear_num_key_heads": "num_k_heads", "linear_num_value_heads": "num_v_heads",
           "linear_key_head_dim": "k_head_dim", "linear_value_head_dim": "v_head_dim",
           "linear_conv_kernel_dim": "conv_kernel"}


@dataclass(frozen=True, slots=True)
class LinearAttnSpec:
    """The gated DeltaNet layers of a hybrid model (ModelSpec.linear_attn)."""

    KIND: ClassVar[str] = "gated DeltaNet (linear attention)"  # for messages and `kvexport plan`'s note

    layers: tuple[int, ...]  # the linear-attention layers' indices, ascending; the others are full attention
    num_k_heads: int  # Hk: query/key heads
    num_v_heads: int  # Hv: value heads (a multiple of Hk; each q/k head serves Hv / Hk of them)
    k_head_dim: int  # Dk, elements
    v_head_dim: int  # Dv, elements
    conv_kernel: int  # K: the causal conv's taps; the conv state keeps K - 1 inputs
    # NOTE: the fields below are left out of to_json() at their defaults, so the manifests of builds made
    # before them (Qwen3.5, Qwen3-Next) stay byte-identical
    beta_scale: float = 1.0  # beta = sigmoid(b) × it: 2 lets the state's eigenvalues go negative (OLMo-Hybrid)
    norm_eps: float | None = None  # the gated RMSNorm's eps; None: the model's norm_eps (OLMo-Hybrid: 1e-5)

    def __post_init__(self) -> None:
        for name, cfg in {v: k for k, v in _FIELDS.items()}.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config field {cfg!r} must be a positive integer, got {value!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(f"config field 'linear_num_value_heads' ({self.num_v_heads}) must be a multiple of "
                              f"'linear_num_key_heads' ({self.num_k_heads}): inconsistent state dims")
        if self.conv_kernel < 2:
            raise ConfigError(f"config field 'linear_conv_kernel_dim' must be >= 2, got {self.conv_kernel}")
        if self.beta_scale not in (1.0, 2.0):
            raise ConfigError(f"linear_attn beta_scale must be 1 or 2 (linear_allow_neg_eigval), "
                              f"got {self.beta_scale!r}")
        if self.norm_eps is not None and not self.norm_eps > 0:
            raise ConfigError(f"linear_attn norm_eps must be > 0 or null, got {self.norm_eps!r}")

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: q, k (Hk × Dk each) and v (Hv × Dv)."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    def state_dims(self) -> io.StateDims:
        return io.StateDims(conv_width=self.conv_kernel - 1, conv_dim=self.conv_dim, num_v_heads=self.num_v_heads,
                            k_head_dim=self.k_head_dim, v_head_dim=self.v_head_dim)

    def matmul_shapes(self, hidden: int) -> list[tuple[int, int]]:
        """[K, N] of one linear layer's matmuls: in_proj (q | k | v | z | b | a) and out_proj."""
        v = self.num_v_heads * self.v_head_dim
        return [(hidden, self.conv_dim + v + 2 * self.num_v_heads), (v, hidden)]

    def float32_elements(self) -> int:
        """Elements of every linear layer's float32 tensors: conv taps [K, conv_dim], A and dt_bias [Hv], the
        gated norm's weight [Dv]."""
        return len(self.layers) * (self.conv_kernel * self.conv_dim + 2 * self.num_v_heads + self.v_head_dim)

    def bias_elements(self) -> int:
        """Elements of every linear layer's matmul biases: none."""
        return 0

    def to_json(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        for name, default in (("beta_scale", 1.0), ("norm_eps", None)):  # see the NOTE on the fields
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "LinearAttnSpec":
        return cls(**{**d, "layers": tuple(d["layers"])})


def read_linear_attn(config, layer_types: tuple[str, ...], beta_scale: float = 1.0,
                     norm_eps: float | None = None) -> LinearAttnSpec | None:
    """The linear-attention spec of a hybrid's config (None when no layer is linear), with the
    family's fixed beta scale and gated-norm eps (`Hybrid`). A `layer_types` entry other than
    linear_attention / full_attention is refused by name."""
    for t in layer_types:
        if t not in (LINEAR, FULL):
            raise UnsupportedModelError(f"config field 'layer_types' has {t!r}, which kvexport does not support in a "
                                        f"gated DeltaNet hybrid; supported values: {LINEAR}, {FULL}")
    layers = tuple(i for i, t in enumerate(layer_types) if t == LINEAR)
    if not layers:
        return None
    if len(layers) == len(layer_types):
        raise UnsupportedModelError("config field 'layer_types' lists no full_attention layer; kvexport needs at "
                                    "least one (a hybrid's attention layers hold the paged KV cache)")
    if (act := getattr(config, "hidden_act", "silu")) != "silu":
        raise UnsupportedModelError(f"config field 'hidden_act' is {act!r}; the gated DeltaNet conv supports silu")
    kw = {}
    for cfg, name in _FIELDS.items():
        value = getattr(config, cfg, None)
        if value is None:
            raise ConfigError(f"config field {cfg!r} is missing (gated DeltaNet layers)")
        kw[name] = value
    return LinearAttnSpec(layers=layers, beta_scale=beta_scale, norm_eps=norm_eps, **kw)


# ---- weights ---------------------------------------------------------------------------------
@dataclass(slots=True)
class LinearWeights:
    """One gated DeltaNet layer, matmul weights [in, out]."""

    in_w: np.ndarray  # [hidden, conv_dim + Hv*Dv + 2*Hv]: qkv | z | b | a
    conv_w: np.ndarray  # [K, conv_dim] float32: tap j multiplies the input K-1-j steps back (tap K-1: this token)
    a_neg: np.ndarray  # [Hv] float32: -exp(A_log)
    dt_bias: np.ndarray  # [Hv] float32
    norm_w: np.ndarray  # [Dv] float32 (the gated RMSNorm's weight, no offset)
    out_w: np.ndarray  # [Hv*Dv, hidden]


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """Checkpoint names (under model.layers.{i}.linear_attn.) of one way to store a linear layer."""

    in_proj: tuple[str, ...]  # projections whose rows, stacked in order, are q | k | v | z | b | a
    norm: str  # the gated RMSNorm
    out: str  # the output projection
    grouped: bool = False  # in_proj_qkvz / in_proj_ba grouped per key head (Qwen3-Next), re-laid out when read


# told apart by their first projection's name (a checkpoint holds exactly one of them)
CHECKPOINT_LAYOUTS = (
    CheckpointLayout(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "norm", "out_proj"),  # Qwen3.5
    CheckpointLayout(("in_proj_qkvz", "in_proj_ba"), "norm", "out_proj", grouped=True),  # Qwen3-Next
    CheckpointLayout(("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj"), "o_norm", "o_proj"),  # OLMo-Hybrid
)


def checkpoint_layout(sd: dict[str, Any], prefix: str) -> CheckpointLayout:
    """The layout of the linear layer under `prefix`, or ConfigError naming the weights looked for."""
    for lay in CHECKPOINT_LAYOUTS:
        if f"{prefix}{lay.in_proj[0]}.weight" in sd:
            return lay
    raise ConfigError(f"no linear-attention projection under {prefix}: looked for "
                      f"{', '.join(lay.in_proj[0] + '.weight' for lay in CHECKPOINT_LAYOUTS)}")


def read_weights(sd: dict[str, Any], prefix: str, la: LinearAttnSpec, np_: Any) -> LinearWeights:
    """Layer weights under `prefix` (model.layers.{i}.linear_attn.), in any of CHECKPOINT_LAYOUTS:
    Qwen3-Next's grouped in_proj_qkvz / in_proj_ba re-laid out to Qwen3.5's q | k | v | z | b | a,
    OLMo-Hybrid's q/k/v/g/b/a projections stacked in that order (its g_proj is the gate z)."""
    hk, hv, dk, dv = la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim
    lay = checkpoint_layout(sd, prefix)
    if lay.grouped:
        r = hv // hk
        qkvz = np_(sd[prefix + "in_proj_qkvz.weight"]).reshape(hk, 2 * dk + 2 * r * dv, -1)  # [Hk, per group, H]
        q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        ba = np_(sd[prefix + "in_proj_ba.weight"]).reshape(hk, 2 * r, -1)
        b, a = np.split(ba, [r], axis=1)
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731  [Hk * per group, H], head-major
        rows = [flat(q), flat(k), flat(v), flat(z), flat(b), flat(a)]
    else:
        rows = [np_(sd[f"{prefix}{n}.weight"]) for n in lay.in_proj]
    conv = np_(sd[prefix + "conv1d.weight"])  # [conv_dim, 1, K]
    if conv.shape != (la.conv_dim, 1, la.conv_kernel):
        raise ConfigError(f"weight {prefix}conv1d.weight is {list(conv.shape)}, but the config's linear_* fields "
                          f"give [{la.conv_dim}, 1, {la.conv_kernel}]: inconsistent state dims")
    return LinearWeights(
        in_w=np.ascontiguousarray(np.concatenate(rows, axis=0).T),
        conv_w=np.ascontiguousarray(conv[:, 0, :].T.astype(np.float32)),
        a_neg=-np.exp(np_(sd[prefix + "A_log"]).astype(np.float32)),
        dt_bias=np_(sd[prefix + "dt_bias"]).astype(np.float32),
        norm_w=np_(sd[f"{prefix}{lay.norm}.weight"]).astype(np.float32),
        out_w=np.ascontiguousarray(np_(sd[f"{prefix}{lay.out}.weight"]).T))


# ---- the graph -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LinearContext:
    """Index tensors shared by every linear layer of one graph (built once)."""

    gather_idx: str  # [S*L] int64: packed token of padded row (s, i) (clamped; pad rows read a real token)
    valid: str  # [S, L, 1] float32: 1 for real tokens, 0 for padding
    unpad_idx: str  # [T] int64: padded row s*L + i of packed token t
    last_idx: str  # [S, K-1, 1] int64: padded stream rows of each sequence's last K-1 conv inputs
    fresh: str  # [S, 1, 1] bool: the sequence starts at position 0 (its state starts at zero)
    pad_shape: str  # [S, L] int64 (1-D, 2 entries)
    chunks: str  # [N] int64 shape of the chunk count: L = N * C
    chunk: str  # scalar C


def context(g, la: LinearAttnSpec) -> LinearContext:
    """query_start_loc ──> per sequence its length q_len, its padded rows; L = C × ceil(Qmax / C),
    C = min(Qmax, 64) (a decode step pads nothing)."""
    b = g.b
    b.scope = "/linear_ctx"
    big = np.iinfo(np.int64).max
    q_start = b.op("Slice", io.QUERY_START_LOC, b.const([0]), b.const([-1]))  # [S]
    q_len = b.op("Sub", b.op("Slice", io.QUERY_START_LOC, b.const([1]), b.const([big])), q_start)  # [S]
    q_max = b.op("ReduceMax", q_len, keepdims=0)
    chunk = b.op("Min", q_max, b.const(CHUNK))  # scalar C
    n = b.op("Div", b.op("Add", q_max, b.op("Sub", chunk, b.const(1))), chunk)  # ceil(Qmax / C)
    length = b.op("Mul", n, chunk)  # L
    i = b.op("Range", b.const(0), length, b.const(1))  # [L]
    tok = b.op("Add", b.op("Unsqueeze", q_start, b.const([1])), i)  # [S, L]
    n_tok = b.op("Gather", b.op("Shape", io.INPUT_IDS), b.const(0), axis=0)
    gather_idx = b.op("Reshape", b.op("Min", tok, b.op("Sub", n_tok, b.const(1))), b.const([-1]))  # [S*L]
    valid = b.op("Less", i, b.op("Unsqueeze", q_len, b.const([1])))  # [S, L]
    valid = b.op("Unsqueeze", b.op("Cast", valid, to=TensorProto.FLOAT), b.const([2]))  # [S, L, 1]
    # packed token t of sequence s at offset t - q_start[s] -> padded row s * L + offset
    t = b.op("Range", b.const(0), n_tok, b.const(1))  # [T]
    q_end = b.op("Unsqueeze", b.op("Slice", io.QUERY_START_LOC, b.const([1]), b.const([big])), b.const([0]))  # [1, S]
    seq = b.op("ReduceSum", b.op("Cast", b.op("GreaterOrEqual", b.op("Unsqueeze", t, b.const([1])), q_end),
                                to=TensorProto.INT64), b.const([1]), keepdims=0)  # [T]
    unpad = b.op("Add", b.op("Mul", seq, length), b.op("Sub", t, b.op("Gather", q_start, seq, axis=0)))
    # the conv stream of sequence s is [state (K-1 rows) | L rows]; its last K-1 inputs end at row q_len + K-2
    last = b.op("Add", b.op("Unsqueeze", q_len, b.const([1])), b.const(np.arange(la.conv_kernel - 1)))  # [S, K-1]
    first_pos = b.op("Gather", io.POSITIONS, b.op("Min", q_start, b.op("Sub", n_tok, b.const(1))), axis=0)  # [S]
    fresh = b.op("Unsqueeze", b.op("Equal", first_pos, b.const(0)), b.const([1, 2]))  # [S, 1, 1]
    s = b.op("Gather", b.op("Shape", io.SEQ_LENS), b.const(0), axis=0)
    pad_shape = b.op("Concat", b.op("Unsqueeze", s, b.const([0])), b.op("Unsqueeze", length, b.const([0])), axis=0)
    return LinearContext(gather_idx, valid, unpad, b.op("Unsqueeze", last, b.const([2])), fresh, pad_shape,
                         b.op("Unsqueeze", n, b.const([0])), chunk)


def layer(g, i: int, j: int, lw: LinearWeights, hn: str, ctx: LinearContext,
          la: LinearAttnSpec) -> tuple[str, tuple[str, str]]:
    """Layer i (the j-th linear layer) on its normed input hn [T, hidden]: (output [T, hidden],
    (new conv state [S, K-1, conv_dim], new recurrent state [S, Hv, Dk, Dv]), float32)."""
    b = g.b
    b.scope = f"/layers.{i}/linear_attn"
    p = f"model.layers.{i}.linear_attn."
    hk, hv, dk, dv, cd = la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim, la.conv_dim
    proj = g.cast(g.linear(hn, g.matrix(p + "in_proj.weight", lw.in_w), None), g.act, "float32")  # [T, cd + Hv*Dv + 2Hv]
    qkv, z, bb, aa = b.op("Split", proj, b.const([cd, hv * dv, hv, hv]), axis=-1, outputs=4)
    packed_ba = (bb, aa)  # [T, Hv] each: the plugin node's beta / decay are computed packed
    # ---- pad [T, .] -> [S, L, .]
    padded = b.op("Gather", b.op("Concat", qkv, bb, aa, axis=-1), ctx.gather_idx, axis=0)  # [S*L, cd + 2Hv]
    padded = b.op("Reshape", padded, b.op("Concat", ctx.pad_shape, b.const([cd + 2 * hv]), axis=0))  # [S, L, .]
    qkv, bb, aa = b.op("Split", padded, b.const([cd, hv, hv]), axis=-1, outputs=3)
    # ---- the conv over [its state | this step's rows] ─> silu; its new state
    conv, new_conv = causal_conv(g, j, qkv, p + "conv", lw.conv_w, None, ctx, silu=True)
    if g.plugin:
        out, rec = _plugin_rule(g, j, p, conv, packed_ba, lw, ctx, la)  # [T, Hv, Dv], [S, Hv, Dk, Dv]
        return _output_tail(g, p, out, z, lw, la), (new_conv, rec)
    q, k, v = b.op("Split", conv, b.const([hk * dk, hk * dk, hv * dv]), axis=-1, outputs=3)
    q, k = (_heads(g, _l2norm(g, b.op("Reshape", t, b.const([0, 0, hk, dk])), dk), hk, hv) for t in (q, k))
    q = b.op("Mul", q, b.const(dk ** -0.5, "float32"))  # [S, L, Hv, Dk]
    v = b.op("Reshape", v, b.const([0, 0, hv, dv]))  # [S, L, Hv, Dv]
    beta = b.op("Mul", _beta(g, bb, la), ctx.valid)  # [S, L, Hv]: 0 on pad rows (no update)
    sp = b.op("Softplus", b.op("Add", aa, g.f32(p + "dt_bias", lw.dt_bias)))
    decay = b.op("Mul", b.op("Mul", sp, g.f32(p + "A_neg", lw.a_neg)), ctx.valid)  # [S, L, Hv] log decay, 0 on pads
    rec0 = b.op("Gather", io.recurrent_state(j), io.STATE_SLOTS, axis=0)  # [S, Hv, Dk, Dv]
    rec0 = b.op("Where", b.op("Unsqueeze", ctx.fresh, b.const([3])), b.const(0.0, "float32"), rec0)
    tr = lambda t: b.op("Transpose", t, perm=[0, 2, 1, 3])  # noqa: E731  [S, L, Hv, D] -> [S, Hv, L, D]
    q, k, v = tr(q), tr(k), tr(v)
    beta, decay = (b.op("Transpose", t, perm=[0, 2, 1]) for t in (beta, decay))  # [S, Hv, L]
    if g.opts.phase is io.Phase.DECODE:
        out, rec = _recurrent_step(g, q, k, v, beta, decay, rec0)
    else:
        out, rec = _chunked(g, q, k, v, beta, decay, rec0, ctx, la)
    # ---- [S, Hv, L, Dv] ─> packed [T, Hv, Dv] ─> gated RMSNorm ─> out_proj
    out = b.op("Reshape", b.op("Transpose", out, perm=[0, 2, 1, 3]), b.const([-1, hv, dv]))  # [S*L, Hv, Dv]
    out = b.op("Gather", out, ctx.unpad_idx, axis=0)  # [T, Hv, Dv]
    return _output_tail(g, p, out, z, lw, la), (new_conv, rec)


def causal_conv(g, j: int, x: str, name: str, w: np.ndarray, bias: np.ndarray | None, ctx: LinearContext,
                silu: bool) -> tuple[str, str]:
    """The causal depthwise conv of state layer j on this step's padded rows x [S, L, cd] (float32), its
    state's K-1 inputs first (zero for a sequence that starts here), with the taps w [K, cd] and bias [cd]
    (or None) stored as float32 `name`.weight / .bias: (output [S, L, cd] (silu where asked), new conv state
    [S, K-1, cd]: the stream's last K-1 inputs). Shared by the gated DeltaNet layer (silu, no bias) and
    LFM2's short conv (exporter/short_conv.py: conv_bias, no activation).

        conv_state.{j}[state_slots] ─> Where(fresh, 0) ─┐
                                              x [S, L, cd] ─> Concat ─> stream [S, K-1+L, cd]
        out[t] = Σ_tap conv_w[tap] × stream[t + tap]         (conv_w [K, cd]; tap K-1: this token)
    """
    b = g.b
    kw, cd = w.shape
    conv0 = b.op("Gather", io.conv_state(j), io.STATE_SLOTS, axis=0)  # [S, K-1, cd]
    conv0 = b.op("Where", ctx.fresh, b.const(0.0, "float32"), conv0)
    stream = b.op("Concat", conv0, x, axis=1)  # [S, K-1+L, cd]
    conv_w = g.f32(name + ".weight", w)  # [K, cd]
    taps = b.op("Split", conv_w, b.const([1] * kw), axis=0, outputs=kw) if kw > 1 else [conv_w]
    length = b.op("Gather", ctx.pad_shape, b.const(1), axis=0)
    acc = None
    for tap in range(kw):  # out[t] = sum_j w[j] * stream[t + j]
        rows = b.op("Slice", stream, b.op("Unsqueeze", b.const(tap), b.const([0])),
                    b.op("Unsqueeze", b.op("Add", length, b.const(tap)), b.const([0])), b.const([1]))
        term = b.op("Mul", rows, taps[tap])
        acc = term if acc is None else b.op("Add", acc, term)
    if bias is not None:
        acc = b.op("Add", acc, g.f32(name + ".bias", bias))
    out = b.op("Mul", acc, b.op("Sigmoid", acc)) if silu else acc  # [S, L, cd]
    new_conv = b.op("GatherElements", stream, b.op("Expand", ctx.last_idx, b.op(
        "Concat", b.op("Slice", b.op("Shape", ctx.last_idx), b.const([0]), b.const([2])), b.const([cd]), axis=0)),
        axis=1)  # [S, K-1, cd]
    return out, new_conv


def _plugin_rule(g, j: int, p: str, conv: str, packed_ba: tuple[str, str], lw: LinearWeights,
                 ctx: LinearContext, la: LinearAttnSpec) -> tuple[str, str]:
    """The rule as one kvexport::GatedDeltaRule node (plugins/gated_delta/spec.py) on packed rows:

        conv [S, L, cd] ─> unpad ─> q, k [T, Hk, Dk], v [T, Hv, Dv]       (l2norm and q scale: in the node)
        b, a [T, Hv] ─> beta = sigmoid(b) × beta_scale, decay = -exp(A_log) softplus(a + dt_bias)
        recurrent_state.{j} (the pool), state_slots, seq_lens, query_start_loc ─> node ─> out [T, Hv, Dv],
                                                                                 new state [S, Hv, Dk, Dv]
    """
    from kvexport.plugins.gated_delta.spec import OP_TYPE, GatedDeltaAttrs

    b = g.b
    hk, hv, dk, dv, cd = la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim, la.conv_dim
    packed = b.op("Gather", b.op("Reshape", conv, b.const([-1, cd])), ctx.unpad_idx, axis=0)  # [T, cd]
    q, k, v = b.op("Split", packed, b.const([hk * dk, hk * dk, hv * dv]), axis=-1, outputs=3)
    q, k = (b.op("Reshape", t, b.const([0, hk, dk])) for t in (q, k))  # [T, Hk, Dk]
    v = b.op("Reshape", v, b.const([0, hv, dv]))  # [T, Hv, Dv]
    bb, aa = packed_ba
    beta = _beta(g, bb, la)  # [T, Hv]
    decay = b.op("Mul", b.op("Softplus", b.op("Add", aa, g.f32(p + "dt_bias", lw.dt_bias))),
                 g.f32(p + "A_neg", lw.a_neg))  # [T, Hv] log decay
    attrs = GatedDeltaAttrs.for_layer(la)
    out, rec = b.op(OP_TYPE, q, k, v, decay, beta, io.recurrent_state(j), io.STATE_SLOTS, io.SEQ_LENS,
                    io.QUERY_START_LOC, outputs=2, domain=io.PLUGIN_DOMAIN, name=f"{b.scope}/gated_delta",
                    **attrs.onnx_attributes())
    return out, rec


def _beta(g, bb: str, la: LinearAttnSpec) -> str:
    """sigmoid(b) [.., Hv], × 2 where the family lets the state's eigenvalues go negative (la.beta_scale)."""
    beta = g.b.op("Sigmoid", bb)
    return beta if la.beta_scale == 1.0 else g.b.op("Mul", beta, g.b.const(la.beta_scale, "float32"))


def _output_tail(g, p: str, out: str, z: str, lw: LinearWeights, la: LinearAttnSpec) -> str:
    """out [T, Hv, Dv] ─> gated RMSNorm (× silu(z)) ─> out_proj ─> [T, hidden]."""
    b = g.b
    hv, dv = la.num_v_heads, la.v_head_dim
    eps = la.norm_eps if la.norm_eps is not None else g.spec.norm_eps
    var = b.op("ReduceMean", b.op("Mul", out, out), b.const([-1]), keepdims=1)
    out = b.op("Div", out, b.op("Sqrt", b.op("Add", var, b.const(eps, "float32"))))
    out = b.op("Mul", out, g.f32(p + "norm.weight", lw.norm_w))
    z = b.op("Reshape", z, b.const([0, hv, dv]))
    out = b.op("Mul", out, b.op("Mul", z, b.op("Sigmoid", z)))  # [T, Hv, Dv]
    out = g.cast(b.op("Reshape", out, b.const([0, hv * dv])), "float32", g.act)
    return g.linear(out, g.matrix(p + "out_proj.weight", lw.out_w), None)


def _l2norm(g, x: str, d: int) -> str:
    """x / sqrt(sum(x²) + 1e-6) over the last axis (transformers' l2norm, FLA's eps)."""
    b = g.b
    ss = b.op("ReduceSum", b.op("Mul", x, x), b.const([-1]), keepdims=1)
    return b.op("Div", x, b.op("Sqrt", b.op("Add", ss, b.const(1e-6, "float32"))))


def _heads(g, x: str, hk: int, hv: int) -> str:
    """[S, L, Hk, D] -> [S, L, Hv, D]: each q/k head repeated for its Hv / Hk value heads (repeat_interleave)."""
    if hk == hv:
        return x
    b = g.b
    x = b.op("Unsqueeze", x, b.const([3]))  # [S, L, Hk, 1, D]
    x = b.op("Expand", x, b.const([1, 1, 1, hv // hk, 1]))
    return b.op("Reshape", x, b.const([0, 0, hv, -1]))


def _recurrent_step(g, q, k, v, beta, decay, state) -> tuple[str, str]:
    """One token per sequence (L = 1): the recurrent rule on [S, Hv, 1, D] rows.

        S' = S × exp(g);  delta = (v - kᵀS') × beta;  S'' = S' + k ⊗ delta;  o = qᵀ S''
    """
    b = g.b
    s0 = b.op("Mul", state, b.op("Unsqueeze", b.op("Exp", decay), b.const([3])))  # [S, Hv, Dk, Dv]
    kv_mem = b.op("MatMul", k, s0)  # [S, Hv, 1, Dv]
    delta = b.op("Mul", b.op("Sub", v, kv_mem), b.op("Unsqueeze", beta, b.const([3])))  # [S, Hv, 1, Dv]
    s1 = b.op("Add", s0, b.op("MatMul", b.op("Transpose", k, perm=[0, 1, 3, 2]), delta))  # [S, Hv, Dk, Dv]
    return b.op("MatMul", q, s1), s1  # [S, Hv, 1, Dv]


def _chunked(g, q, k, v, beta, decay, state, ctx: LinearContext, la: LinearAttnSpec):
    """The chunked gated delta rule on [S, Hv, L, D] (L = N × C), carrying `state` [S, Hv, Dk, Dv]:

        per chunk (all at once, [S, Hv, N, C, .]):   cum = cumsum(g);  D_ij = exp(cum_i - cum_j) (i >= j)
            T = (I + strict_lower(k_beta kᵀ ∘ D))^-1             (product of Neumann factors)
            u = T v_beta;  w = T (k_beta ∘ exp(cum));  A = (q kᵀ) ∘ D
        Loop over chunks n (state S):  v_new = u_n - w_n S;  o_n = (q_n ∘ exp(cum)) S + A_n v_new
                                       S = S × exp(cum_last) + (k_n ∘ exp(cum_last - cum))ᵀ v_new
    """
    b = g.b
    hv, dk, dv = la.num_v_heads, la.k_head_dim, la.v_head_dim
    c = b.op("Unsqueeze", ctx.chunk, b.const([0]))  # [1]
    s = b.op("Gather", ctx.pad_shape, b.const([0]), axis=0)  # [1]
    shape5 = lambda d: b.op("Concat", s, b.const([hv]), ctx.chunks, c, b.const([d]), axis=0)  # noqa: E731
    shape4 = b.op("Concat", s, b.const([hv]), ctx.chunks, c, axis=0)
    q, k = (b.op("Reshape", t, shape5(dk)) for t in (q, k))  # [S, Hv, N, C, Dk]
    v = b.op("Reshape", v, shape5(dv))
    beta, decay = (b.op("Reshape", t, shape4) for t in (beta, decay))  # [S, Hv, N, C]
    k_beta = b.op("Mul", k, b.op("Unsqueeze", beta, b.const([4])))
    v_beta = b.op("Mul", v, b.op("Unsqueeze", beta, b.const([4])))
    cum = b.op("CumSum", decay, b.const(3))  # [S, Hv, N, C]
    diff = b.op("Sub", b.op("Unsqueeze", cum, b.const([4])), b.op("Unsqueeze", cum, b.const([3])))  # [.., C, C] i - j
    ci = b.op("Range", b.const(0), ctx.chunk, b.const(1))  # [C]
    lower = b.op("GreaterOrEqual", b.op("Unsqueeze", ci, b.const([1])), ci)  # [C, C] i >= j
    strict = b.op("Cast", b.op("Greater", b.op("Unsqueeze", ci, b.const([1])), ci), to=TensorProto.FLOAT)
    pair = b.op("Exp", b.op("Where", lower, diff, b.const(-np.inf, "float32")))  # [S, Hv, N, C, C]
    kt = b.op("Transpose", k, perm=[0, 1, 2, 4, 3])  # [.., Dk, C]
    x = b.op("Neg", b.op("Mul", b.op("Mul", b.op("MatMul", k_beta, kt), pair), strict))  # X = -L
    eye = b.op("Cast", b.op("Equal", b.op("Unsqueeze", ci, b.const([1])), ci), to=TensorProto.FLOAT)  # [C, C]
    t = b.op("Add", eye, x)
    for _ in range(POW_STEPS - 1):  # T = (I + X)(I + X²)(I + X⁴)...
        x = b.op("MatMul", x, x)
        t = b.op("Add", t, b.op("MatMul", t, x))
    ecum = b.op("Exp", cum)
    u = b.op("MatMul", t, v_beta)  # [.., C, Dv]
    w = b.op("MatMul", t, b.op("Mul", k_beta, b.op("Unsqueeze", ecum, b.const([4]))))  # [.., C, Dk]
    attn = b.op("Mul", b.op("MatMul", q, kt), pair)  # [.., C, C]
    q_dec = b.op("Mul", q, b.op("Unsqueeze", ecum, b.const([4])))
    last = b.op("Gather", cum, b.op("Sub", ctx.chunk, b.const(1)), axis=3)  # [S, Hv, N]
    k_dec = b.op("Mul", k, b.op("Unsqueeze", b.op("Exp", b.op("Sub", b.op("Unsqueeze", last, b.const([3])), cum)),
                                b.const([4])))
    k_dec_t = b.op("Transpose", k_dec, perm=[0, 1, 2, 4, 3])  # [.., Dk, C]
    chunk_decay = b.op("Unsqueeze", b.op("Exp", last), b.const([3, 4]))  # [S, Hv, N, 1, 1]
    # ---- the scan over chunks: an ONNX Loop whose body reads the tensors above by index
    scope = b.scope
    body = _LoopBody(f"{scope}/scan")
    it, state_in = body.input("n", TensorProto.INT64, []), body.input("state", TensorProto.FLOAT, None)
    pick = lambda name: body.op("Gather", name, it, axis=2)  # noqa: E731  (a scalar index drops the axis)
    v_new = body.op("Sub", pick(u), body.op("MatMul", pick(w), state_in))  # [S, Hv, C, Dv]
    o = body.op("Add", body.op("MatMul", pick(q_dec), state_in), body.op("MatMul", pick(attn), v_new))
    new_state = body.op("Add", body.op("Mul", state_in, pick(chunk_decay)), body.op("MatMul", pick(k_dec_t), v_new))
    graph = body.graph([body.op("Identity", body.const(True, "bool")), new_state, o])
    n_iter = b.op("Squeeze", ctx.chunks, b.const([0]))
    final, outs = b.op("Loop", n_iter, "", state, body=graph, outputs=2)  # outs [N, S, Hv, C, Dv]
    out = b.op("Transpose", outs, perm=[1, 2, 0, 3, 4])  # [S, Hv, N, C, Dv]
    out = b.op("Reshape", out, b.op("Concat", s, b.const([hv, -1, dv]), axis=0))  # [S, Hv, L, Dv]
    return out, final


class _LoopBody:
    """The body graph of an ONNX Loop (iteration number, one loop-carried tensor; it reads the
    outer graph's tensors by name, as ONNX subgraphs may)."""

    def __init__(self, name: str):
        self.name, self.nodes, self.inputs, self.consts, self._n = name, [], [], [], 0

    def input(self, name: str, elem: int, shape) -> str:
        full = f"{self.name}/{name}"
        self.inputs.append(helper.make_tensor_value_info(full, elem, shape))
        return full

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        self._n += 1
        out = f"{self.name}/{op_type}_{self._n}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def const(self, value, dtype: str = "int64") -> str:
        from onnx import numpy_helper

        self._n += 1
        name = f"{self.name}/const_{self._n}"
        self.nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            np.asarray(value, dtype=dtype), name)))
        return name

    def graph(self, outputs: list[str]):
        # the condition, the carried state, the scan output (shapes left to inference)
        cond_out, state_out, scan_out = outputs
        outs = [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
                helper.make_tensor_value_info(state_out, TensorProto.FLOAT, None),
                helper.make_tensor_value_info(scan_out, TensorProto.FLOAT, None)]
        cond_in = helper.make_tensor_value_info(f"{self.name}/cond", TensorProto.BOOL, [])
        return helper.make_graph(self.nodes, self.name.replace("/", "_"), [self.inputs[0], cond_in, self.inputs[1]],
                                 outs)


@dataclass(frozen=True, slots=True)
class Hybrid:
    """What a hybrid family's modeling code fixes beyond its config; `read_fields` is the family's
    Family.extra_fields."""

    name: str  # the family, for messages
    attn_output_gate: bool  # attention output × sigmoid(gate) from q_proj's second half (Qwen); False: none
    neg_eigval_field: str | None = None  # config bool: beta = 2 sigmoid(b) when true (OLMo's linear_allow_neg_eigval)
    norm_eps: float | None = None  # the gated RMSNorm's own eps; None: the config's rms_norm_eps (Qwen)

    def read_fields(self, config) -> dict:
        """The spec fields of a hybrid (`read_linear_attn` over config.layer_types) and its attention
        output gate; a config asking for what the family's code does not do is refused by name."""
        types = config_layer_types(config)
        if self.attn_output_gate and (gate := getattr(config, "attn_output_gate", True)) is not True:
            raise UnsupportedModelError(f"config field 'attn_output_gate' is {gate!r}; kvexport supports the gated "
                                        f"attention of {self.name} only (true)")
        scale = 1.0
        if self.neg_eigval_field is not None:
            allow = getattr(config, self.neg_eigval_field, True)  # NOTE: transformers' default is true
            if not isinstance(allow, bool):
                raise ConfigError(f"config field {self.neg_eigval_field!r} must be true or false, got {allow!r}")
            scale = 2.0 if allow else 1.0
        return {"linear_attn": read_linear_attn(config, types, scale, self.norm_eps),
                "attn_output_gate": self.attn_output_gate}


def config_layer_types(config) -> tuple[str, ...]:
    """config.layer_types of a hybrid: one entry per layer, else ConfigError naming the field."""
    types = getattr(config, "layer_types", None)
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(types, (list, tuple)) or len(types) != n:
        raise ConfigError(f"config field 'layer_types' must list one type for each of the {n} layers, got {types!r}")
    return tuple(types)


QWEN = Hybrid("Qwen3.5 / Qwen3-Next", attn_output_gate=True)
# OLMo-Hybrid: ungated OLMo-2 attention layers; FLA's gated-norm eps (1e-5, fixed in its modeling code)
OLMO_HYBRID = Hybrid("OLMo-Hybrid", attn_output_gate=False, neg_eigval_field="linear_allow_neg_eigval", norm_eps=1e-5)


def graph_io_fields(spec, opts) -> dict[str, Any]:
    """io.graph_io's kv_layers (the attention layers) and state for a hybrid spec ({} otherwise).
    A hybrid's graphs are paged, with the `onnx` attention or the plugin nodes (PagedAttention for the
    attention layers, GatedDeltaRule for the linear ones); the contiguous layout is refused by name.
    Its KV may be any form (exporter/kv_forms.py): only the attention layers hold KV, so int8 scales
    and the int4 key transform are calibrated for them alone (a row per layer of spec.kv_layers,
    exporter/calibrate.py); the linear layers' recurrent state stays float32 whatever the KV."""
    la = spec.linear_attn  # NOTE: LFM2's short-conv layers too (exporter/short_conv.py ShortConvSpec)
    if la is None:
        return {}
    if opts.layout is not io.KVLayout.PAGED:
        raise UnsupportedModelError(f"--layout {opts.layout.value} is not supported for a {spec.model_type} model "
                                    f"({la.KIND} layers: recurrent state is paged-layout graph I/O); build "
                                    f"with --layout paged")
    return {"kv_layers": spec.kv_layers, "state": (len(la.layers), la.state_dims())}

