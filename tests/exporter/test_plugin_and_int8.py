"""`--attention plugin` graphs and int8 KV, on tiny random models of every family.

Plugin graphs run in onnxruntime CPU with the reference PagedAttention registered as a
custom op (kvexport.plugins.paged_attention.ort) — the same reference the Triton kernels
and the TensorRT plugin are tested against. They must match transformers (validation) and
the `onnx` attention graph on identical inputs. int8 KV must agree between the `onnx`
attention, the plugin and both layouts (same quantization semantics), and stay close to
transformers."""

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from kvexport import io
from kvexport.cli import main
from kvexport.errors import ConfigError
from kvexport.exporter import calibrate as cal
from kvexport.exporter.build import BuildOptions, build
from kvexport.exporter.families import FAMILIES
from kvexport.exporter.validate import TOLERANCE, PagedDriver, prompt_ids
from kvexport.manifest import load

CASES = {"llama": dict(num_key_value_heads=2), "mistral": dict(num_key_value_heads=2, sliding_window=8),
         "qwen2": dict(num_key_value_heads=4), "phi3": dict(num_key_value_heads=1), "gpt2": {}}
OPTS = dict(block_size=4, max_seq_len=64)


def test_every_family_has_a_plugin_case():
    from testkit.families import PARITY_MODULES, PLUGIN_REFUSED

    # the 2025-26 families, the mixtures of experts, MLA and gpt-oss: plugin parity in their own modules
    # (hybrids refuse the plugin by name: PLUGIN_REFUSED)
    covered = set(CASES)
    for name, (cases, builds) in PARITY_MODULES.items():
        assert ("paged", "plugin") in builds or name in PLUGIN_REFUSED, name
        covered |= set(cases)
    assert covered == set(FAMILIES), f"add plugin cases for every registered family: {set(FAMILIES) - covered}"


@pytest.mark.parametrize("family", list(CASES))
def test_plugin_graph_matches_transformers_and_onnx_attention(hf_folder, tmp_path, family, cpu_op):
    src = str(hf_folder(family, **CASES[family]))
    plug, mp = build(src, tmp_path / "plugin", BuildOptions(attention=io.Attention.PLUGIN, **OPTS))
    assert mp.validation.passed and mp.validation.greedy_identical, mp.validation
    assert mp.validation.max_abs_diff <= TOLERANCE["fp32"]
    # validated with the native CPU op (what the runtime serves plugin graphs with), then the
    # graph itself on a cut-down check with the float64 reference op
    assert mp.validation.op == "native"
    ref_op = mp.validation.cross_check
    assert (ref_op.op, ref_op.prompts, ref_op.steps) == ("reference", 2, 2)
    assert ref_op.passed and ref_op.greedy_identical and ref_op.max_abs_diff <= TOLERANCE["fp32"], ref_op
    ref, mr = build(src, tmp_path / "onnx", BuildOptions(attention=io.Attention.ONNX, validate=False, **OPTS))
    prompts = prompt_ids(None, mr.model.vocab_size)
    forced = [[(7 * s + t) % 100 + 3 for t in range(6)] for s in range(len(prompts))]
    a = PagedDriver(plug, mp, "reference").run(prompts, forced, 6)
    b = PagedDriver(ref, mr).run(prompts, forced, 6)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) < 1e-4


