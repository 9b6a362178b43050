"""The side files that let other tools load a build as it is, written by `kvexport build`
next to the graphs (docs/INTEROP.md has the command lines)::

    BUILD/
      config.json              transformers' model config: optimum's ORTModelForCausalLM
      generation_config.json   bos / eos / pad ids (optimum and transformers' generate)
      genai_config.json        onnxruntime-genai (contiguous builds only): prefill.onnx runs the
                               prompt, decode.onnx every later token ("decoder-pipeline")
      tokenizer.json           the tokenizer again at the root: onnxruntime-genai reads it from the
      tokenizer_config.json    folder of genai_config.json, AutoTokenizer.from_pretrained(BUILD) too
      tokenizer/               tokenizer.json, tokenizer_config.json, chat_template.jinja

This module owns those files. The tokenizer files are the ones transformers 5 saves, with a
tokenizer_config.json every transformers >= 4.40 reads: transformers 5 names its class
``TokenizersBackend``, which 4.x does not have (``Tokenizer class TokenizersBackend does not
exist``), and keeps the chat template only in chat_template.jinja, which 4.x before 4.43 does not
read. ``PreTrainedTokenizerFast`` is the class both read from tokenizer.json alone (transformers 5
maps it to TokenizersBackend).

NOTE: config.json carries both spellings where transformers 4 and 5 differ (``rope_theta`` /
``rope_scaling`` next to 5's ``rope_parameters``, ``torch_dtype`` next to ``dtype``): optimum
pins transformers 4.57, which would otherwise build the rotary tables with its default theta.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from kvexport import io

log = logging.getLogger(__name__)

HF_CONFIG, GENERATION_CONFIG, GENAI_CONFIG = io.HF_CONFIG, io.GENERATION_CONFIG, io.GENAI_CONFIG
TOKENIZER_FILES = io.ROOT_TOKENIZER_FILES  # in tokenizer/ and copied to the build root
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# tokenizer_config.json keys transformers 5 writes that describe the saving process, not the tokenizer
_V5_ONLY_KEYS = ("backend", "is_local", "local_files_only")
# config.json keys of the saving process (or the GGUF reader), not of the model
_DROP_CONFIG_KEYS = ("_name_or_path", "_model_name_or_path", "quantization_config", "_commit_hash",
                     "_attn_implementation_autoset")
# genai_config.json "search" defaults: greedy, the KV of one step passed to the next as it is
# (our graphs concatenate past + new into present, so past and present cannot share one buffer)
_GENAI_SEARCH = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "min_length": 0,
                 "top_k": 1, "top_p": 1.0, "temperature": 1.0, "repetition_penalty": 1.0,
                 "length_penalty": 1.0, "diversity_penalty": 0.0, "no_repeat_ngram_size": 0,
                 "early_stopping": True, "past_present_share_buffer": False}


def write_tokenizer(tokenizer, d: Path) -> str:
    """Save `tokenizer` into d/tokenizer/ with a tokenizer_config.json transformers >= 4.40 and
    onnxruntime-genai read, and copy tokenizer.json + tokenizer_config.json to `d` (copies, not hard
    links: a build stays a folder of plain files, see docs/INTEROP.md "Links, copies and weights.data").
    Returns the folder's name relative to `d`."""
    folder = d / io.TOKENIZER_DIR
    tokenizer.save_pretrained(folder)
    if not (folder / "tokenizer.json").is_file():
        # a slow-only tokenizer (no tokenizers backend): leave what transformers saved
        log.warning("the tokenizer has no tokenizer.json; onnxruntime-genai and transformers 4 may not load it")
        return io.TOKENIZER_DIR
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    cfg = compatible_tokenizer_config(cfg, tokenizer, folder)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    for name in TOKENIZER_FILES:
        shutil.copyfile(folder / name, d / name)
    return io.TOKENIZER_DIR


def compatible_tokenizer_config(cfg: dict, tokenizer, folder: Path) -> dict:
    """transformers 5's tokenizer_config.json made readable by transformers >= 4.40: class
    PreTrainedTokenizerFast, special tokens as plain strings, the chat template inline."""
    out = {k: v for k, v in cfg.items() if k not in _V5_ONLY_KEYS}
    out["tokenizer_class"] = "PreTrainedTokenizerFast"
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            out[name] = value
    out.setdefault("clean_up_tokenization_spaces", False)
    # PreTrainedTokenizerFast in 4.x also returns token_type_ids, which generate() refuses
    out.setdefault("model_input_names", ["input_ids", "attention_mask"])
    template = folder / CHAT_TEMPLATE_FILE
    if "chat_template" not in out and template.is_file():
        out["chat_template"] = template.read_text(encoding="utf-8")
    if isinstance(out.get("model_max_length"), int) and out["model_max_length"] > 2**62:
        out.pop("model_max_length")  # transformers' "no limit" sentinel, 1e30: not a JSON integer other readers take
    return out


