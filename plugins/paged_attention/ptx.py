"""Ahead-of-time compile check: every configuration of configs.all_sources() through
`triton.compile` for CUDA targets (no GPU needed). Triton lowers to PTX and assembles it with
its bundled ptxas (the cubin), so a pass means both succeeded. Used by CI
(tests/plugins/test_ptx_compile.py) and runnable by hand:

    python -m kvexport.plugins.paged_attention.ptx --arch 80 90 [--jobs N] [--json out.json]

Runs in its own process: kernels.py must be imported without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _compile_one(job: tuple[int, int]) -> dict:
    index, capability = job
    from . import configs

    return compile_report(configs.all_sources()[index], capability, index, ("q_ptr", "kc_ptr"))


def compile_report(src, capability: int, index: int, type_keys: tuple[str, ...], extra=None) -> dict:
    """Compile one kernel source (any op's: PagedMLA's ptx.py calls this too) for sm_<capability> and
    describe it: ok (PTX for that target and a cubin), its name, shared memory, scratch, PTX size, seconds;
    a failure is a result too (ok False, the error). extra(kernel) -> dict adds an op's own fields."""
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


def compile_all(capabilities=(80, 90), jobs: int | None = None) -> list[dict]:
    from . import configs

    n = len(configs.all_sources())
    work = [(i, c) for c in capabilities for i in range(n)]
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
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = compile_all(tuple(args.arch), args.jobs)
    bad = [r for r in results if not r["ok"]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    for r in bad:
        print(f"FAILED sm_{r['arch']} {r['kernel']} {r['types']} {r['config']}: {r.get('error') or r.get('target')}")
    print(f"{len(results) - len(bad)}/{len(results)} configurations compiled "
          f"(sm_{', sm_'.join(map(str, args.arch))}) in {time.perf_counter() - t0:.0f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