def test_plugin_graph_structure(hf_folder, tmp_path):
    out, m = build(str(hf_folder("llama", num_key_value_heads=2)), tmp_path / "b",
                   BuildOptions(attention=io.Attention.PLUGIN, validate=False, **OPTS))
    g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
    nodes = [n for n in g.graph.node if n.domain == io.PLUGIN_DOMAIN]
    assert [n.op_type for n in nodes] == [io.PLUGIN_OP] * m.kv.num_layers
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["plugin_namespace"] == b"kvexport" and attrs["plugin_version"] == b"1"
    assert (attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"], attrs["block_size"]) == (4, 2, 16, 4)
    assert attrs["scale"] == pytest.approx(16 ** -0.5)
    assert len(nodes[0].input) == 12 and list(nodes[0].input[3:5]) == [io.key_cache(0), io.value_cache(0)]
    assert nodes[0].input[11] == io.OBSERVATION_LENS and nodes[0].output[3] == io.attention_scores(0)  # issue 33
    assert {(o.domain, o.version) for o in g.opset_import} >= {(io.PLUGIN_DOMAIN, 1)}
    outs = [o.name for o in g.graph.output]
    assert outs[1:3] == [io.key_cache_out(0), io.value_cache_out(0)]
    assert m.kv.attention == "plugin"
    onnx.checker.check_model(str(out / io.DECODE_GRAPH))


def test_plugin_needs_paged_layout():
    with pytest.raises(ConfigError, match="--layout paged"):
        BuildOptions(layout=io.KVLayout.CONTIGUOUS, attention=io.Attention.PLUGIN)


@pytest.fixture(scope="module")
def int8_builds(hf_folder, tmp_path_factory):
    src = str(hf_folder("llama", num_key_value_heads=2))
    d = tmp_path_factory.mktemp("int8")
    builds = {}
    for name, kw in {"paged": dict(attention=io.Attention.ONNX), "plugin": dict(attention=io.Attention.PLUGIN),
                     "contiguous": dict(layout=io.KVLayout.CONTIGUOUS)}.items():
        builds[name] = build(src, d / name, BuildOptions(kv_dtype=io.DType.INT8, **kw, **OPTS))
    builds["fp32"] = build(src, d / "fp32", BuildOptions(attention=io.Attention.ONNX, **OPTS))
    return src, builds


def test_int8_builds_validate_and_record_their_scales(int8_builds):
    _, builds = int8_builds
    v = builds["plugin"][1].validation  # the native op's check, the reference op's cut-down one; or the reference's
    assert v.op in ("native", "reference") and (v.cross_check is None) == (v.op == "reference"), v
    assert v.cross_check is None or (v.cross_check.passed and v.cross_check.max_abs_diff <= TOLERANCE["int8_kv"])
    for name in ("paged", "plugin", "contiguous"):
        out, m = builds[name]
        v = m.validation
        assert v.passed and v.tolerance == TOLERANCE["int8_kv"], (name, v)
        assert v.token_agreement >= 0.9, (name, v)
        q = m.kv.quantization
        assert q["scheme"] == cal.SCHEME
        assert np.array(q["scales"]).shape == (m.kv.num_layers, 2, m.kv.num_kv_heads, m.kv.head_dim)  # per channel
        g = onnx.load(str(out / io.PREFILL_GRAPH), load_external_data=False)
        init = {t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer if t.name.startswith("kv_scales")}
        np.testing.assert_array_equal(init[io.k_scale(1)], np.array(q["scales"], np.float32)[1, 0])
    fp32 = builds["fp32"][1]
    assert builds["paged"][1].kv.bytes_per_token * 4 == fp32.kv.bytes_per_token
    # quantization really happens: int8 is further from transformers than fp32
    assert builds["paged"][1].validation.max_abs_diff > 10 * fp32.validation.max_abs_diff


def test_int8_onnx_attention_plugin_and_contiguous_agree(int8_builds):
    """One quantization semantics (QuantizeLinear rounding, per-channel scales) everywhere:
    the three int8 builds agree far more closely than int8 agrees with fp32."""
    _, builds = int8_builds
    d = {k: builds[k][1].validation.max_abs_diff_per_step for k in ("paged", "plugin", "contiguous")}
    assert np.allclose(d["paged"], d["plugin"], atol=1e-4) and np.allclose(d["paged"], d["contiguous"], atol=1e-4)
    (p_out, p_m), (g_out, g_m) = builds["paged"], builds["plugin"]
    prompts = prompt_ids(None, p_m.model.vocab_size)
    forced = [[5 + s + t for t in range(5)] for s in range(len(prompts))]
    a = PagedDriver(p_out, p_m).run(prompts, forced, 5)
    b = PagedDriver(g_out, g_m, "reference").run(prompts, forced, 5)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) < 1e-4


def test_calibrate_cli_rewrites_scales(int8_builds, tmp_path):
    src, builds = int8_builds
    out = builds["paged"][0]
    before = np.array(load(out).kv.quantization["scales"])
    r = CliRunner().invoke(main, ["calibrate", str(out), "--tokens", "64", "--model", src])
    assert r.exit_code == 0, r.output
    m = load(out)
    after = np.array(m.kv.quantization["scales"], np.float32)
    assert m.kv.quantization["calibration"]["tokens"] == 64
    assert not np.array_equal(before, after)  # 64 tokens see a smaller range than 2048
    for graph in (io.PREFILL_GRAPH, io.DECODE_GRAPH):
        g = onnx.load(str(out / graph), load_external_data=False)
        init = {t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer if t.name.startswith("kv_scales")}
        np.testing.assert_array_equal(init[io.v_scale(0)], after[0, 1])
    assert m.validation.passed


def test_calibrate_refuses_a_build_without_int8(int8_builds):
    out = int8_builds[1]["fp32"][0]
    r = CliRunner().invoke(main, ["calibrate", str(out)])
    assert r.exit_code != 0 and "--kv-dtype int8" in r.output


def test_missing_calibration_text_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KVEXPORT_TEXT_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="fetch_texts.sh"):
        cal.default_text()


