"""Real PEFT LoRA adapters on the tiny test models, for the LoRA tests (tests/exporter/test_lora_graphs.py,
tests/runtime/test_lora_serving.py, tests/runtime/serving/test_triton_model.py).

NOTE: peft imports triton; imported while tests are collected it would set triton up out of interpreter mode before
tests/plugins/conftest.py asks for it, so this module imports peft only inside `make_adapter`."""

from __future__ import annotations

import torch


def make_adapter(folder, out, seed: int, scale: float = 0.5, **lora_config):
    """A PEFT adapter on the HF model at `folder` with `peft.LoraConfig(**lora_config)`, lora_B drawn
    N(0, scale) (large enough on the tiny models to change greedy tokens), saved to `out`; returns the peft model
    (eval mode) as the reference."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, scale)
    model.save_pretrained(out)
    return model.eval()
