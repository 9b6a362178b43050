"""`kvexport inspect`: a readable view of a build's manifest.

NOTE: everything read from the manifest or given by the user (paths, names, notes) goes
through escape(): rich would read "[...]" in it as markup."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import manifest as mf


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


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
    kv = m.kv
    console.print(f"KV cache: layout {kv.layout}, attention {kv.attention}, dtype {kv.dtype}, block size "
                  f"{kv.block_size or '-'}, [bold]{kv.bytes_per_token} bytes/token[/] "
                  f"({_human(kv.bytes_per_token * kv.max_seq_len)} for a full {kv.max_seq_len}-token context)")
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
    return m