def test_quantization_matches_quantizelinear():
    """The reference's int8 codes are onnxruntime QuantizeLinear's, bit for bit: float32
    division, round half to even, saturation — on a million values per head with non-unit
    scales (near ties included) and on the exact tie and saturation cases."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper

    from kvexport.plugins.paged_attention.reference import quantize

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1, 3, 1_000_000)) * 2).astype(np.float32)  # [1, heads, n]
    x[0, 0, :8] = [0.5, 1.5, 2.5, -0.5, -1.5, 300.0, -300.0, 0.26]
    scale = np.array([1.0, 0.0227392, 0.0131], np.float32)
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], axis=1)
    g = helper.make_graph([node], "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, None])],
                          [helper.make_tensor_value_info("y", TensorProto.INT8, [1, 3, None])],
                          [onnx.numpy_helper.from_array(scale, "s"),
                           onnx.numpy_helper.from_array(np.zeros(3, np.int8), "z")])
    sess = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString())
    expected = sess.run(None, {"x": x})[0]
    got = quantize(torch.from_numpy(x), torch.from_numpy(scale)[:, None]).numpy()  # [heads, 1] broadcast
    np.testing.assert_array_equal(got, expected)
    assert expected[0, 0, :8].tolist() == [0, 2, 2, 0, -2, 127, -128, 0]


def test_backend_tensorrt_without_tensorrt_keeps_the_onnx_build(hf_folder, tmp_path):
    """No TensorRT can exist on these machines: `--backend tensorrt` must fail with a message
    naming what is missing, after the ONNX build is complete and in place."""
    pytest.importorskip("torch")
    try:
        import tensorrt  # noqa: F401

        if hasattr(tensorrt, "Builder"):
            pytest.skip("TensorRT is installed here; this checks the error without it")
    except ImportError:
        pass
    out = tmp_path / "b"
    r = CliRunner().invoke(main, ["build", str(hf_folder("llama", num_key_value_heads=2)), "--out", str(out),
                                  "--attention", "plugin", "--backend", "tensorrt", "--dtype", "fp16", "--block-size", "4",
                                  "--max-seq-len", "64"])
    assert r.exit_code != 0
    assert "TensorRT" in r.output and "onnxruntime" in r.output, r.output
    m = load(out)
    assert m.validation.passed and m.engines is None and not (out / "engines").exists()


def test_backend_tensorrt_needs_plugin_attention_and_fp16():
    with pytest.raises(ConfigError, match="--attention plugin"):
        BuildOptions(backend="tensorrt", dtype=io.DType.FP16, attention=io.Attention.ONNX)
    assert BuildOptions(backend="tensorrt", dtype=io.DType.FP16).attention is io.Attention.PLUGIN  # the default
    with pytest.raises(ConfigError, match="--dtype fp16"):
        BuildOptions(backend="tensorrt", attention=io.Attention.PLUGIN)


def test_fp16_plugin_graph_matches_fp16_onnx_attention(hf_folder, tmp_path):
    """fp16 plugin graphs (what TensorRT engines are built from): q/k/v and pools in fp16."""
    src = str(hf_folder("llama", num_key_value_heads=2))
    plug, mp = build(src, tmp_path / "p", BuildOptions(attention=io.Attention.PLUGIN, dtype=io.DType.FP16, **OPTS))
    assert mp.validation.passed and mp.validation.greedy_identical, mp.validation
    ref, mr = build(src, tmp_path / "o", BuildOptions(attention=io.Attention.ONNX, dtype=io.DType.FP16, validate=False,
                                                      **OPTS))
    prompts = prompt_ids(None, mr.model.vocab_size)
    forced = [[(5 * s + t) % 100 + 3 for t in range(4)] for s in range(len(prompts))]
    a = PagedDriver(plug, mp, "reference").run(prompts, forced, 4)
    b = PagedDriver(ref, mr).run(prompts, forced, 4)
    # the plugin graph rounds q to fp16 too (the onnx attention keeps q in fp32): small differences
    assert max(float(np.abs(x.astype(np.float32) - y.astype(np.float32)).max()) for x, y in zip(a, b)) < 2e-2


def test_calibrate_drops_engines_that_hold_the_old_scales(int8_builds, tmp_path):
    """TensorRT engines bake the scales in: recalibrating removes them (and says so).
    The engines here are placeholder files recorded in the manifest — no TensorRT exists
    on these machines to build real ones."""
    import shutil
    from dataclasses import replace

    from kvexport.manifest import EngineBuildOptions, EngineFile, EngineLimits, EnginesEntry, GpuInfo, PluginInfo

    src, builds = int8_builds
    out = tmp_path / "b"
    shutil.copytree(builds["paged"][0], out)
    (out / "engines").mkdir()
    (out / "engines" / "decode.plan").write_bytes(b"stale")
    m = load(out)
    files = {p: EngineFile(f"engines/{p}.plan", 5, "0" * 64, {}) for p in ("prefill", "decode")}
    engines = EnginesEntry("tensorrt", "10.13.0.35", GpuInfo("NVIDIA H200", "9.0"), "fp16", True, False, files,
                           "engines/timing.cache", EngineLimits(8, 64, m.kv.max_seq_len, 16, 100),
                           PluginInfo("kvexport::PagedAttention", "1", None), EngineBuildOptions())
    replace(m, engines=engines).save(out)
    r = CliRunner().invoke(main, ["calibrate", str(out), "--tokens", "32", "--model", src, "--no-validate"])
    assert r.exit_code == 0, r.output
    assert load(out).engines is None and not (out / "engines").exists()
