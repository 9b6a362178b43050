"""Test helpers for mixture-of-experts blocks (exporter/moe.py): the transformers MoE module of each
routing variant on random weights, and the same block as a standalone ONNX graph (x [N, H] -> y [N, H])
run in onnxruntime. Imported by tests/exporter/test_moe.py and bench/moe_speed.py."""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper

from kvexport import io
from kvexport.exporter.families import LayerWeights, ModelWeights
from kvexport.exporter.graph import DecoderGraph, GraphOptions
from kvexport.exporter.moe import MoEFields, mlp_weights, read_moe
from kvexport.exporter.onnx_builder import WeightStore
from kvexport.exporter.spec import ModelSpec, RopeSpec

H = 32  # hidden size of the numeric checks


def _hf(name: str, **over):
    """(transformers config, MoE module class, MoEFields) of a routing variant."""
    from transformers.models.deepseek_v2 import configuration_deepseek_v2 as c2, modeling_deepseek_v2 as m2
    from transformers.models.deepseek_v3 import configuration_deepseek_v3 as c3, modeling_deepseek_v3 as m3
    from transformers.models.gpt_oss import configuration_gpt_oss as cg, modeling_gpt_oss as mg
    from transformers.models.mixtral import configuration_mixtral as cm, modeling_mixtral as mm
    from transformers.models.qwen2_moe import configuration_qwen2_moe as cq2, modeling_qwen2_moe as mq2
    from transformers.models.qwen3_moe import configuration_qwen3_moe as cq3, modeling_qwen3_moe as mq3

    base = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
    ds = dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=24, n_shared_experts=2,
              routed_scaling_factor=2.5, first_k_dense_replace=0, intermediate_size=40)
    table = {
        "qwen3_moe": (cq3.Qwen3MoeConfig, mq3.Qwen3MoeSparseMoeBlock,
                      dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True),
                      MoEFields(experts="num_experts", norm_topk_prob="norm_topk_prob", layers="qwen")),
        "mixtral": (cm.MixtralConfig, mm.MixtralSparseMoeBlock,
                    dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24),
                    MoEFields(experts="num_local_experts", intermediate="intermediate_size", norm_topk_prob=True)),
        "qwen2_moe": (cq2.Qwen2MoeConfig, mq2.Qwen2MoeSparseMoeBlock,
                      dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                           shared_expert_intermediate_size=40),
                      MoEFields(experts="num_experts", norm_topk_prob="norm_topk_prob", layers="qwen",
                                shared_size="shared_expert_intermediate_size", shared_gate=True, shared="shared_expert")),
        "deepseek_v3": (c3.DeepseekV3Config, m3.DeepseekV3MoE, dict(ds, n_group=4, topk_group=2, norm_topk_prob=True),
                        MoEFields(experts="n_routed_experts", scoring="sigmoid", norm_topk_prob="norm_topk_prob",
                                  norm_topk_eps=1e-20, layers="deepseek", scaling="routed_scaling_factor",
                                  groups="top2", score_correction_bias=True, shared_experts="n_shared_experts")),
        "deepseek_v2": (c2.DeepseekV2Config, m2.DeepseekV2Moe, dict(ds, topk_method="greedy"),
                        MoEFields(experts="n_routed_experts", layers="deepseek", scaling="routed_scaling_factor",
                                  groups="topk_method", shared_experts="n_shared_experts")),
        "deepseek_v2_grouped": (c2.DeepseekV2Config, m2.DeepseekV2Moe,
                                dict(ds, topk_method="group_limited_greedy", n_group=4, topk_group=2),
                                MoEFields(experts="n_routed_experts", layers="deepseek", scaling="routed_scaling_factor",
                                          groups="topk_method", shared_experts="n_shared_experts")),
        "gpt_oss": (cg.GptOssConfig, mg.GptOssMLP,
                    dict(num_local_experts=8, num_experts_per_tok=4, intermediate_size=24, swiglu_limit=1.5),
                    MoEFields(experts="num_local_experts", intermediate="intermediate_size", scoring="topk_softmax",
                              router_bias=True, expert_bias=True, expert_activation="gpt_oss", router="router",
                              expert_layout="gate_up_interleaved")),
    }
    cfg_cls, mod_cls, fields, f = table[name]
    config = cfg_cls(**{**base, **fields, **over})
    config._experts_implementation = "eager"
    return config, mod_cls, f


