"""tests/plugins: the Triton kernels run on CPU under the Triton interpreter.

triton.jit decides between compiled and interpreted kernels when a kernel module is
imported, so kernels.py is imported here once with TRITON_INTERPRET=1 and the variable is
then restored, so the variable does not leak into the rest of the suite. NOTE: triton itself
is then imported in interpreter mode for this process (its standard-library functions too),
so the PTX compile tests and the GPU-check dry run run in subprocesses.
"""

import os

_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton.experimental.gluon  # noqa: F401  (imported lazily by triton; asserts the mode)
    import triton.runtime.interpreter  # noqa: F401

    from kvexport.plugins.paged_attention import kernels, launch  # noqa: F401  (interpreted from now on)
    from kvexport.plugins.paged_mla import kernels as mla_kernels, launch as mla_launch  # noqa: F401
    from kvexport.plugins.gated_delta import kernels as gdn_kernels, launch as gdn_launch  # noqa: F401
finally:
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved
