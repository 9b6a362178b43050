"""The files a build writes for other tools (exporter/interop.py) and the contiguous decode
graph's dynamic sequence axis, on tiny random models and the real smollm2 tokenizer."""

import json

import numpy as np
import onnxruntime as ort
import pytest

from kvexport import io
from kvexport.exporter.build import BuildOptions, build

CONTIG = dict(layout=io.KVLayout.CONTIGUOUS, max_seq_len=64)


@pytest.fixture(scope="module")
def tiny_contig(hf_folder, tmp_path_factory):
    out, m = build(str(hf_folder("llama")), tmp_path_factory.mktemp("tiny") / "contig",
                   BuildOptions(all_logits=True, **CONTIG))
    return out, m


def test_contiguous_build_writes_configs_the_tools_read(tiny_contig):
    from transformers import AutoConfig, GenerationConfig

    out, m = tiny_contig
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 2 and cfg.num_key_value_heads == 2
    raw = json.loads((out / io.HF_CONFIG).read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["torch_dtype"] == "float32"
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"]  # transformers 4.x reads rope_theta
    assert GenerationConfig.from_pretrained(out).eos_token_id == cfg.eos_token_id
    genai = json.loads((out / io.GENAI_CONFIG).read_text())
    assert genai["model"]["type"] == "decoder-pipeline" and genai["model"]["context_length"] == 64
    dec = genai["model"]["decoder"]
    assert dec["num_hidden_layers"] == 2 and dec["head_size"] == 16 and dec["num_key_value_heads"] == 2
    (stages,) = dec["pipeline"]
    for stage, graph in (("prefill", "prefill"), ("decode", "decode")):
        g = m.graphs[graph]
        assert stages[stage]["filename"] == g.file and (out / g.file).is_file()
        assert stages[stage]["inputs"] == [t.name for t in g.inputs]
        assert stages[stage]["outputs"] == [t.name for t in g.outputs]
    assert stages["prefill"]["run_on_prompt"] and not stages["prefill"]["run_on_token_gen"]
    assert stages["decode"]["run_on_token_gen"] and not stages["decode"]["run_on_prompt"]
    assert dec["inputs"]["past_key_names"] % 1 == io.past_key(1)
    assert dec["outputs"]["present_value_names"] % 3 == io.present_value(3)
    assert not (out / "tokenizer.json").exists()  # the tiny model has no tokenizer


def test_force_rebuild_replaces_a_build_with_side_files(hf_folder, tiny_contig, tmp_path):
    out, _ = build(str(hf_folder("llama")), tmp_path / "b", BuildOptions(validate=False, **CONTIG))
    assert (out / io.GENAI_CONFIG).is_file()
    out, m = build(str(hf_folder("llama")), out, BuildOptions(validate=False, force=True, max_seq_len=64))
    assert m.kv.layout == "paged" and (out / io.HF_CONFIG).is_file()
    assert not (out / io.GENAI_CONFIG).exists()  # onnxruntime-genai runs contiguous builds only


def _feeds(ids, past_len, past=None, layers=2, kv_heads=2, head_dim=16):
    b, s = ids.shape
    feeds = {io.INPUT_IDS: ids, io.ATTENTION_MASK: np.ones((b, past_len + s), np.int64),
             io.POSITION_IDS: np.tile(np.arange(past_len, past_len + s), (b, 1))}
    for i in range(layers):
        empty = np.zeros((b, kv_heads, 0, head_dim), np.float32)
        feeds[io.past_key(i)] = past[2 * i] if past else empty
        feeds[io.past_value(i)] = past[2 * i + 1] if past else empty
    return feeds


def test_decode_graph_takes_a_whole_prompt(tiny_contig):
    """decode.onnx declares seq dynamic: on a prompt with an empty past it gives prefill's logits
    and KV (how optimum and onnxruntime-genai's `decoder` type run it), and chunks of 2 tokens
    after a prefill continue it exactly."""
    out, m = tiny_contig
    decl = {t.name: t.shape for t in m.graphs["decode"].inputs + m.graphs["decode"].outputs}
    assert decl[io.INPUT_IDS] == (io.BATCH, io.SEQ) and decl[io.LOGITS] == (io.BATCH, io.SEQ, 128)
    sess = {g: ort.InferenceSession(str(out / f"{g}.onnx"), providers=["CPUExecutionProvider"])
            for g in ("prefill", "decode")}
    ids = np.random.default_rng(0).integers(3, 128, (2, 7)).astype(np.int64)
    full = sess["prefill"].run(None, {k: v for k, v in _feeds(ids, 0).items() if not k.startswith("past")})
    whole = sess["decode"].run(None, _feeds(ids, 0))
    assert whole[0].shape == (2, 7, 128)
    for a, b in zip(full, whole):
        np.testing.assert_allclose(a, b, atol=1e-4)
    head = sess["prefill"].run(None, {k: v for k, v in _feeds(ids[:, :5], 0).items() if not k.startswith("past")})
    tail = sess["decode"].run(None, _feeds(ids[:, 5:], 5, head[1:]))
    np.testing.assert_allclose(tail[0], full[0][:, 5:], atol=1e-4)


def test_paged_build_writes_no_genai_config(hf_folder, tmp_path):
    out, _ = build(str(hf_folder("llama")), tmp_path / "p", BuildOptions(validate=False, max_seq_len=64,
                                                                         attention=io.Attention.ONNX))
    assert (out / io.HF_CONFIG).is_file() and (out / io.GENERATION_CONFIG).is_file()
    assert not (out / io.GENAI_CONFIG).exists()


@pytest.mark.slow
def test_tokenizer_files_every_reader_takes(contiguous_build):
    from transformers import AutoTokenizer

    from kvexport.exporter import source

    cfg = json.loads((contiguous_build / "tokenizer" / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "backend" not in cfg
    assert cfg["chat_template"].startswith("{% for message in messages %}")
    for name in io.ROOT_TOKENIZER_FILES:  # onnxruntime-genai reads the folder of genai_config.json
        assert (contiguous_build / name).read_bytes() == (contiguous_build / "tokenizer" / name).read_bytes()
    original = source.load_tokenizer(source.resolve("smollm2-135m"))
    chat = [{"role": "user", "content": "What is 2+2?"}]
    for folder in (contiguous_build, contiguous_build / "tokenizer"):
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok("Hello, world!").input_ids == original("Hello, world!").input_ids
        assert tok.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)
        assert tok.eos_token == original.eos_token == "<|im_end|>"


def test_decode_graph_of_an_older_build_with_sequence_one_still_loads(tiny_contig, tmp_path):
    """Builds made before decode's sequence axis became dynamic declare it as 1: their
    manifest and graphs still load (`kvexport inspect`, polygraphy, the tools) and decode one
    token as before; a graph that declares another fixed size is still refused."""
    import shutil

    import onnx

    from kvexport import manifest as mf
    from kvexport.errors import ManifestError

    out, _ = tiny_contig
    old = tmp_path / "old"
    shutil.copytree(out, old)
    graph = onnx.load(old / io.DECODE_GRAPH, load_external_data=False)
    for vi in (*graph.graph.input, *graph.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param == io.SEQ:
                d.Clear()
                d.dim_value = 1
    onnx.save(graph, old / io.DECODE_GRAPH)
    manifest = json.loads((old / io.MANIFEST_NAME).read_text())
    for t in (*manifest["graphs"]["decode"]["inputs"], *manifest["graphs"]["decode"]["outputs"]):
        t["shape"] = [1 if d == io.SEQ else d for d in t["shape"]]
    (old / io.MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))

    m = mf.load(old)
    assert [d for t in m.graphs["decode"].inputs if t.name == io.INPUT_IDS for d in t.shape] == [io.BATCH, 1]
    feeds = {io.INPUT_IDS: np.array([[5]], np.int64), io.ATTENTION_MASK: np.ones((1, 4), np.int64),
             io.POSITION_IDS: np.array([[3]], np.int64)}
    for t in m.graphs["decode"].inputs:
        if t.name not in feeds:  # past KV: [batch, kv_heads, 3, head_dim]
            feeds[t.name] = np.zeros([1, t.shape[1], 3, t.shape[3]], np.float32)
    for d in (out, old):
        logits = ort.InferenceSession(str(d / io.DECODE_GRAPH)).run([io.LOGITS], feeds)[0]
        assert logits.shape[:2] == (1, 1)
    for vi in graph.graph.input:
        if vi.name == io.INPUT_IDS:
            vi.type.tensor_type.shape.dim[1].dim_value = 2
    onnx.save(graph, old / io.DECODE_GRAPH)
    with pytest.raises(ManifestError, match="input_ids"):
        mf.load(old)
