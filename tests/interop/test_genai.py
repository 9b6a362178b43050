"""A contiguous build through onnxruntime-genai's Generator (genai_config.json written by the
build: prefill.onnx on the prompt, decode.onnx after), with its own tokenizer, in this venv
(onnxruntime-genai 0.18 uses the venv's onnxruntime >= 1.31; scripts/install.sh --dev)."""

import pytest

from .conftest import NEW_TOKENS, PROMPTS, need

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def og():
    try:
        import onnxruntime_genai
    except ImportError as e:
        need(False, f"onnxruntime-genai is not installed ({e}): run scripts/install.sh --dev")
    return onnxruntime_genai


def greedy(og, model, ids: list[int], n: int) -> list[int]:
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    out = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def test_genai_generator_matches_transformers(og, contiguous_build, reference):
    model = og.Model(str(contiguous_build))
    tok = og.Tokenizer(model)
    for prompt in PROMPTS:
        ids, new = reference[prompt]
        assert list(tok.encode(prompt)) == ids
        assert greedy(og, model, ids, NEW_TOKENS) == new, prompt


def test_genai_loads_a_symlinked_build_folder(og, contiguous_build, reference, tmp_path):
    """The documented way to give a build another name: link the folder (onnxruntime refuses
    a weights.data that is itself a link leading outside the graph's folder)."""
    link = tmp_path / "my-model"
    link.symlink_to(contiguous_build, target_is_directory=True)
    ids, new = reference[PROMPTS[0]]
    assert greedy(og, og.Model(str(link)), ids, 4) == new[:4]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "phi3", "gemma2"])
def test_genai_runs_every_family_as_exported(og, family, hf_folder, tmp_path):
    """decoder-pipeline has no model-type specific code: tiny random models of several families
    (gemma2: sliding window and soft-capping inside the graphs) give transformers' greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvexport import io
    from kvexport.exporter.build import BuildOptions, build

    # token ids inside the tiny vocab (gpt2's default 50256 is not; qwen2 has none, where genai assumes 0)
    ids_in_vocab = {} if family in ("phi3", "gemma2") else dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    src = hf_folder(family, **ids_in_vocab)
    out, _ = build(str(src), tmp_path / "b", BuildOptions(layout=io.KVLayout.CONTIGUOUS, max_seq_len=64,
                                                           validate=False))
    ids = [5, 17, 33, 42, 9, 71]
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8,
                            do_sample=False)[0, len(ids):].tolist()
    assert greedy(og, og.Model(str(out)), ids, 8) == want
