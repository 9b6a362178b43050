"""Ahead-of-time compile check of an op's kernel configurations: its configs module's sources
through `triton.compile` for CUDA targets (no GPU needed). Triton lowers to PTX and assembles it
with its bundled ptxas (the cubin), so a pass means both succeeded. Each op's ptx.py is the command
line (CI: configs.ci_sources(), every configuration once, the archs taken in turn; `--all`: every
configuration for every --arch):

    python -m kvexport.plugins.<op>.ptx --all --arch 80 90 [--jobs N] [--json out.json]

Runs in its own process: kernels must be imported without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def sources(configs, every: bool, capabilities) -> list[tuple]:
    """(source, capability) pairs: every: configs.all_sources() for each capability; else the
    module's CI subset configs.ci_sources() (with their own capabilities)."""
    if every:
        return [(src, c) for c in capabilities for src in configs.all_sources()]
    return configs.ci_sources()


def _compile_one(job: tuple) -> dict:
    module, every, capabilities, index, type_keys, extra = job
    src, capability = sources(importlib.import_module(module), every, capabilities)[index]
    return compile_report(src, capability, index, type_keys, extra)


def compile_report(src, capability: int, index: int, type_keys: tuple[str, ...], extra=None) -> dict:
    """Compile one kernel source (any op's) for sm_<capability> and describe it: ok (PTX for that
    target and a cubin), its name, shared memory, scratch, PTX size, seconds; a failure is a result
    too (ok False, the error). extra(kernel) -> dict adds an op's own fields."""
    desc = dict(index=index, arch=capability, kernel=src.kernel,
                config={k: v for k, v in src.constexprs.items() if k != "SCALE"},
                types={k: v for k, v in src.signature.items() if k in type_keys},
                num_warps=src.num_warps, num_stages=src.num_stages)
    t0 = time.perf_counter()
    try:
        k = src.compile(capability)
    except Exception as e:  # every failure is reported, not just the first
        return {**desc, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    ptx = k.asm["ptx"]
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    ok_target = target is not None and target.group(1).rstrip(",").startswith(f"sm_{capability}")
    return {**desc, "ok": ok_target and bool(k.asm.get("cubin")), "target": target and target.group(1),
            "name": k.metadata.name, "shared": k.metadata.shared, "ptx_bytes": len(ptx),
            "global_scratch": getattr(k.metadata, "global_scratch_size", 0),
            **(extra(k) if extra else {}), "seconds": round(time.perf_counter() - t0, 2)}


def compile_all(configs: str, type_keys: tuple[str, ...], capabilities=(80, 90), jobs: int | None = None,
                every: bool = True, extra=None) -> list[dict]:
    """Compile the sources of `configs` (an op's configs module, by name; see `sources`) in `jobs`
    processes; type_keys: the signature entries a report names (activation and pool types). extra:
    a module-level function (it is sent to the worker processes)."""
    n = len(sources(importlib.import_module(configs), every, capabilities))
    work = [(configs, every, tuple(capabilities), i, type_keys, extra) for i in range(n)]
    jobs = jobs or min(len(work), os.cpu_count() or 1)
    if jobs == 1:
        return [_compile_one(w) for w in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_one, work))


def main(argv, doc: str, label: str, configs: str, type_keys: tuple[str, ...], extra=None) -> int:
    """The command line of an op's ptx module (doc: its docstring; label: its name in the summary);
    configs / type_keys / extra: compile_all's."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="CUDA compute capabilities (with --all)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--json", default=None, help="write every result here")
    ap.add_argument("--all", action="store_true", help="every configuration for every --arch (default: the CI subset)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = compile_all(configs, type_keys, tuple(args.arch), args.jobs, args.all, extra)
    bad = [r for r in results if not r["ok"]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    for r in bad:
        print(f"FAILED sm_{r['arch']} {r['kernel']} {r['types']} {r['config']}: {r.get('error') or r.get('target')}")
    archs = sorted({r["arch"] for r in results})
    print(f"{len(results) - len(bad)}/{len(results)} {label}configurations compiled "
          f"(sm_{', sm_'.join(map(str, archs))}) in {time.perf_counter() - t0:.0f}s")
    return 1 if bad else 0