def hf_block(name: str, seed: int = 0, scale: float = 1.0, **over):
    """(transformers MoE module with random weights, its config, MoEFields)."""
    config, cls, f = _hf(name, **over)
    torch.manual_seed(seed)
    module = cls(config).eval()
    with torch.no_grad():
        for pname, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * (scale / np.sqrt(H) if p.dim() >= 2 else 0.5))
        for bname, buf in module.named_buffers():  # e_score_correction_bias: large enough to change choices
            if "bias" in bname:
                buf.copy_(torch.randn_like(buf) * 0.3)
    return module, config, f


def spec_of(config, f: MoEFields, act: str = "silu", hidden: int = H) -> ModelSpec:
    """A one-layer ModelSpec around the variant's MoESpec (attention fields are placeholders)."""
    return ModelSpec(family="llama", model_type="llama", num_layers=1, hidden_size=hidden, num_heads=4,
                     num_kv_heads=4, head_dim=hidden // 4, intermediate_size=getattr(config, "intermediate_size", 8),
                     vocab_size=64, max_positions=64, norm="rmsnorm", norm_eps=1e-6, activation=act, gated_mlp=True,
                     qkv_bias=False, o_bias=False, mlp_bias=False, position="rope",
                     rope=RopeSpec(10000.0, "default", None, 1.0), sliding_window=None, tie_embeddings=False,
                     bos_token_id=None, eos_token_ids=(), moe=read_moe(config, f, 1))


def layer_weights(module, spec: ModelSpec, f: MoEFields) -> LayerWeights:
    sd = {"model.layers.0.mlp." + k: v for k, v in module.state_dict().items()}
    up_w, up_b, down_w, down_b, experts = mlp_weights(sd, 0, spec, f)
    z = np.zeros((spec.hidden_size, spec.hidden_size), np.float32)
    return LayerWeights(None, None, z, None, z, None, None, None, up_w, up_b, down_w, down_b, moe=experts)


def block_session(spec: ModelSpec, lw: LayerWeights, form: str = "grouped", dtype: str = "float32",
                  qweights=None, threads: int = 1):
    """onnxruntime session of the layer's MLP alone: x [N, H] -> y [N, H]."""
    import onnxruntime as ort

    opts = GraphOptions(layout=io.KVLayout.PAGED, phase=io.Phase.PREFILL, dtype=io.DType(
        "fp32" if dtype == "float32" else "fp16"), kv_dtype=io.DType.FP32, block_size=4, max_seq_len=64,
        all_logits=True, moe_form=form, qweights=qweights)
    z = np.zeros((1, spec.hidden_size), np.float32)
    g = DecoderGraph(spec, ModelWeights(z, None, [lw], z[0], None, z), None, opts, WeightStore())
    ty = TensorProto.FLOAT if dtype == "float32" else TensorProto.FLOAT16
    g.b.inputs.append(helper.make_tensor_value_info("x", ty, ["N", spec.hidden_size]))
    y = g.mlp(0, lw, "x")
    g.b.rename_output(y, "y")
    g.b.outputs.append(helper.make_tensor_value_info("y", ty, ["N", spec.hidden_size]))
    initializers = list(g.b.constants) + [
        _tensor(g.b.weights, n) for n in g.b.used_weights]
    graph = helper.make_graph(g.b.nodes, "moe", g.b.inputs, g.b.outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", g.b.opset)])
    model.ir_version = 9
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]), model


def _tensor(store: WeightStore, name: str):
    from onnx import numpy_helper

    arr = store.arrays[name]
    if name in store.packed:  # int4 codes: raw bytes with the logical dims
        data_type, dims = store.packed[name]
        return helper.make_tensor(name, data_type, list(dims), arr.tobytes(), raw=True)
    return numpy_helper.from_array(arr, name)
