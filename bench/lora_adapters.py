"""The four PEFT adapters of the LoRA serving bench (docs/BENCHMARKS.md "LoRA adapters"): random LoRA weights
(lora_B ~ N(0, 0.01), so the model still writes text) on SmolLM2-135M in four shapes (rank 16 on every projection,
rank 8 on q/v, rank 16 on attention, rank 8 on the MLP), saved as PEFT folders a0..a3 under OUT.

    HF folder: the GGUF's conversion that `kvexport build smollm2-135m` keeps (~/.cache/kvexport/gguf/*/model +
    tokenizer, exporter/gguf_cache.py) copied into one folder.
    .venv/bin/python bench/lora_adapters.py HF_FOLDER OUT
"""

import sys

import peft
import torch
from transformers import AutoModelForCausalLM

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = [(16, ALL), (8, ["q_proj", "v_proj"]), (16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
          (8, ["gate_proj", "up_proj", "down_proj"])]


def main(hf: str, out: str) -> None:
    for i, (r, targets) in enumerate(SHAPES):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        m = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                      init_lora_weights=False))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
        m.save_pretrained(f"{out}/a{i}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
