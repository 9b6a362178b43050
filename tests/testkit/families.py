"""The one table of tiny configs per family, and the saved tiny random models built from them.

Every test that needs a tiny model of a family takes its config from here (`tiny_config`) and
its weights from `make_hf_folder` (through the `hf_folder` fixture of tests/conftest.py, or
directly). The parity cases of the families' own test modules (2025-26 families, mixtures of
experts, MLA, gpt-oss) are tables here too, so the family-coverage checks read them without
loading another test file (`PARITY_MODULES`).
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=96, max_position_embeddings=256)
SLIDING, FULL = "sliding_attention", "full_attention"

# ---- DeepSeek-V2/V3 (MLA, experts) ---------------------------------------------------------------
TINY_MLA = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=96, max_position_embeddings=256, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, moe_intermediate_size=24,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES_MLA = {
    "deepseek_v3": dict(q_lora_rank=24, routed_scaling_factor=2.5),
    "deepseek_v2": dict(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5),
}
# the real DeepSeek-V3's config.json fields that shape the spec and the KV cache
REAL_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
               num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
               n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
               qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
               num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                                    original_max_position_embeddings=4096, beta_fast=32, beta_slow=1))

# ---- gpt-oss (sinks, windows, experts) --------------------------------------------------------------
TINY_GPT_OSS = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=2,
                    head_dim=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4, sliding_window=8,
                    max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=64, rope_theta=150000.0))
CASES_GPT_OSS = {"gpt_oss": {"tiny": TINY_GPT_OSS}}

# ---- the 2025-26 dense families (tests/exporter/test_families_2025.py) ----------------------------
CASES_2025 = {
    "qwen3": dict(head_dim=24),  # explicit head_dim != hidden / heads; per-head q/k norms
    "olmo2": {},  # post norms only, q/k norms over all heads
    # windows on layers 0, 2; soft-caps small enough to change the result; scale 24 ** -0.5
    "gemma2": dict(query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    # 3 local : 1 global; local RoPE base 1e4, global 1e6 with linear scaling 2
    "gemma3_text": dict(num_hidden_layers=4, sliding_window_pattern=4, query_pre_attn_scalar=24,
                        final_logit_softcapping=5.0,
                        rope_parameters={FULL: dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                                         SLIDING: dict(rope_type="default", rope_theta=1e4)}),
    "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=2),  # NoPE on layers 1, 3
}

# ---- mixtures of experts (tests/exporter/test_moe.py) -----------------------------------------------
CASES_MOE = {
    # real Qwen3-MoE: 128 experts top-8, norm_topk_prob, decoder_sparse_step 1; layer 0 dense here
    "qwen3_moe": dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      mlp_only_layers=[0], norm_topk_prob=True, head_dim=24),
    # real Mixtral: 8 experts top-2 (renormalized), every layer sparse
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    # real Qwen1.5-MoE: 60 experts top-4, a gated shared expert, decoder_sparse_step 1; here every 2nd layer
    "qwen2_moe": dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=40, decoder_sparse_step=2),
}

# ---- Gemma 4 (tests/exporter/test_gemma4.py): every feature on. 6 layers, 2 local : 1 global; the last 3
# share KV (layers 3, 4 read layer 1's cache, layer 5 reads layer 2's); global layers: head_dim 32 and one KV
# head (local: 16 and 2), proportional RoPE, keys as values (attention_k_eq_v); per-layer inputs of width 8;
# shared layers' MLPs double wide; layer scalars and every norm weight random (_init)
TINY_GEMMA4 = dict(vocab_size=128, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, global_head_dim=32, num_global_key_value_heads=1, intermediate_size=96,
                   max_position_embeddings=256, sliding_window=8, layer_types=[SLIDING, SLIDING, FULL] * 2,
                   num_kv_shared_layers=3, attention_k_eq_v=True, hidden_size_per_layer_input=8,
                   vocab_size_per_layer_input=128, use_double_wide_mlp=True, final_logit_softcapping=5.0,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES_GEMMA4 = {"gemma4_text": {}}
# Gemma 4's parity variants (tests/exporter/test_gemma4.py test_parity_variants), built with 16-token blocks over
# the validation's prompts of 5..30 tokens + 16 steps: each changes a few TINY_GEMMA4 fields
GEMMA4_VARIANTS = {
    # the window (8) inside one block; layers 3, 4, 5 read layers 1, 1, 2 (TINY_GEMMA4 as it is)
    "window-lt-block": {},
    # a 32-token window over two blocks; 2 sharing layers (4 reads 3, 5 reads 2); global layers 2 KV heads × 32
    # with their own v_proj
    "window-32-no-k-eq-v": dict(sliding_window=32, num_kv_shared_layers=2, attention_k_eq_v=False),
    # a window longer than any sequence; no sharing; keys as values; no per-layer inputs
    "window-gt-prompt-no-ple": dict(sliding_window=64, num_kv_shared_layers=0, hidden_size_per_layer_input=0),
    # every layer 2 KV heads × 16 (one KV shape: no per-layer dims); 2 sharing layers
    "uniform-heads": dict(global_head_dim=16, num_global_key_value_heads=2, num_kv_shared_layers=2),
    # a window of 4 (most keys of a block hidden); global layers 2 KV heads × 64, keys as values; no sharing
    "window-4-wide-global": dict(sliding_window=4, global_head_dim=64, num_global_key_value_heads=2,
                                 num_kv_shared_layers=0),
}

# ---- gated DeltaNet hybrids (tests/exporter/test_qwen3_5.py): 3 linear : 1 full attention (the default
# full_attention_interval 4); GQA in both kinds (2 key heads : 4 value heads; 4 query : 2 KV heads), partial
# RoPE 0.25; qwen3_next: experts (a gated shared expert) on every layer, its grouped in_proj_qkvz / in_proj_ba
TINY_HYBRID = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=96, max_position_embeddings=256, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES_HYBRID = {
    "qwen3_5_text": {},
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=40),
}
# qwen3_5_moe (tests/exporter/test_qwen3_5_moe.py): the hybrid layers above, experts (a gated shared expert) on
# every layer, top-k always renormalized
CASES_HYBRID_MOE = {"qwen3_5_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=40)}
# OLMo-Hybrid (tests/exporter/test_olmo_hybrid.py): the same shapes with OLMo's layers (separate q/k/v/g/b/a
# projections, beta x 2 by its default linear_allow_neg_eigval, OLMo-2 post-norm attention layers beside pre-norm
# linear layers) and no RoPE, as the released checkpoints (rope_theta null); the RoPE form is a variant there
CASES_OLMO_HYBRID = {"olmo_hybrid": dict(rope_parameters=dict(rope_type="default", rope_theta=None))}
# LFM2 (tests/exporter/test_lfm2.py): 3 short-conv : 1 attention layer (an attention layer between conv layers),
# GQA (4 query : 2 KV heads, q/k RMSNorm per head), RoPE; the MLP width by transformers' Lfm2MLP rule (100 -> 2/3
# -> x 1.5 -> up to a multiple of 16: 112), the norms' own eps field (norm_eps), tied embeddings as released
TINY_LFM2 = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=100, block_multiple_of=16, block_ffn_dim_multiplier=1.5, norm_eps=1e-6,
                 max_position_embeddings=256, layer_types=["conv", "conv", "full_attention", "conv"],
                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES_LFM2 = {"lfm2": {}}
BUILDS_PAGED_ONNX = [("paged", "onnx")]
# parity modules whose families refuse `--attention plugin` by name (no native op for their layers yet; the
# refusal is tested there): module -> why
PLUGIN_REFUSED: dict[str, str] = {}

# (layout, attention) of the builds each family module validates
BUILDS_ALL = [("paged", "onnx"), ("contiguous", "onnx"), ("paged", "plugin")]
BUILDS_GPT_OSS = [("paged", "onnx"), ("paged", "plugin"), ("contiguous", "onnx")]
# the families' own parity modules: module -> (its family cases, its builds); the family-coverage
# checks (tests/exporter/test_parity.py, test_plugin_and_int8.py) read this
PARITY_MODULES = {
    "test_families_2025": (CASES_2025, BUILDS_ALL),
    "test_moe": (CASES_MOE, BUILDS_ALL),
    "test_deepseek_mla": (CASES_MLA, BUILDS_ALL),
    "test_gpt_oss": (CASES_GPT_OSS, BUILDS_GPT_OSS),
    "test_gemma4": (CASES_GEMMA4, BUILDS_ALL),
    # hybrids: paged only (linear_attention.py); the plugin form's parity is test_qwen3_5_plugin.py's
    "test_qwen3_5": (CASES_HYBRID, BUILDS_PAGED_ONNX + [("paged", "plugin")]),
    "test_qwen3_5_moe": (CASES_HYBRID_MOE, BUILDS_PAGED_ONNX + [("paged", "plugin")]),
    "test_olmo_hybrid": (CASES_OLMO_HYBRID, BUILDS_PAGED_ONNX + [("paged", "plugin")]),
    "test_lfm2": (CASES_LFM2, BUILDS_PAGED_ONNX + [("paged", "plugin")]),
}


def tiny_config(family: str, **overrides):
    """A transformers config of `family`, tiny (2 layers, hidden 64, vocab 128 unless overridden)."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    if family == "gpt2":
        base = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256, n_inner=96)
        base.update(overrides)
        return GPT2Config(**base)
    if family in CASES_MLA:
        from transformers import DeepseekV2Config, DeepseekV3Config

        cls = DeepseekV3Config if family == "deepseek_v3" else DeepseekV2Config
        return cls(**{**TINY_MLA, **CASES_MLA[family], **overrides})
    if family == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(**{**TINY_GPT_OSS, **overrides})
    if family in CASES_HYBRID_MOE:
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(**{**TINY_HYBRID, **CASES_HYBRID_MOE[family], **overrides})
    if family in CASES_OLMO_HYBRID:
        from transformers import OlmoHybridConfig

        return OlmoHybridConfig(**{**TINY_HYBRID, **CASES_OLMO_HYBRID[family], **overrides})
    if family in CASES_LFM2:
        from transformers import Lfm2Config

        return Lfm2Config(**{**TINY_LFM2, **CASES_LFM2[family], **overrides})
    if family in CASES_HYBRID:
        from transformers import Qwen3_5TextConfig, Qwen3NextConfig

        cls = Qwen3_5TextConfig if family == "qwen3_5_text" else Qwen3NextConfig
        return cls(**{**TINY_HYBRID, **CASES_HYBRID[family], **overrides})
    if family == "gemma4_text":
        from transformers import Gemma4TextConfig

        return Gemma4TextConfig(**{**TINY_GEMMA4, **overrides})
    from transformers import (Gemma2Config, Gemma3TextConfig, MixtralConfig, Olmo2Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig, SmolLM3Config)

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "phi3": Phi3Config,
           "qwen3": Qwen3Config, "olmo2": Olmo2Config, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig,
           "smollm3": SmolLM3Config, "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig,
           "qwen2_moe": Qwen2MoeConfig}[family]
    base = dict(TINY, num_key_value_heads=2)
    if family in ("qwen3", "olmo2", "gemma2", "gemma3_text", "smollm3",
                  "qwen3_moe", "mixtral", "qwen2_moe"):  # token ids inside the tiny vocab
        base.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family in ("gemma2", "gemma3_text"):  # their defaults are 256-wide heads and a 4096 window
        base.update(head_dim=16, sliding_window=8)
    if family == "mistral":
        base["sliding_window"] = None
    if family == "phi3":
        base.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    return cls(**base)


