"""Run inside .venv-optimum (optimum-onnx, transformers 4.57), not collected by pytest:
    python optimum_generate.py BUILD_DIR NEW_TOKENS PROMPT...
loads BUILD_DIR's decode.onnx with optimum's ORTModelForCausalLM and its tokenizer (root and
tokenizer/) with transformers 4.x, generates greedily, prints one JSON object."""

import json
import sys

import transformers
from optimum.onnxruntime import ORTModelForCausalLM
from transformers import AutoTokenizer

build, new_tokens, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
tok = AutoTokenizer.from_pretrained(build)
folder_tok = AutoTokenizer.from_pretrained(build + "/tokenizer")
model = ORTModelForCausalLM.from_pretrained(build, file_name="decode.onnx")
result = {"transformers": transformers.__version__, "tokenizer_class": type(folder_tok).__name__,
          "special": [folder_tok.bos_token, folder_tok.eos_token, folder_tok.pad_token],
          "chat": folder_tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                 add_generation_prompt=True),
          "runs": []}
for prompt in prompts:
    enc = tok(prompt, return_tensors="pt")
    assert enc.input_ids.tolist() == folder_tok(prompt, return_tensors="pt").input_ids.tolist()
    out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    result["runs"].append({"prompt": prompt, "prompt_ids": enc.input_ids[0].tolist(),
                           "new_ids": out[0, enc.input_ids.shape[1]:].tolist()})
print(json.dumps(result))
