"""`kvexport build`'s options are generated from `BuildOptions` (exporter/options.py): the same
options, types, ranges and help (with its [defaults]) as the hand-written ones they replaced."""

import click

from kvexport.recipes import RECIPE_DIR

# (option, type, is a flag, help), as `kvexport build --help` listed them before generation
BEFORE = [
    ("model", "StringParamType", False, None),
    ("--out", "SafePath", False, "Build directory (default: build/<model name>)."),
    ("--layout", "choice:contiguous,paged", False, "KV-cache layout [paged]."),
    ("--dtype", "choice:fp32,fp16", False, "Weights/activations dtype [fp32]."),
    ("--attention", "choice:onnx,plugin", False, "Paged attention: kvexport::PagedAttention plugin nodes (served "
     "fastest: the native CPU op, TensorRT), or standard ONNX ops for tools without kvexport's op [plugin; onnx for "
     "contiguous builds, or with a warning when the native CPU op is not built]."),
    ("--kv-dtype", "choice:fp32,fp16,int8,int4", False,
     "KV-cache dtype [same as --dtype]; int8 uses calibrated per-channel scales."),
    ("--calibration-text", "SafePath", False,
     "int8 KV: text to calibrate the scales on (int4: the key offsets) [bundled Shakespeare: Hamlet]."),
    ("--calibration-tokens", "int:16..1048576", False, "int8 / int4 KV: tokens of the text to use [2048]."),
    # NOTE: the legacy "onnx" alias of onnxruntime was removed on purpose (issue 30 §7); otherwise as before
    ("--backend", "choice:onnxruntime,tensorrt", False, "The backend the build is for, as the runtime's "
     "--backend: onnxruntime (ONNX graphs), or tensorrt (also TensorRT engines; needs --attention plugin, TensorRT "
     "and a GPU) [onnxruntime]."),
    ("--block-size", "int:1..1024", False, "Tokens per KV block for the paged layout [16]."),
    ("--max-seq-len", "int:2..262144", False, "Longest context served [model's max positions, capped at 32768]."),
    ("--all-logits", "BoolParamType", True, "Prefill returns logits for every token (perplexity)."),
    # NOTE: changed on purpose (issue 43 §5): every recipe in recipes/, no longer 5 names written by hand
    ("--recipe", "StringParamType", False,
     f"A recipe YAML file, or a shipped recipe name ({', '.join(sorted(p.stem for p in RECIPE_DIR.glob('*.yaml')))})."),
    # NOTE: added on purpose (issue 44): one PEFT LoRA adapter merged into the build
    ("--lora", "SafePath", False, "A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) "
     "merged into the weights: the build serves base + that adapter at the base's speed."),
    # NOTE: added on purpose (issue 45 §1): the hidden-state output draft heads read
    ("--hidden-states", "StringParamType", False, "Paged builds: the graphs also return every token's hidden states "
     "at these layer boundaries, for draft heads: eagle3 (layers 2, L/2, L-3), mtp (the final normed state) or a "
     "comma list in 0..L (transformers' output_hidden_states indices) [none]."),
    # NOTE: added on purpose (issue 44 step 2): graphs that take adapters at serve time
    ("--lora-max-rank", "int:1..256", False, "Paged builds: the graphs take PEFT LoRA adapters at serve time, batched "
     "per token, up to this rank [none]."),
    ("--lora-targets", "StringParamType", False, "With --lora-max-rank: the modules adapters may reach, "
     "comma-separated [q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]."),
    ("--allow-pickle", "BoolParamType", True, "Accept pickled *.bin weights (loaded with weights_only=True)."),
    ("--force", "BoolParamType", True, "Replace an earlier kvexport build at --out (never anything else)."),
    ("--no-validate", "BoolParamType", True, "Skip the comparison with transformers."),
    ("--weights", "choice:fp32,fp16,int8,int4", False, "Matmul weights: fp32/fp16, or int8/int4 QDQ in the fast CPU "
     "forms unless told otherwise (docs/QUANTIZATION.md) [--dtype]."),
    ("--weight-block-size", "choice:channel,32,64,128", False, "int8/int4 weights: input rows per scale, or one scale "
     "per output channel (int8 runs as int8 x int8 GEMMs with per-token activation scales) [int8: channel with "
     "smoothquant, or 32 with another --quant-method (32: exact, GGUF Q8_0 blocks kept); int4: 32]."),
    ("--quant-method", "choice:rtn,awq,smoothquant", False, "int8/int4 from float weights: round-to-nearest, AWQ "
     "scales on --calibration-text, or smoothquant (scales that also spare the int8 activations: int8 per channel, "
     "int4 blocks) [int8: smoothquant per channel, rtn in blocks; int4: rtn]."),
    ("--weight-matmul-accuracy", "choice:auto,int8,float", False, "int8/int4: how onnxruntime's CPU serves the "
     "weights by default (the manifest records it; serving commands' --weight-matmul-accuracy overrides it): auto "
     "(int8 pairs, ~exact), int8 (fastest), float (exact) [int8 for smoothquant, else auto]."),
]


def _described(p: click.Parameter) -> tuple:
    t = p.type
    if isinstance(t, click.Choice):
        kind = "choice:" + ",".join(t.choices)
    elif isinstance(t, click.IntRange):
        kind = f"int:{t.min}..{t.max}"
    else:
        kind = type(t).__name__
    return p.opts[0] if p.opts else p.name, kind, getattr(p, "is_flag", False), getattr(p, "help", None)


def test_build_help_lists_the_options_and_defaults_it_did():
    from kvexport.cli.build import build

    assert sorted(_described(p) for p in build.params) == sorted(BEFORE)


def test_every_build_option_is_a_flag_or_says_why_not():
    """A BuildOptions field is on the command line unless its spec says otherwise."""
    from kvexport.cli.build import build
    from kvexport.exporter.options import cli_fields

    names = {p.name for p in build.params}
    assert {f.name for f in cli_fields()} <= names | {"validate"}  # --no-validate


def test_the_legacy_onnx_backend_name_is_refused_naming_the_right_one():
    """Issue 30 §7: the "onnx" alias of onnxruntime is gone; a recipe or flag that still says it is
    told the name to use (exit 2), never silently mapped."""
    import pytest
    from click.testing import CliRunner

    from kvexport.cli import main
    from kvexport.errors import ConfigError
    from kvexport.exporter.options import BuildOptions

    with pytest.raises(ConfigError, match="onnxruntime"):
        BuildOptions(backend="onnx")
    r = CliRunner().invoke(main, ["build", "smollm2-135m", "--out", "x", "--backend", "onnx"])
    assert r.exit_code == 2 and "onnxruntime" in r.output