def _init(family: str, model) -> None:
    """Weights with realistic logit spreads.

    NOTE: random init gives tiny logits where greedy argmax ties are likely; matrices (experts
    included) × 4 so token comparisons mean something. DeepSeek-V3's score-correction biases are
    random (they pick the experts); gpt-oss's sinks ~ N(0, 1.5²) and biases ~ N(0, 0.5²) so both matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            elif family == "gpt_oss" and name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 1.5)
            elif family == "gpt_oss" and "bias" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            if family in CASES_MLA and name.endswith("e_score_correction_bias"):
                p.copy_(torch.rand_like(p) * 0.5)
        if family in CASES_HYBRID or family in CASES_HYBRID_MOE:  # (1 + w) norms init to 0, the gated norm to 1: random, so a missed one shows
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(torch.rand_like(p) * 0.5 + (0.75 if name.endswith("linear_attn.norm.weight") else 0.0))
        if family in CASES_OLMO_HYBRID:  # every norm (the gated one too) inits to 1: random, so a missed one shows
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(0.5 + torch.rand_like(p))
        if family in CASES_LFM2:  # norms init to 1, biases (conv_bias) to 0: random, so a missed or swapped one shows
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(0.5 + torch.rand_like(p))
                elif name.endswith(".bias"):
                    p.copy_(torch.randn_like(p) * 0.5)
        if family == "gemma4_text":  # norms init to 1 and scalars to 1 would hide a swapped or missed weight
            for name, p in list(model.named_parameters()) + list(model.named_buffers()):
                if name.endswith("norm.weight") or name.endswith("layer_scalar"):
                    p.copy_(0.5 + torch.rand_like(p))


def make_hf_folder(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """A saved tiny random model of `family` (config.json + safetensors) in `directory`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    _init(family, model)
    model.save_pretrained(directory, safe_serialization=True)
    return Path(directory)