def hf_config(config, dtype: io.DType) -> dict:
    """The source's transformers config as a config.json both transformers 4.x and 5.x read."""
    out = {k: v for k, v in config.to_dict().items() if k not in _DROP_CONFIG_KEYS}
    out["use_cache"] = True
    if not out.get("architectures"):
        arch = _causal_lm_class(config)
        if arch:
            out["architectures"] = [arch]
    torch_dtype = {"fp32": "float32", "fp16": "float16"}.get(dtype.value, "float32")
    out["dtype"] = out["torch_dtype"] = torch_dtype
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        out.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            out.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    return out


def generation_config(config, model_generation_config=None) -> dict:
    """generation_config.json: the model's own when it has one, else the token ids of its config."""
    if model_generation_config is not None:
        out = model_generation_config.to_diff_dict()
    else:
        out = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if out.get(name) is None and getattr(config, name, None) is not None:
            out[name] = getattr(config, name)
    out.pop("transformers_version", None)
    out.pop("_from_model_config", None)
    return out


def genai_config(*, spec, max_len: int, token_ids: dict, inputs: dict) -> dict:
    """genai_config.json for a contiguous build: onnxruntime-genai's "decoder-pipeline" type,
    prefill.onnx on the prompt, decode.onnx on every later token. `inputs` maps each graph file
    to its (input names, output names); `token_ids` holds bos/eos/pad ids."""
    L = spec.num_layers
    stages = {}
    for stage, (graph, prompt) in {"prefill": (io.PREFILL_GRAPH, True), "decode": (io.DECODE_GRAPH, False)}.items():
        ins, outs = inputs[graph]
        stages[stage] = {"filename": graph, "inputs": list(ins), "outputs": list(outs),
                         "run_on_prompt": prompt, "run_on_token_gen": not prompt}
    model = {
        "type": "decoder-pipeline",
        "context_length": max_len,
        "vocab_size": spec.vocab_size,
        "decoder": {
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
            "head_size": spec.head_dim, "hidden_size": spec.hidden_size,
            "num_attention_heads": spec.num_heads, "num_hidden_layers": L,
            "num_key_value_heads": spec.num_kv_heads,
            "inputs": {"input_ids": io.INPUT_IDS, "attention_mask": io.ATTENTION_MASK,
                       "position_ids": io.POSITION_IDS, "past_key_names": io.past_key(0).replace(".0.", ".%d."),
                       "past_value_names": io.past_value(0).replace(".0.", ".%d.")},
            "outputs": {"logits": io.LOGITS, "present_key_names": io.present_key(0).replace(".0.", ".%d."),
                        "present_value_names": io.present_value(0).replace(".0.", ".%d.")},
            "pipeline": [stages],
        },
    }
    for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
        v = token_ids.get(name)
        if isinstance(v, list) and name != "eos_token_id":
            v = v[0] if v else None
        if v is not None:
            model[name] = v
    if "pad_token_id" not in model and "eos_token_id" in model:
        eos = model["eos_token_id"]
        model["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    return {"model": model, "search": {**_GENAI_SEARCH, "max_length": max_len}}


def write_side_files(d: Path, *, manifest, config, model_generation_config=None) -> tuple[str, ...]:
    """Write config.json, generation_config.json and (contiguous builds) genai_config.json into
    the build folder `d` being written. Returns the names written."""
    written = []
    _write_json(d / HF_CONFIG, hf_config(config, io.DType(manifest.dtype)))
    written.append(HF_CONFIG)
    gen = generation_config(config, model_generation_config)
    ends = list(manifest.model.eos_token_ids)
    if len(ends) > 1:  # NOTE: every end token the runtime stops on, so transformers' generate stops there too
        gen["eos_token_id"] = ends
    _write_json(d / GENERATION_CONFIG, gen)
    written.append(GENERATION_CONFIG)
    # NOTE: int8 KV (quantize on write, static scales inside the graphs) and int4 KV (uint8 rows of codes and
    # scales) are not KV caches onnxruntime-genai knows how to allocate; such builds get no genai_config.json
    if manifest.kv.layout == io.KVLayout.CONTIGUOUS.value and manifest.kv.dtype not in (io.DType.INT8.value,
                                                                                        io.DType.INT4.value):
        graphs = {g.file: ([x.name for x in g.inputs], [x.name for x in g.outputs]) for g in manifest.graphs.values()}
        _write_json(d / GENAI_CONFIG, genai_config(spec=manifest.model, max_len=manifest.kv.max_seq_len,
                                                   token_ids=gen, inputs=graphs))
        written.append(GENAI_CONFIG)
    return tuple(written)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")




def _causal_lm_class(config) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""))
