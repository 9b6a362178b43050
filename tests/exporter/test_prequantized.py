"""Pre-quantized AWQ / GPTQ checkpoints (exporter/prequantized.py): their codes map exactly onto
the build's block-wise codes, the reference model holds exactly their dequantized weights, the
built graphs validate against it, and what cannot be mapped exactly is refused by name.

NOTE: transformers cannot load such checkpoints here (it needs the autoawq / gptqmodel kernels),
and neither package is installed, so these tests write the checkpoints themselves: a packer
written in this file following the documented layouts (AutoAWQ WQLinear_GEMM.from_linear:
qweight [K, N/8] with nibble i of word c holding column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i];
auto-gptq QuantLinear.pack: qweight [K*b/32, N] packed along K, qzeros along N, low bits first,
v1 storing zero - 1), with its own reference dequantization W = (q - z) * s in float32.
"""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper
from safetensors.numpy import load_file, save_file

from kvexport import io
from kvexport.cli import main
from kvexport.errors import ConfigError, KvExportError
from kvexport.exporter import prequantized as pqz
from kvexport.exporter import quantize as qz
from kvexport.exporter.build import BuildOptions, build

OPTS = dict(block_size=4, max_seq_len=64)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_NIBBLE_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)


# ---- the test's own quantizer and packers -------------------------------------------------
def quantize(w_kn: np.ndarray, bits: int, group: int, sym: bool):
    """W [K, N] -> (codes [K, N] 0..2^b-1, zeros [K/G, N], fp16 scales [K/G, N], reference W)."""
    k, n = w_kn.shape
    group = k if group == -1 else group  # -1: one group over all of K (per output channel)
    wg = w_kn.reshape(k // group, group, n)
    top = (1 << bits) - 1
    if sym:
        s = (np.abs(wg).max(axis=1) / (top // 2)).astype(np.float16)
        z = np.full(s.shape, 1 << (bits - 1), np.int64)
    else:
        lo, hi = np.minimum(wg.min(axis=1), 0), np.maximum(wg.max(axis=1), 0)
        s = ((hi - lo) / top).astype(np.float16)
        z = np.clip(np.rint(-lo / s.astype(np.float32)), 0, top).astype(np.int64)
    s32 = s.astype(np.float32)
    u = np.clip(np.rint(wg / s32[:, None, :]) + z[:, None, :], 0, top).astype(np.int64)
    ref = ((u - z[:, None, :]).astype(np.float32) * s32[:, None, :]).reshape(k, n)
    return u.reshape(k, n), z, s, ref


def pack_awq(codes: np.ndarray) -> np.ndarray:
    """[R, N] 4-bit codes -> int32 [R, N/8] as AutoAWQ's gemm packing lays them out."""
    r, n = codes.shape
    out = np.zeros((r, n // 8), np.uint64)
    for word in range(n // 8):
        for i, col in enumerate(AWQ_NIBBLE_COLUMN):
            out[:, word] |= codes[:, word * 8 + col].astype(np.uint64) << np.uint64(4 * i)
    return out.astype(np.uint32).view(np.int32)


def pack_gptq(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """codes packed 32/b to an int32 along `axis` (0: qweight, along K; 1: qzeros, along N)."""
    c = codes.astype(np.uint64) if axis == 0 else codes.T.astype(np.uint64)
    per = 32 // bits
    out = np.zeros((c.shape[0] // per, c.shape[1]), np.uint64)
    for row in range(out.shape[0]):
        for j in range(per):
            out[row] |= c[row * per + j] << np.uint64(bits * j)
    out = out.astype(np.uint32).view(np.int32)
    return out if axis == 0 else np.ascontiguousarray(out.T)


def write_checkpoint(float_dir, out_dir, method: str, bits: int = 4, group: int = 32, sym: bool = False,
                     fmt: str | None = None, config_extra: dict | None = None, tamper=None):
    """float HF folder -> pre-quantized folder (same config + quantization_config); returns the
    reference dequantized weight [N, K] of every quantized linear, by state-dict name."""
    sd = load_file(str(float_dir / "model.safetensors"))
    cfg = json.loads((float_dir / "config.json").read_text())
    refs, out = {}, {}
    for key, w in sd.items():
        prefix = key.removesuffix(".weight")
        if not (key.endswith(".weight") and prefix.split("layers.")[-1].split(".", 1)[-1] in LINEARS):
            out[key] = w.astype(np.float16) if w.dtype == np.float32 else w  # fp16, as checkpoints ship
            continue
        u, z, s, ref = quantize(w.T.astype(np.float32), bits, group, sym)
        if tamper is not None:
            u, z = tamper(prefix, u, z)
        refs[key] = ref.T
        if method == "awq":
            out[prefix + ".qweight"], out[prefix + ".qzeros"] = pack_awq(u), pack_awq(z)
        else:
            stored_z = z - 1 if (fmt or "gptq") == "gptq" else z
            out[prefix + ".qweight"] = pack_gptq(u, bits, 0)
            out[prefix + ".qzeros"] = pack_gptq(stored_z & ((1 << bits) - 1), bits, 1)
            out[prefix + ".g_idx"] = (np.arange(u.shape[0]) // (group if group > 0 else u.shape[0])).astype(np.int32)
        out[prefix + ".scales"] = s
    qc = ({"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": fmt or "gemm"}
          if method == "awq" else
          {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": sym,
           "checkpoint_format": fmt or "gptq"})
    cfg["quantization_config"] = qc | (config_extra or {})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    # NOTE: safetensors.numpy writes an array's buffer as is: a Fortran-ordered one (numpy keeps
    # the order of w.T through astype) would be stored transposed
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, str(out_dir / "model.safetensors"))
    return refs


def graph_weights(build_dir) -> dict[str, np.ndarray]:
    """Graph name -> the float [K, N] each DequantizeLinear of the decode graph yields, computed
    from its stored initializers (codes, scales, zero points)."""
    g = onnx.load(str(build_dir / io.DECODE_GRAPH), load_external_data=False)
    onnx.external_data_helper.load_external_data_for_model(g, str(build_dir))
    init = {i.name: numpy_helper.to_array(i) for i in g.graph.initializer}
    out = {}
    for node in g.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0].endswith(".weight.q"):
            q = init[node.input[0]].astype(np.float32)
            block = {a.name: a.i for a in node.attribute}.get("block_size")  # None: per channel, [N] scales
            rep = lambda a: (a.astype(np.float32)[None, :] if block is None  # noqa: E731
                             else np.repeat(a.astype(np.float32), block, axis=0)[: q.shape[0]])
            zp = rep(init[node.input[2]]) if len(node.input) > 2 and node.input[2] else 0.0
            out[node.input[0].removesuffix(".q")] = (q - zp) * rep(init[node.input[1]])
    return out


# ---- tests --------------------------------------------------------------------------------
CASES = {  # id -> (family, method, bits, group_size, format, sym)
    "awq-llama": ("llama", "awq", 4, 32, "gemm", False),
    "gptq-v1-qwen2": ("qwen2", "gptq", 4, 32, "gptq", False),  # qkv bias (fp16) kept as it is
    "gptq-v2-sym-int8-llama": ("llama", "gptq", 8, 32, "gptq_v2", True),
    "gptq-v1-int8-per-channel-llama": ("llama", "gptq", 8, -1, "gptq", False),
}


@pytest.mark.parametrize("flags", ["explicit", "defaults"])
@pytest.mark.parametrize("case", list(CASES))
def test_prequantized_build_maps_codes_exactly(hf_folder, tmp_path, case, flags, cpu_op):
    """`pq.flags` keep the checkpoint's codes exactly; so does `--weights intN` alone: the default
    form is then the checkpoint's own (its group size, codes mapped as they are)."""
    family, method, bits, group, fmt, sym = CASES[case]
    src = tmp_path / "ckpt"
    refs = write_checkpoint(hf_folder(family), src, method, bits, group, sym, fmt)
    # the reference model kvexport validates against holds exactly the test's dequantized weights
    pq = pqz.config_of(src)
    block = group if group > 0 else qz.CHANNEL
    assert (pq.method, pq.bits, pq.group_size, pq.format) == (method, bits, block, fmt)
    from kvexport.exporter.source import resolve

    sd = pqz.load_model(resolve(str(src)), pq).state_dict()
    for key, ref in refs.items():
        np.testing.assert_array_equal(sd[key].numpy(), ref, err_msg=key)

    out, m = build(str(src), tmp_path / "b", BuildOptions(weights=f"int{bits}", **OPTS,
                                                     **(dict(weight_block_size=block) if flags == "explicit" else {})))
    assert m.validation.passed, m.validation
    q = m.weights.quantization
    n_layers = m.model.num_layers
    assert q.quantized.origins == {f"{method}:{fmt}": 4 * n_layers, "rtn": 1}  # + the int8 LM head
    assert q.symmetric is sym and q.source["exact_matrices"] == 4 * n_layers
    assert q.method.startswith(f"{method}:{fmt} (pre-quantized") and q.matmul_accuracy == "auto"
    # every decoder matmul the graph dequantizes is, bit for bit, the checkpoint's
    got = graph_weights(out)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        a, mlp = p + "self_attn.", p + "mlp."
        expect = {"attn.qkv": [a + "q_proj", a + "k_proj", a + "v_proj"], "attn.o": [a + "o_proj"],
                  "mlp.up": [mlp + "gate_proj", mlp + "up_proj"], "mlp.down": [mlp + "down_proj"]}
        for short, parts in expect.items():
            ref = np.concatenate([refs[x + ".weight"].T for x in parts], axis=1)  # [K, N]
            np.testing.assert_array_equal(got[f"{p}{short}.weight"], ref, err_msg=f"{p}{short}")


def test_awq_unpack_inverts_the_documented_packing():
    """Column j of an AWQ word is read from nibble AWQ_ORDER.index(j), not nibble j."""
    codes = np.arange(16 * 8).reshape(16, 8) % 16
    np.testing.assert_array_equal(pqz.unpack_along_cols(pack_awq(codes), 4, pqz.AWQ_ORDER), codes)
    assert not np.array_equal(pqz.unpack_along_cols(pack_awq(codes), 4), codes)
    g = np.random.default_rng(0).integers(0, 256, size=(64, 5))
    np.testing.assert_array_equal(pqz.unpack_along_rows(pack_gptq(g, 8, 0), 8), g)


@pytest.mark.parametrize("qc,field", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "backend": "llm-awq"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False}, "zero_point"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, "checkpoint_format"),
])
def test_unmappable_configs_are_refused_by_field(qc, field):
    with pytest.raises(ConfigError, match=f"quantization_config.{field}"):
        pqz.parse(qc)
    # not AWQ/GPTQ: parse reads nothing (None); check_method refuses it before any weight is read
    assert pqz.parse({"quant_method": "bitsandbytes"}) is None
    with pytest.raises(ConfigError, match="'quantization_config.quant_method' is 'bitsandbytes'"):
        pqz.check_method({"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes"}})


@pytest.mark.parametrize("given", ["folder", "config.json"])
def test_plan_refuses_an_unread_quant_method_as_build_does(hf_folder, tmp_path, given):
    """`kvexport plan` reads a HF folder's config.json alone (no weights), yet refuses a
    quantization_config that a build would refuse, with the build's message."""
    d = tmp_path / "bnb"
    d.mkdir()
    cfg = json.loads((hf_folder("llama") / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (d / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["plan", str(d if given == "folder" else d / "config.json"), "--memory", "8GiB"])
    assert r.exit_code == 2, r.output
    assert "'quantization_config.quant_method' is 'bitsandbytes'" in r.output and "supported values: awq" in r.output
    with pytest.raises(ConfigError) as built:  # the same refusal, word for word, once weights are there
        (d / "model.safetensors").write_bytes((hf_folder("llama") / "model.safetensors").read_bytes())
        build(str(d), tmp_path / "b", BuildOptions(**OPTS))
    assert str(built.value) in " ".join(r.output.split())


def test_act_order_and_v1_zero_of_16_are_refused(hf_folder, tmp_path):
    src = hf_folder("llama")
    d = tmp_path / "desc"
    write_checkpoint(src, d, "gptq", config_extra={"desc_act": True})
    sd = load_file(str(d / "model.safetensors"))
    g = sd["model.layers.0.self_attn.q_proj.g_idx"]
    sd["model.layers.0.self_attn.q_proj.g_idx"] = np.ascontiguousarray(g[::-1])  # act-order: groups permuted
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"q_proj\.g_idx .*desc_act"):
        build(str(d), tmp_path / "b1", BuildOptions(weights="int4", **OPTS))

    def zero_zero(prefix, u, z):  # GPTQ v1 cannot store zero 0: its kernels read 16
        z = z.copy()
        if prefix.endswith("layers.1.mlp.down_proj"):
            z[0, 0] = 0
        return u, z
    d2 = tmp_path / "v1zero"
    write_checkpoint(src, d2, "gptq", tamper=zero_zero)
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.down_proj\.qzeros .*gptq_v2"):
        build(str(d2), tmp_path / "b2", BuildOptions(weights="int4", **OPTS))


def test_build_options_must_match_the_checkpoint(hf_folder, tmp_path):
    d = tmp_path / "awq"
    refs = write_checkpoint(hf_folder("llama"), d, "awq")
    with pytest.raises(ConfigError, match="--weights int4 --weight-block-size 32"):
        build(str(d), tmp_path / "b1", BuildOptions(weights="int8", **OPTS))
    with pytest.raises(ConfigError, match="--weight-block-size 32"):
        build(str(d), tmp_path / "b2", BuildOptions(weights="int4", weight_block_size=64, **OPTS))
    with pytest.raises(KvExportError, match="drop --quant-method awq"):
        build(str(d), tmp_path / "b3", BuildOptions(weights="int4", quant_method="awq", **OPTS))
    # a float build dequantizes the codes: its graphs carry exactly the reference weights
    out, m = build(str(d), tmp_path / "b4", BuildOptions(layout=io.KVLayout.CONTIGUOUS, **OPTS))
    assert m.validation.passed and m.weights.precision == "fp32"
    g = onnx.load(str(out / io.DECODE_GRAPH), load_external_data=False)
    onnx.external_data_helper.load_external_data_for_model(g, str(out))
    init = {i.name: numpy_helper.to_array(i) for i in g.graph.initializer}
    np.testing.assert_array_equal(init["model.layers.0.attn.o.weight"],
                                  refs["model.layers.0.self_attn.o_proj.weight"].T)
