"""Mixture-of-experts MLPs: the routing spec a family's config declares (`MoESpec`, read by
`read_moe` from the config fields a family's `MoEFields` names), the stacked expert weights of one
layer (`ExpertWeights`), and the ONNX subgraph of the MoE block (`moe_block`), in standard ops.

Routing forms (each exactly as transformers 5 computes it; tests/exporter/test_moe.py runs every
form against transformers' own MoE modules on random weights):

    scoring "softmax"       probs = softmax(logits)  ─> (group mask) ─> top-k of probs = the weights
                            (qwen3_moe, mixtral, qwen2_moe, deepseek_v2 greedy / group_limited_greedy)
    scoring "sigmoid"       scores = sigmoid(logits); choice = scores + e_score_correction_bias
                            ─> (group mask) ─> top-k of choice; weights = scores at those experts
                            (deepseek_v3 noaux_tc: the bias chooses experts, it is not a weight)
    scoring "topk_softmax"  top-k of logits (router bias included) ─> softmax over the k (gpt_oss)
    then: norm_topk_prob ─> w / (sum w + eps); × routed_scaling_factor

    groups "max"  (v2): group score = max prob of the group; experts of other groups get prob 0
    groups "top2" (v3): group score = sum of the group's 2 best choices; other groups' choice -inf

Experts: SwiGLU act(gate) * up with the spec's activation, or GPT-OSS's clamped form
(gate = min(gate, limit), up = clip(up, ±limit), out = (up + 1) * gate * sigmoid(alpha * gate)),
optional biases; shared experts are a dense SwiGLU MLP added to every token (deepseek:
n_shared_experts × moe_intermediate_size wide; qwen2_moe: scaled by sigmoid(x @ shared_expert_gate)).

The graph groups tokens per expert ("grouped", the default), so each expert's matmuls run once,
on the rows routed to it:

    x [N, H] ─> router (float32) ─> weights [N, k], experts [N, k] ─> flat [N*k]
      x repeated k times [N*k, H] (row t*k + j = token t)
      for e in experts:  rows = NonZero(flat == e) [1, n_e] ─> Gather [1, n_e, H] ─> up_e ─> act ─> down_e
      Concat (rows, outputs) ─> ScatterND into [N*k, H] ─> × weights [N*k, 1] ─> Reshape [N, k, H]
      ─> ReduceSum(k) ─> [N, H]

Each expert's matrices are their own initializers (model.layers.{i}.mlp.experts.{e}.up/down.weight),
so onnxruntime pre-packs them and a quantized build's DequantizeLinear ─> MatMul pairs fuse as for
dense layers. "dense" (every expert on every token, weights 0 where not routed) is kept for
measurement (bench/moe_speed.py) and for engines that want static shapes.

The subgraph functions take `g`, the exporter/graph.py DecoderGraph being built (graph.py imports
this module, so it is not imported here).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from kvexport.errors import ConfigError, UnsupportedModelError

SCORINGS = ("softmax", "sigmoid", "topk_softmax")
GROUP_SCORES = ("max", "top2")  # deepseek_v2 group_limited_greedy, deepseek_v3 noaux_tc
EXPERT_ACTIVATIONS = ("swiglu", "gpt_oss")  # act(gate) * up; GPT-OSS's clamped (up + 1) * gate * sigmoid(a * gate)
LAYER_RULES = ("all", "qwen", "deepseek")  # which layers are sparse (MoEFields.layers says how each reads)
EXPERT_LAYOUTS = ("gate_up", "gate_up_interleaved")  # checkpoint forms (ExpertWeights says what each is)
MOE_FORMS = ("grouped", "dense")
# deepseek_v2's config topk_method -> its group score (MoEFields.groups = "topk_method")
TOPK_METHODS = {"greedy": None, "group_limited_greedy": "max"}


@dataclass(frozen=True, slots=True)
class MoESpec:
    """The routing and expert shapes of a model's MoE layers (ModelSpec.moe; the manifest's model.moe)."""

    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts per token
    expert_intermediate_size: int  # one expert's MLP width, elements
    sparse_layers: tuple[int, ...]  # layers whose MLP is the MoE block; the others are dense MLPs
    scoring: str = "softmax"  # one of SCORINGS
    norm_topk_prob: bool = False  # the k weights divided by their sum (+ norm_topk_eps)
    norm_topk_eps: float = 0.0  # deepseek_v3: 1e-20
    routed_scaling_factor: float = 1.0  # the k weights multiplied by it (after the normalisation)
    n_group: int = 1  # experts split into this many groups for grouped top-k (1: no groups)
    topk_group: int = 1  # groups a token may pick experts from
    group_score: str | None = None  # one of GROUP_SCORES when n_group > 1
    score_correction_bias: bool = False  # sigmoid scoring: e_score_correction_bias chooses experts
    router_bias: bool = False  # router Linear has a bias (gpt_oss)
    expert_bias: bool = False  # expert up/down projections have biases (gpt_oss)
    expert_activation: str = "swiglu"  # one of EXPERT_ACTIVATIONS
    swiglu_limit: float | None = None  # gpt_oss clamp bound
    swiglu_alpha: float | None = None  # gpt_oss sigmoid slope (1.702)
    shared_intermediate_size: int = 0  # width of the shared expert(s) MLP added to every token; 0: none
    shared_gate: bool = False  # qwen2_moe: the shared expert's output × sigmoid(x @ shared_expert_gate)

    def __post_init__(self) -> None:
        assert self.scoring in SCORINGS and self.expert_activation in EXPERT_ACTIVATIONS, self
        assert self.group_score in GROUP_SCORES + (None,), self.group_score

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @property
    def grouped_topk(self) -> bool:
        """Whether the group mask can change the choice (all groups allowed = plain top-k)."""
        return self.group_score is not None and self.n_group > 1 and self.topk_group < self.n_group

    def to_json(self) -> dict:
        d = asdict(self)
        d["sparse_layers"] = list(self.sparse_layers)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "MoESpec":
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(d) - known):
            raise ConfigError(f"model spec field 'moe.{unknown[0]}' is not one this kvexport knows (written by "
                              f"another version?): rebuild with `kvexport build --force`")
        return cls(**{**d, "sparse_layers": tuple(d["sparse_layers"])})


Flag = bool | str  # a constant, or the name of a boolean config attribute


@dataclass(frozen=True, slots=True)
class MoEFields:
    """How a family's config.json declares its experts: config field names and per-family constants
    (Family.moe). read_moe turns them into a MoESpec, refusing values kvexport does not implement."""

    experts: str  # config field: routed experts (num_experts / num_local_experts / n_routed_experts)
    intermediate: str = "moe_intermediate_size"  # config field: one expert's width
    top_k: str = "num_experts_per_tok"
    scoring: str = "softmax"  # SCORINGS
    norm_topk_prob: Flag = False  # constant or config field (qwen3_moe / deepseek_v3: "norm_topk_prob")
    norm_topk_eps: float = 0.0
    layers: str = "all"  # LAYER_RULES: "qwen" = decoder_sparse_step + mlp_only_layers,
    # "deepseek" = first_k_dense_replace + moe_layer_freq
    scaling: str | None = None  # config field of routed_scaling_factor
    groups: str | None = None  # GROUP_SCORES: grouped top-k from n_group / topk_group; "topk_method": by
    # the config's topk_method (TOPK_METHODS, deepseek_v2)
    score_correction_bias: bool = False  # sigmoid: checkpoint has mlp.gate.e_score_correction_bias
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "swiglu"
    shared_experts: str | None = None  # config field: shared experts count (width = count × intermediate)
    shared_size: str | None = None  # config field: shared expert width (qwen2_moe shared_expert_intermediate_size)
    shared_gate: bool = False
    # checkpoint names under model.layers.{i}.mlp.
    router: str = "gate"  # router Linear ("gate"; gpt_oss "router")
    expert_layout: str = "gate_up"  # EXPERT_LAYOUTS
    shared: str = "shared_experts"  # the shared MLP's module (qwen2_moe "shared_expert")


@dataclass(slots=True)
class ExpertWeights:
    """The routed experts of one MoE layer, stacked, matmul weights [in, out] like LayerWeights.
    Checkpoints (transformers 5) store gate_up_proj [E, 2I, H] (gate rows first, "gate_up") or
    [E, H, 2I] with gate and up columns interleaved (gpt_oss, "gate_up_interleaved"); both are
    read into one form: [E, H, 2I] with the gate in the first I columns."""

    router_w: np.ndarray  # [hidden, experts] float32
    router_b: np.ndarray | None  # [experts]
    score_bias: np.ndarray | None  # [experts] e_score_correction_bias (chooses experts, not weights)
    up_w: np.ndarray  # [experts, hidden, 2 * inter]: gate | up
    up_b: np.ndarray | None  # [experts, 2 * inter]
    down_w: np.ndarray  # [experts, inter, hidden]
    down_b: np.ndarray | None  # [experts, hidden]
    shared_gate_w: np.ndarray | None = None  # [hidden, 1] (qwen2_moe)


# ---- reading the config -------------------------------------------------------------------
def _field_int(config, name: str, positive: bool = True) -> int:
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        raise ConfigError(f"config field {name!r} must be a {'positive' if positive else 'non-negative'} "
                          f"integer, got {value!r}")
    return value


def _sparse_layers(config, f: MoEFields, num_layers: int) -> tuple[int, ...]:
    if f.layers == "all":
        return tuple(range(num_layers))
    if f.layers == "qwen":  # transformers: i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
        step = _field_int(config, "decoder_sparse_step")
        only = getattr(config, "mlp_only_layers", None) or []
        if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) and 0 <= i < num_layers for i in only):
            raise ConfigError(f"config field 'mlp_only_layers' must list layer indices below {num_layers}, got {only!r}")
        return tuple(i for i in range(num_layers) if i not in only and (i + 1) % step == 0)
    assert f.layers == "deepseek"  # transformers: i >= first_k_dense_replace
    first = _field_int(config, "first_k_dense_replace", positive=False)
    # NOTE: DeepSeek's own code also skips layers with i % moe_layer_freq != 0; transformers ignores the
    # field. Only the value both agree on (1) is taken
    freq = getattr(config, "moe_layer_freq", 1)
    if freq not in (1, None):
        raise UnsupportedModelError(f"config field 'moe_layer_freq' is {freq!r}; kvexport supports only 1 (every "
                                    f"layer from first_k_dense_replace on is a MoE layer, as transformers builds it)")
    return tuple(i for i in range(first, num_layers))


def read_moe(config, f: MoEFields, num_layers: int) -> MoESpec:
    """A family's MoE config fields -> MoESpec, or ConfigError / UnsupportedModelError naming the field."""
    experts = _field_int(config, f.experts)
    top_k = _field_int(config, f.top_k)
    if top_k > experts:
        raise ConfigError(f"config field {f.top_k!r} ({top_k}) must not exceed {f.experts!r} ({experts})")
    inter = _field_int(config, f.intermediate)
    norm = bool(getattr(config, f.norm_topk_prob, False)) if isinstance(f.norm_topk_prob, str) else f.norm_topk_prob
    scaling = 1.0
    if f.scaling is not None:
        scaling = getattr(config, f.scaling, 1.0)
        scaling = 1.0 if scaling is None else scaling
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
            raise ConfigError(f"config field {f.scaling!r} must be a positive number, got {scaling!r}")
    n_group = topk_group = 1
    groups = f.groups
    if groups == "topk_method":  # deepseek_v2: the config's topk_method says
        method = getattr(config, "topk_method", "greedy")
        if method not in TOPK_METHODS:
            raise UnsupportedModelError(f"config field 'topk_method' is {method!r}; supported values: "
                                        f"{', '.join(TOPK_METHODS)}")
        groups = TOPK_METHODS[method]
    if groups is not None:
        n_group = getattr(config, "n_group", None) or 1
        topk_group = getattr(config, "topk_group", None) or n_group
        for name, v in (("n_group", n_group), ("topk_group", topk_group)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {v!r}")
        if experts % n_group:
            raise ConfigError(f"config field 'n_group' ({n_group}) must divide {f.experts!r} ({experts})")
        if topk_group > n_group:
            raise ConfigError(f"config field 'topk_group' ({topk_group}) must not exceed 'n_group' ({n_group})")
        if groups == "top2" and n_group > 1 and experts // n_group < 2:
            raise ConfigError(f"config fields 'n_group' ({n_group}) and {f.experts!r} ({experts}): grouped top-k "
                              f"scores each group by its 2 best experts, so groups need at least 2")
        if top_k > topk_group * (experts // n_group):
            raise ConfigError(f"config field {f.top_k!r} ({top_k}) exceeds the experts of 'topk_group' "
                              f"({topk_group}) groups of {experts // n_group}")
    shared = 0
    if f.shared_experts is not None:
        shared = _field_int(config, f.shared_experts, positive=False) * inter
    if f.shared_size is not None:
        shared = _field_int(config, f.shared_size, positive=False)
    limit = alpha = None
    if f.expert_activation == "gpt_oss":
        limit = getattr(config, "swiglu_limit", None)
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ConfigError(f"config field 'swiglu_limit' must be a positive number, got {limit!r}")
        alpha = getattr(config, "swiglu_alpha", 1.702)
        alpha = 1.702 if alpha is None else alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ConfigError(f"config field 'swiglu_alpha' must be a number, got {alpha!r}")
        limit, alpha = float(limit), float(alpha)
    return MoESpec(num_experts=experts, top_k=top_k, expert_intermediate_size=inter,
                   sparse_layers=_sparse_layers(config, f, num_layers), scoring=f.scoring, norm_topk_prob=norm,
                   norm_topk_eps=f.norm_topk_eps, routed_scaling_factor=float(scaling), n_group=n_group,
                   topk_group=topk_group, group_score=groups if n_group > 1 else None,
                   score_correction_bias=f.score_correction_bias, router_bias=f.router_bias,
                   expert_bias=f.expert_bias, expert_activation=f.expert_activation, swiglu_limit=limit,
                   swiglu_alpha=alpha, shared_intermediate_size=shared, shared_gate=f.shared_gate)


# ---- reading the weights ------------------------------------------------------------------
def _np(t) -> np.ndarray:
    return t.detach().to("cpu").float().numpy()


def read_experts(sd: dict[str, Any], mlp: str, moe: MoESpec, f: MoEFields) -> ExpertWeights:
    """One layer's routed experts from a transformers state dict; `mlp` = "model.layers.{i}.mlp."."""
    r, x = mlp + f.router + ".", mlp + "experts."
    gate_up = _np(sd[x + "gate_up_proj"])
    bias = _np(sd[x + "gate_up_proj_bias"]) if moe.expert_bias else None
    if f.expert_layout == "gate_up":  # [E, 2I, H] (out, in), gate rows first
        up_w = gate_up.transpose(0, 2, 1)
        down_w = _np(sd[x + "down_proj"]).transpose(0, 2, 1)  # [E, H, I] -> [E, I, H]
    else:  # gpt_oss: [E, H, 2I] (in, out), gate = [..., ::2], up = [..., 1::2]
        assert f.expert_layout == "gate_up_interleaved", f.expert_layout
        up_w = np.concatenate([gate_up[..., ::2], gate_up[..., 1::2]], axis=-1)
        bias = None if bias is None else np.concatenate([bias[..., ::2], bias[..., 1::2]], axis=-1)
        down_w = _np(sd[x + "down_proj"])  # [E, I, H] already
    e, inter = moe.num_experts, moe.expert_intermediate_size
    assert up_w.shape[0] == e and up_w.shape[2] == 2 * inter, (up_w.shape, e, inter)
    return ExpertWeights(
        router_w=np.ascontiguousarray(_np(sd[r + "weight"]).T), router_b=_np(sd[r + "bias"]) if moe.router_bias else None,
        score_bias=_np(sd[r + "e_score_correction_bias"]) if moe.score_correction_bias else None,
        up_w=np.ascontiguousarray(up_w), up_b=bias,
        down_w=np.ascontiguousarray(down_w), down_b=_np(sd[x + "down_proj_bias"]) if moe.expert_bias else None,
        shared_gate_w=(np.ascontiguousarray(_np(sd[mlp + "shared_expert_gate.weight"]).T) if moe.shared_gate
                       else None))


def mlp_weights(sd: dict[str, Any], layer: int, spec, f: MoEFields | None) -> tuple:
    """(up_w, up_b, down_w, down_b, experts) of layer `layer`'s MLP: a dense SwiGLU MLP
    (mlp.gate_proj/up_proj/down_proj) for dense layers, for sparse ones the shared expert(s) (or
    None, None, None, None) and the routed ExpertWeights. Any family's weight function calls it."""
    mlp = f"model.layers.{layer}.mlp."
    moe = spec.moe
    experts = None
    if moe is not None and moe.is_sparse(layer):
        assert f is not None
        experts = read_experts(sd, mlp, moe, f)
        if not moe.shared_intermediate_size:
            return None, None, None, None, experts
        mlp = mlp + f.shared + "."
    up_w = np.concatenate([_np(sd[mlp + "gate_proj.weight"]), _np(sd[mlp + "up_proj.weight"])]).T
    up_b = (np.concatenate([_np(sd[mlp + "gate_proj.bias"]), _np(sd[mlp + "up_proj.bias"])])
            if spec.mlp_bias else None)
    down_b = _np(sd[mlp + "down_proj.bias"]) if mlp + "down_proj.bias" in sd else None
    return (np.ascontiguousarray(up_w), up_b, np.ascontiguousarray(_np(sd[mlp + "down_proj.weight"]).T), down_b,
            experts)


def expert_linears(layer: int, ew: ExpertWeights) -> dict[str, np.ndarray]:
    """Graph weight name -> float [K, N] of every expert matmul of a layer (quantized like the rest)."""
    out = {}
    for e in range(ew.up_w.shape[0]):
        out[expert_name(layer, e, "up")] = ew.up_w[e]
        out[expert_name(layer, e, "down")] = ew.down_w[e]
    return out


def expert_name(layer: int, expert: int, which: str, part: str = "weight") -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{which}.{part}"


# ---- the graph ----------------------------------------------------------------------------
def moe_block(g, x: str, layer: int, ew: ExpertWeights, form: str = "grouped") -> str:
    """The routed experts of `layer` on x [.., H] (activation dtype) -> [.., H]; the shared expert
    is the caller's dense MLP (graph.py adds both)."""
    b, moe = g.b, g.spec.moe
    h = g.spec.hidden_size
    shape = b.op("Shape", x)
    x2 = b.op("Reshape", x, b.const([-1, h]))  # [N, H]
    weights, idx = route(g, x2, layer, ew)  # [N, k] float32, [N, k] int64
    if form == "dense":
        y = _dense_experts(g, x2, layer, ew, weights, idx)
    else:
        assert form == "grouped", form
        y = _grouped_experts(g, x2, layer, ew, weights, idx)
    return b.op("Reshape", y, shape)


def route(g, x2: str, layer: int, ew: ExpertWeights) -> tuple[str, str]:
    """x [N, H] -> (weights [N, k] float32, experts [N, k] int64), float32 as transformers routes."""
    b, moe = g.b, g.spec.moe
    p = f"model.layers.{layer}.mlp.router."
    e, k = moe.num_experts, moe.top_k
    logits = b.op("MatMul", g.cast(x2, g.act, "float32"), g.f32(p + "weight", ew.router_w))  # [N, E]
    if ew.router_b is not None:
        logits = b.op("Add", logits, g.f32(p + "bias", ew.router_b))
    kk = b.const([k])
    if moe.scoring == "topk_softmax":
        vals, idx = b.op("TopK", logits, kk, axis=-1, outputs=2)
        vals = b.op("Softmax", vals, axis=-1)
    elif moe.scoring == "softmax":
        probs = b.op("Softmax", logits, axis=-1)  # [N, E]
        if moe.grouped_topk:  # v2 group_limited_greedy: other groups' probs -> 0
            grouped = b.op("Reshape", probs, b.const([0, moe.n_group, e // moe.n_group]))
            probs = b.op("Where", _group_mask(g, b.op("ReduceMax", grouped, b.const([-1]), keepdims=0)),
                         probs, b.const(0.0, "float32"))
        vals, idx = b.op("TopK", probs, kk, axis=-1, outputs=2)
    else:  # sigmoid: the corrected scores choose, the plain scores weigh
        scores = b.op("Sigmoid", logits)
        choice = b.op("Add", scores, g.f32(p + "e_score_correction_bias", ew.score_bias)) \
            if ew.score_bias is not None else scores
        if moe.grouped_topk:  # v3: group score = its 2 best choices; other groups -inf
            grouped = b.op("Reshape", choice, b.const([0, moe.n_group, e // moe.n_group]))
            top2 = b.op("TopK", grouped, b.const([2]), axis=-1, outputs=2)[0]
            mask = _group_mask(g, b.op("ReduceSum", top2, b.const([-1]), keepdims=0))
            choice = b.op("Where", mask, choice, b.const(-np.inf, "float32"))
        idx = b.op("TopK", choice, kk, axis=-1, outputs=2)[1]
        vals = b.op("GatherElements", scores, idx, axis=1)
    if moe.norm_topk_prob:
        total = b.op("ReduceSum", vals, b.const([-1]), keepdims=1)
        if moe.norm_topk_eps:
            total = b.op("Add", total, b.const(moe.norm_topk_eps, "float32"))
        vals = b.op("Div", vals, total)
    if moe.routed_scaling_factor != 1.0:
        vals = b.op("Mul", vals, b.const(moe.routed_scaling_factor, "float32"))
    return vals, idx


def _group_mask(g, group_scores: str) -> str:
    """group scores [N, G] -> bool [N, E]: the expert's group is among the topk_group best."""
    b, moe = g.b, g.spec.moe
    gidx = b.op("TopK", group_scores, b.const([moe.topk_group]), axis=-1, outputs=2)[1]  # [N, tg]
    zeros = _zeros(g, b.op("Shape", group_scores), "float32")  # [N, G]
    ones = _zeros(g, b.op("Shape", gidx), "float32", 1.0)  # [N, tg]
    chosen = b.op("ScatterElements", zeros, gidx, ones, axis=1)  # [N, G] 1 where chosen
    of_expert = np.arange(moe.num_experts) // (moe.num_experts // moe.n_group)  # [E] group of each expert
    return b.op("Greater", b.op("Gather", chosen, b.const(of_expert), axis=1), b.const(0.5, "float32"))


def _zeros(g, shape: str, dtype: str, value: float = 0.0) -> str:
    from onnx import numpy_helper

    return g.b.op("ConstantOfShape", shape, value=numpy_helper.from_array(np.array([value], dtype)))


def _expert(g, x: str, layer: int, e: int, ew: ExpertWeights) -> str:
    """One expert's MLP on its rows x [n, H] -> [n, H] (activation dtype)."""
    b, moe = g.b, g.spec.moe
    up = g.linear(x, g.matrix(expert_name(layer, e, "up"), ew.up_w[e]),
                  g.matrix(expert_name(layer, e, "up", "bias"), None if ew.up_b is None else ew.up_b[e]))
    inter = moe.expert_intermediate_size
    gate, up = b.op("Split", up, b.const([inter, inter]), axis=-1, outputs=2)
    m = _glu(g, gate, up)
    return g.linear(m, g.matrix(expert_name(layer, e, "down"), ew.down_w[e]),
                    g.matrix(expert_name(layer, e, "down", "bias"), None if ew.down_b is None else ew.down_b[e]))


def _glu(g, gate: str, up: str) -> str:
    b, moe = g.b, g.spec.moe
    if moe.expert_activation == "swiglu":
        return b.op("Mul", g.activation(gate), up)
    c = lambda v: b.const(v, g.act)  # noqa: E731 - gpt_oss: clamp, then (up + 1) * gate * sigmoid(alpha * gate)
    gate = b.op("Min", gate, c(moe.swiglu_limit))
    up = b.op("Max", b.op("Min", up, c(moe.swiglu_limit)), c(-moe.swiglu_limit))
    glu = b.op("Mul", gate, b.op("Sigmoid", b.op("Mul", gate, c(moe.swiglu_alpha))))
    return b.op("Mul", b.op("Add", up, c(1.0)), glu)


def _grouped_experts(g, x2: str, layer: int, ew: ExpertWeights, weights: str, idx: str) -> str:
    """Each expert on the rows routed to it (see the module docstring's diagram).
    NOTE: 9 nodes per expert (a decode step's cost is mostly per node on the CPU): the rows are
    gathered from x repeated k times ([N*k, H], so a row index is also the token's), NonZero's
    [1, n_e] is kept as a leading axis, and the routing weights multiply once after the scatter."""
    b, moe = g.b, g.spec.moe
    k, hid = moe.top_k, g.spec.hidden_size
    flat = b.op("Reshape", idx, b.const([-1]))  # [N*k] expert of each (token, slot)
    xr = b.op("Reshape", b.op("Expand", b.op("Unsqueeze", x2, b.const([1])), b.const([1, k, 1])),
              b.const([-1, hid]))  # [N*k, H]: row t*k + j is token t
    # NOTE: experts whose codes carry per-block offsets (GGUF Q4_1) take 2-D rows [n_e, H]: graph.linear
    # adds the offsets with a Gemm on [T, K] rows in paged graphs (one Squeeze more per expert, only then)
    two_d = any(getattr(g.qweights.get(expert_name(layer, e, w)), "offset", None) is not None
                for e in range(moe.num_experts) for w in ("up", "down"))
    rows_all, outs = [], []
    for e in range(moe.num_experts):
        rows = b.op("NonZero", b.op("Equal", flat, b.const(e)))  # [1, n_e]
        take = b.op("Squeeze", rows, b.const([0])) if two_d else rows  # [n_e] | [1, n_e]
        outs.append(_expert(g, b.op("Gather", xr, take, axis=0), layer, e, ew))  # [n_e, H] | [1, n_e, H]
        rows_all.append(rows)
    rows = b.op("Transpose", b.op("Concat", *rows_all, axis=1), perm=[1, 0])  # [N*k, 1], a permutation
    y = b.op("Concat", *outs, axis=0) if two_d else \
        b.op("Squeeze", b.op("Concat", *outs, axis=1), b.const([0]))  # [N*k, H] in expert order
    # NOTE: every row of [N*k] is written exactly once (each (token, slot) has one expert), so
    # ScatterND needs no reduction; the k slots of a token are summed in slot order
    zeros = _zeros(g, b.op("Shape", xr), g.act)
    w = g.cast(b.op("Reshape", weights, b.const([-1, 1])), "float32", g.act)  # [N*k, 1]
    out = b.op("Mul", b.op("ScatterND", zeros, rows, y), w)  # [N*k, H]
    return b.op("ReduceSum", b.op("Reshape", out, b.const([-1, k, hid])), b.const([1]), keepdims=0)


def _dense_experts(g, x2: str, layer: int, ew: ExpertWeights, weights: str, idx: str) -> str:
    """Every expert on every row, weighted by its routing weight (0 where not routed):
    x [N, H] @ up [E, H, 2I] -> [E, N, 2I] -> glu -> @ down [E, I, H] -> [E, N, H] -> Σ_E w."""
    b, moe = g.b, g.spec.moe
    p = f"model.layers.{layer}.mlp.experts.stacked."
    up = b.op("MatMul", x2, g.weight(p + "up.weight", ew.up_w, g.act))  # [E, N, 2I]
    if ew.up_b is not None:
        up = b.op("Add", up, g.weight(p + "up.bias", ew.up_b[:, None, :], g.act))
    inter = moe.expert_intermediate_size
    gate, up = b.op("Split", up, b.const([inter, inter]), axis=-1, outputs=2)
    y = b.op("MatMul", _glu(g, gate, up), g.weight(p + "down.weight", ew.down_w, g.act))  # [E, N, H]
    if ew.down_b is not None:
        y = b.op("Add", y, g.weight(p + "down.bias", ew.down_b[:, None, :], g.act))
    n_e = b.op("Concat", b.op("Slice", b.op("Shape", x2), b.const([0]), b.const([1])), b.const([moe.num_experts]),
               axis=0)
    full = b.op("ScatterElements", _zeros(g, n_e, g.act), idx, g.cast(weights, "float32", g.act), axis=1)  # [N, E]
    wt = b.op("Unsqueeze", b.op("Transpose", full, perm=[1, 0]), b.const([2]))  # [E, N, 1]
    return b.op("ReduceSum", b.op("Mul", y, wt), b.const([0]), keepdims=0)  # [N, H]
