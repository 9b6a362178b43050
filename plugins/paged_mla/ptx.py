"""Ahead-of-time compile check of the MLA kernels: every configuration of configs.all_sources()
through `triton.compile` for CUDA targets (no GPU needed) — PTX, assembled to a cubin by Triton's
bundled ptxas. CI (tests/plugins/test_mla_ptx_compile.py) compiles configs.ci_sources() (each kernel
and pool kind once); by hand, every configuration for every --arch:

    python -m kvexport.plugins.paged_mla.ptx --all --arch 80 90 [--jobs N] [--json out.json]

Runs in its own process: kernels.py must be imported without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from kvexport.plugins.paged_attention.ptx import compile_report


def _sources(every: bool, capabilities) -> list[tuple]:
    from . import configs

    if every:
        return [(src, c) for c in capabilities for src in configs.all_sources()]
    return configs.ci_sources()


def _compile_one(job: tuple[bool, tuple, int]) -> dict:
    every, capabilities, index = job
    src, capability = _sources(every, capabilities)[index]
    return compile_report(src, capability, index, ("q_ptr", "cache_ptr", "out_ptr"),
                          extra=lambda k: {"spills": _spills(k)})


def _spills(k) -> int | None:
    """Bytes of register spills ptxas reported (n_spills in the metadata), when known."""
    return getattr(k, "n_spills", None)


def compile_all(capabilities=(80, 90), jobs: int | None = None, every: bool = True) -> list[dict]:
    """every: all_sources() for each capability; else ci_sources() (their own capabilities)."""
    work = [(every, tuple(capabilities), i) for i in range(len(_sources(every, capabilities)))]
    jobs = jobs or min(len(work), os.cpu_count() or 1)
    if jobs == 1:
        return [_compile_one(w) for w in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_one, work))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="CUDA compute capabilities")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--json", default=None, help="write every result here")
    ap.add_argument("--all", action="store_true", help="every configuration (default: the CI subset)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = compile_all(tuple(args.arch), args.jobs, args.all)
    bad = [r for r in results if not r["ok"]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    for r in bad:
        print(f"FAILED sm_{r['arch']} {r['kernel']} {r['types']} {r['config']}: {r.get('error') or r.get('target')}")
    archs = sorted({r["arch"] for r in results})
    print(f"{len(results) - len(bad)}/{len(results)} MLA configurations compiled "
          f"(sm_{', sm_'.join(map(str, archs))}) in {time.perf_counter() - t0:.0f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
