"""`kvexport inspect`: a readable view of a build's manifest.

NOTE: everything read from the manifest or given by the user (paths, names, notes) goes
through escape(): rich would read "[...]" in it as markup."""

from __future__ import annotations

import shlex
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import io
from .. import manifest as mf


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def serving(m: mf.Manifest) -> str:
    """How onnxruntime's CPU serves the build's quantized weights by default, in words, as this
    kvexport runs them (runtime/execution/session_plan.py; the manifest's `serving` is what the
    build's kvexport said), and how to serve them otherwise."""
    from kvexport.runtime.execution.session_plan import (WEIGHT_MATMUL_ACCURACY, describe, plan_sessions,
                                                         resolve_accuracy)

    from kvexport.runtime.execution.ort_quant import ACT_QMAX

    q = m.weights.quantization
    accuracy = resolve_accuracy(q, None)
    recorded = q is not None and q.matmul_accuracy
    whose = "the build's default" if recorded else "the default for builds before it was recorded"
    others = "|".join(a for a in WEIGHT_MATMUL_ACCURACY if a != accuracy)
    plans = plan_sessions(q, m.dtype, accuracy)
    cpu = ("; on this CPU (no VNNI: u8 x s8 saturates) the int8 x int8 activations get 7 bits"
           if ACT_QMAX < 127 and any(p.rewrites and p.form != "float" for p in plans) else "")
    return (f"onnxruntime CPU, weight_matmul_accuracy {accuracy} ({whose}; --weight-matmul-accuracy {others} "
            f"to serve otherwise): {describe(plans, q)}{cpu}")


def render(build_dir: str | Path, console: Console) -> mf.Manifest:
    m = mf.load(build_dir)
    spec = m.model
    console.print(f"[bold]{escape(str(build_dir))}[/]  kvexport {escape(m.kvexport_version)}, "
                  f"schema {m.schema_version}")
    console.print(f"source: {m.source.get('kind')} {m.source.get('name')}", markup=False)
    console.print(f"model: {spec.family} ({spec.model_type}), {spec.num_layers} layers, hidden "
                  f"{spec.hidden_size}, {spec.num_heads} heads / {spec.num_kv_heads} KV heads × "
                  f"{spec.head_dim}, vocab {spec.vocab_size}, "
                  f"window {spec.sliding_window or 'none'}, tied embeddings {spec.tie_embeddings}", markup=False)
    console.print(f"parameters: {m.weights.parameters / 1e6:.1f} M, weights file "
                  f"{_human(m.weights.bytes)}, dtype {m.dtype}")
    if (q := m.weights.quantization) is not None:
        console.print(f"weights: {q.form()}, scales along {q.axis}, "
                      f"{'symmetric' if q.symmetric else 'zero points'}{', block offsets' if q.block_offsets else ''}, "
                      f"scales {q.scales_dtype}; {q.quantized.matrices} matrices "
                      f"({', '.join(f'{k}: {v}' for k, v in q.quantized.origins.items())})", markup=False)
        console.print(f"  served: {serving(m)}", markup=False)
        for what, why in q.kept.items():
            console.print(f"  kept in {m.dtype}: {what} ({why})", markup=False)
        if q.requantized_from:
            console.print(f"  source: {q.requantized_from}", markup=False)
    kv = m.kv
    console.print(f"KV cache: layout {kv.layout}, attention {kv.attention}, dtype {kv.dtype}, block size "
                  f"{kv.block_size or '-'}, [bold]{kv.bytes_per_token} bytes/token[/] "
                  f"({_human(kv.bytes_per_token * kv.max_seq_len)} for a full {kv.max_seq_len}-token context)")
    if kv.latent:  # io.py "MLA": one latent pool per layer
        console.print(f"  MLA: one latent pool per layer, rows of kv_lora_rank {kv.latent_rank} + rope "
                      f"{kv.head_dim - kv.latent_rank} = {kv.head_dim} elements; {kv.bytes_per_token} bytes/token = "
                      f"{kv.num_layers} layers × {kv.head_dim} × {kv.bytes_per_token // (kv.num_layers * kv.head_dim)} "
                      f"bytes", markup=False)
    for name, g in m.graphs.items():
        t = Table(title=escape(f"{name}: {g.file} ({_human(g.bytes)})"), show_lines=False)
        for column in ("kind", "name", "dtype", "shape"):
            t.add_column(column)
        rows = [("in", x) for x in g.inputs] + [("out", x) for x in g.outputs]
        for i, (kind, x) in enumerate(rows):
            if len(rows) > 16 and 8 <= i < len(rows) - 4:  # the first 8 and last 4 rows of a long table
                if i == 8:
                    t.add_row("…", f"({len(rows) - 12} more)", "", "")
                continue
            t.add_row(kind, escape(x.name), escape(x.dtype), escape("[" + ", ".join(map(str, x.shape)) + "]"))
        console.print(t)
    if m.validation is not None:
        from kvexport.exporter.validate import verdicts

        v = m.validation
        for line in verdicts(m):
            console.print(line, style="green" if ": PASS (" in line else "red", markup=False)
        console.print(f"  prompt lengths {list(v.prompt_lengths)}; max |Δ logits| per step: "
                      + ", ".join(f"{d:.1e}" for d in v.max_abs_diff_per_step), markup=False)
    else:
        console.print("validation: not run")
    if (e := m.engines) is not None:
        lim = e.limits
        console.print(f"TensorRT engines: {', '.join(f.file for f in e.engines.values())} ({e.precision}, TensorRT "
                      f"{e.tensorrt_version}, {e.gpu.name} sm {e.gpu.compute_capability}); limits {lim.max_num_seqs} "
                      f"sequences, {lim.max_num_batched_tokens} tokens/step, {lim.max_seq_len}-token context, "
                      f"{lim.max_num_blocks} blocks", markup=False)
    for note in m.notes:
        console.print(f"note: {note}", markup=False)
    render_commands(build_dir, m, console)
    return m


