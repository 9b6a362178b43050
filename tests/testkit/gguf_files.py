"""Tiny GGUF files written as llama.cpp lays them out (gguf-py's own HF -> GGUF tensor-name map), from a
saved HF folder: the mixture-of-experts families transformers' GGUF loader reads (qwen2moe, qwen3moe),
float32 or with experts in a gguf quantization type."""

from pathlib import Path

import numpy as np
import torch

# every layer sparse (llama.cpp's qwen2moe / qwen3moe have no dense layers); qwen3: head_dim != hidden / heads
CASES = {"qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64),
         "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=24)}
ARCH = {"qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE"}
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def write_moe_gguf(folder: Path, family: str, path: Path, expert_type: str | None = None) -> Path:
    """The HF model in `folder` as a GGUF at `path`: llama.cpp's metadata keys, tensors named by
    gguf-py's map, float32, or the routed and shared experts in `expert_type` (a gguf quantization
    type) blocks."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    arch = gguf.MODEL_ARCH[ARCH[family]]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)

    def add(name: str, a: np.ndarray, quantize: bool = False):
        if quantize and expert_type is not None:
            qtype = gguf.GGMLQuantizationType[expert_type]
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))

    for key, t in model.state_dict().items():
        a = t.numpy()
        if key.endswith(EXPERTS[0]):  # [E, 2I, H] gate rows first -> ffn_gate_exps, ffn_up_exps [E, I, H]
            stem, inter = key[: -len("gate_up_proj")], a.shape[1] // 2
            add(names.get_name(stem + "gate_proj") + ".weight", a[:, :inter], quantize=True)
            add(names.get_name(stem + "up_proj") + ".weight", a[:, inter:], quantize=True)
            continue
        stem, suffix = key.rsplit(".", 1) if key.endswith((".weight", ".bias")) else (key, "weight")
        if key.endswith("shared_expert_gate.weight"):
            a = a[0]  # llama.cpp stores the shared expert's gate as one row [hidden]
        add(f"{names.get_name(stem)}.{suffix}", a, quantize=key.endswith(EXPERTS[1]) or ".shared_expert." in key)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
