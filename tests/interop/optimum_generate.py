"""Run inside .venv-optimum (optimum-onnx, transformers 4.57), not collected by pytest:
    python optimum_generate.py BUILD_DIR NEW_TOKENS PROMPT...        text prompts, the build's tokenizer
    python optimum_generate.py --ids NEW_TOKENS IDS BUILD_DIR...     token ids (comma-separated), no tokenizer
loads each build's decode.onnx with optimum's ORTModelForCausalLM (and, with text prompts, its
tokenizer from the root and tokenizer/ with transformers 4.x), generates greedily, prints one
JSON object."""

import json
import sys

import torch
import transformers
from optimum.onnxruntime import ORTModelForCausalLM
from transformers import AutoTokenizer


def generate(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def by_ids(new_tokens: int, ids: list[int], builds: list[str]) -> dict:
    x = torch.tensor([ids])
    return {"transformers": transformers.__version__,
            "runs": {b: generate(ORTModelForCausalLM.from_pretrained(b, file_name="decode.onnx"), x, new_tokens)
                     for b in builds}}


def by_text(build: str, new_tokens: int, prompts: list[str]) -> dict:
    tok = AutoTokenizer.from_pretrained(build)
    folder_tok = AutoTokenizer.from_pretrained(build + "/tokenizer")
    model = ORTModelForCausalLM.from_pretrained(build, file_name="decode.onnx")
    result = {"transformers": transformers.__version__, "tokenizer_class": type(folder_tok).__name__,
              "special": [folder_tok.bos_token, folder_tok.eos_token, folder_tok.pad_token],
              "chat": folder_tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                     add_generation_prompt=True),
              "runs": []}
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids.tolist() == folder_tok(prompt, return_tensors="pt").input_ids.tolist()
        result["runs"].append({"prompt": prompt, "prompt_ids": ids[0].tolist(),
                               "new_ids": generate(model, ids, new_tokens)})
    return result


if __name__ == "__main__":
    if sys.argv[1] == "--ids":
        out = by_ids(int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")], sys.argv[4:])
    else:
        out = by_text(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
    print(json.dumps(out))
