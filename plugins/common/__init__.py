"""The pieces every op folder of kvexport.plugins shares, so that a new op costs its spec,
reference, kernels and their configurations only:

    pyop.py       the reference as an onnxruntime-extensions PyOp: registration, the graph
                  rewrite, casts of float16 / bfloat16, the session over every registered op
    trt.py        TensorRT registration helpers: the TensorRT check, dtype names, autotune type
                  strings, tactic lookup, the AOT launch of a Triton kernel
    ptx.py        ahead-of-time compiles of an op's kernel sources to PTX + cubin (no GPU)
    gpu_check.py  the GPU checks' command line, timing, copy bandwidth, ragged batches,
                  the correctness loop and its report lines
    cases.py      the paged metadata of a random ragged batch (each reference's make_case)
    cpu/          C++ helpers of the native CPU ops (the step's metadata checks)

Nothing here knows an op: each takes the op's names, shapes and functions as arguments.
"""
