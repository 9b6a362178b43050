"""Ahead-of-time compile check of the GatedDeltaRule kernel: every configuration of
configs.all_sources() through `triton.compile` for CUDA targets (no GPU needed) — PTX, assembled to
a cubin by Triton's bundled ptxas. CI (tests/plugins/test_gated_delta_ptx_compile.py) compiles
configs.ci_sources(); by hand, every configuration for every --arch:

    python -m kvexport.plugins.gated_delta.ptx --all --arch 80 90 [--jobs N] [--json out.json]

Runs in its own process: kernels.py must be imported without TRITON_INTERPRET. The compile and
the report are plugins/common/ptx.py's.
"""

from __future__ import annotations

import sys

from ..common import ptx

TYPE_KEYS = ("q_ptr", "out_ptr")


def spills(k) -> dict:
    """Bytes of register spills ptxas reported (n_spills in the metadata), when known."""
    return {"spills": getattr(k, "n_spills", None)}


def compile_all(capabilities=(80, 90), jobs: int | None = None, every: bool = True) -> list[dict]:
    """every: all_sources() for each capability; else ci_sources() (their own capabilities)."""
    return ptx.compile_all(__package__ + ".configs", TYPE_KEYS, capabilities, jobs, every, spills)


def main(argv=None) -> int:
    return ptx.main(argv, __doc__, "GatedDeltaRule ", __package__ + ".configs", TYPE_KEYS, spills)


if __name__ == "__main__":
    sys.exit(main())