# ---- for scripts and other tools: `kvexport inspect --json`, the command lines -----------------

# contiguous graphs: (min, opt, max) of each dynamic axis, as batch 1..8 and contexts up to the
# build's max_seq_len; opt: one sequence, a 128-token prompt, decode one token at a time
CONTIGUOUS_MAX_BATCH = 8
CONTIGUOUS_OPT_PROMPT = 128


def axis_ranges(m: mf.Manifest, phase: io.Phase) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every dynamic axis of `phase`'s graph for a TensorRT profile. Paged:
    the profile `kvexport engines` builds with its defaults (exporter/tensorrt_build.py)."""
    if m.kv.layout == io.KVLayout.PAGED.value:
        from kvexport.exporter.tensorrt_build import axis_ranges as paged_ranges
        from kvexport.manifest_engines import EngineBuildOptions

        return paged_ranges(m, EngineBuildOptions(), phase)
    n = m.kv.max_seq_len
    opt = min(CONTIGUOUS_OPT_PROMPT, n)
    if phase is io.Phase.PREFILL:
        return {io.BATCH: (1, 1, CONTIGUOUS_MAX_BATCH), io.SEQ: (1, opt, n), io.TOTAL_SEQ: (1, opt, n)}
    return {io.BATCH: (1, 1, CONTIGUOUS_MAX_BATCH), io.SEQ: (1, 1, n), io.PAST_SEQ: (0, opt, n - 1),
            io.TOTAL_SEQ: (1, opt + 1, n)}


def input_profiles(m: mf.Manifest, phase: io.Phase) -> dict[str, tuple[tuple[int, ...], ...]]:
    """input name -> (min shape, opt shape, max shape), for the inputs with a dynamic axis."""
    axes = axis_ranges(m, phase)
    out = {}
    for spec in m.graphs[phase.value].inputs:
        if all(isinstance(d, int) for d in spec.shape):
            continue
        dims = [(d, d, d) if isinstance(d, int) else axes[d] for d in spec.shape]
        out[spec.name] = tuple(tuple(d[k] for d in dims) for k in range(3))
    return out


def _shapes(profile: dict, k: int, sep: str, fmt) -> str:
    return sep.join(f"{name}:{fmt(shapes[k])}" for name, shapes in profile.items())


def tool_commands(build_dir: str | Path, m: mf.Manifest) -> dict[str, list[str]]:
    """Ready-to-paste command lines for this build: "polygraphy" (inspect, run on onnxruntime and
    compare with a saved run, compare TensorRT with onnxruntime), "trtexec", and "notes" saying
    what a build cannot do. Paths are the build directory as given. docs/INTEROP.md explains them."""
    q = shlex.quote
    b = str(build_dir).rstrip("/") or "."
    plugin = m.kv.attention == io.Attention.PLUGIN.value
    fp16 = " --fp16" if m.dtype == io.DType.FP16.value else ""
    poly, trt, notes = [], [], []
    for phase in io.Phase:
        g = m.graphs[phase.value]
        onnx_path = q(f"{b}/{g.file}")
        poly.append(f"polygraphy inspect model {onnx_path}")
        prof = input_profiles(m, phase)
        sample = m.samples.get(phase.value) if m.samples else None
        inputs = f" --load-inputs {q(f'{b}/{sample}')}" if sample else ""
        ref = q(f"{phase.value}_onnxrt_outputs.json")
        if not plugin:
            poly.append(f"polygraphy run {onnx_path} --onnxrt{inputs} --save-outputs {ref}")
            poly.append(f"polygraphy run {onnx_path} --onnxrt{inputs} --load-outputs {ref}")
            pshape = lambda s: "[" + ",".join(map(str, s)) + "]"  # noqa: E731
            poly.append(f"polygraphy run {onnx_path} --trt --onnxrt{inputs}{fp16} "
                        f"--trt-min-shapes {_shapes(prof, 0, ' ', pshape)} "
                        f"--trt-opt-shapes {_shapes(prof, 1, ' ', pshape)} "
                        f"--trt-max-shapes {_shapes(prof, 2, ' ', pshape)}")
            tshape = lambda s: "x".join(map(str, s))  # noqa: E731
            trt.append(f"trtexec --onnx={onnx_path}{fp16} --minShapes={_shapes(prof, 0, ',', tshape)} "
                       f"--optShapes={_shapes(prof, 1, ',', tshape)} --maxShapes={_shapes(prof, 2, ',', tshape)} "
                       f"--saveEngine={q(f'{b}/{phase.value}.plan')}")
        elif m.engines is not None and phase.value in m.engines.engines:
            e = m.engines.engines[phase.value]
            opt = ",".join(f"{n}:{'x'.join(map(str, r.opt))}" for n, r in e.profile.items())
            trt.append(f"trtexec --loadEngine={q(f'{b}/{e.file}')} --shapes={opt}")
    if plugin:
        notes.append("plugin attention: onnxruntime runs kvexport::PagedAttention only with kvexport's custom-op "
                     "library registered (kvexport generate / bench / serve do it), which `polygraphy run --onnxrt` "
                     "cannot load; build with --attention onnx for polygraphy runs")
        notes.append("trtexec: the TensorRT PagedAttention plugin is a Python (tensorrt.plugin) plugin with no "
                     "plugin library for --staticPlugins; `kvexport engines` builds engines with its kernels "
                     "compiled in, which trtexec --loadEngine runs" + ("" if m.engines else
                                                                         f" (none yet: kvexport engines {q(b)})"))
    return {"polygraphy": poly, "trtexec": trt, "notes": notes}


def summary(build_dir: str | Path, m: mf.Manifest | None = None) -> dict:
    """`kvexport inspect --json`: what a script needs from the manifest (the model, KV layout and
    bytes per token, each graph's inputs and outputs with the TensorRT profile of its dynamic
    inputs, validation verdict, engines, tokenizer, the side files other tools read) and the
    command lines of tool_commands()."""
    m = m if m is not None else mf.load(build_dir)
    d = Path(build_dir)
    full = m.to_json()
    graphs = {}
    for phase in io.Phase:
        g = full["graphs"][phase.value]
        prof = input_profiles(m, phase)
        graphs[phase.value] = {**g, "profile": {n: {"min": list(s[0]), "opt": list(s[1]), "max": list(s[2])}
                                                for n, s in prof.items()}}
    v = m.validation
    return {
        "build_dir": str(build_dir), "schema_version": m.schema_version, "kvexport_version": m.kvexport_version,
        "source": m.source, "model": full["model"], "dtype": m.dtype, "kv": full["kv"], "weights": full["weights"],
        "graphs": graphs, "tokenizer": m.tokenizer, "samples": full.get("samples"),
        "validation": None if v is None else {"passed": v.passed, "greedy_identical": v.greedy_identical,
                                              "max_abs_diff": max(v.max_abs_diff_per_step, default=None),
                                              "op": v.op},
        "engines": full.get("engines"),
        "interop_files": [f for f in io.INTEROP_FILES if (d / f).is_file()],
        "notes": list(m.notes), "commands": tool_commands(build_dir, m),
    }


def render_commands(build_dir: str | Path, m: mf.Manifest, console: Console) -> None:
    cmds = tool_commands(build_dir, m)
    console.print("[bold]commands for polygraphy[/] (docs/INTEROP.md):")
    for line in cmds["polygraphy"]:
        console.print("  " + line, markup=False, highlight=False)
    if cmds["trtexec"]:
        console.print("[bold]commands for trtexec[/] (needs TensorRT and a GPU; docs/INTEROP.md):")
        for line in cmds["trtexec"]:
            console.print("  " + line, markup=False, highlight=False)
    for note in cmds["notes"]:
        console.print(f"note: {note}", markup=False)
