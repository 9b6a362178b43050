"""Ahead-of-time compile check of the PagedAttention kernels: configurations through `triton.compile`
for CUDA targets (no GPU needed) — PTX, assembled to a cubin by Triton's bundled ptxas. CI
(tests/plugins/test_ptx_compile.py) compiles configs.ci_sources(): every configuration of
configs.all_sources() once, the archs taken in turn; by hand, every configuration for every --arch:

    python -m kvexport.plugins.paged_attention.ptx --all --arch 80 90 [--jobs N] [--json out.json]

Runs in its own process: kernels.py must be imported without TRITON_INTERPRET. The compile and
the report are plugins/common/ptx.py's.
"""

from __future__ import annotations

import sys

from ..common import ptx

TYPE_KEYS = ("q_ptr", "kc_ptr")  # the signature entries a report names (activation and pool types)


def compile_all(capabilities=(80, 90), jobs: int | None = None, every: bool = True) -> list[dict]:
    """every: all_sources() for each capability; else ci_sources() (their own capabilities)."""
    return ptx.compile_all(__package__ + ".configs", TYPE_KEYS, capabilities, jobs, every)


def main(argv=None) -> int:
    return ptx.main(argv, __doc__, "", __package__ + ".configs", TYPE_KEYS)


if __name__ == "__main__":
    sys.exit(main())
