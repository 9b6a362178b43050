#!/usr/bin/env bash
# The test and peer environments, on top of what scripts/install.sh put in .venv (it runs this with
# --dev): the test extras, lm-eval, TensorRT stubs, onnxruntime-genai, .venv-optimum, .venv-triton.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || { echo "error: no .venv: run bash scripts/install.sh --dev" >&2; exit 1; }
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# TensorRT type stubs for the type-check of the TensorRT glue (tests/tensorrt). Kept out of
# site-packages: installed there they make `import tensorrt` succeed as an empty package.
pip install -q --no-deps --target .venv/tensorrt-stubs tensorrt-stubs==10.13.0.35.1
# NVIDIA Dynamo (`kvexport dynamo`, tests/runtime/serving/test_dynamo_*.py): the test extra pulled the `dynamo`
# extra (ai-dynamo-runtime + ai-dynamo's other requirements + nixl-cu12, the disaggregated workers' KV
# transfer); ai-dynamo itself goes in without its
# requirements, since it requires `aisimulate`, a placeholder package whose download host is unreachable
pip install -q --no-deps ai-dynamo==1.6.1
# onnxruntime-genai (interop tests, bench/compare_ortgenai.py, bench/interop_speed.py): 0.18 runs on
# this venv's onnxruntime (it requires >= 1.31), so it lives here (~1 s from the cache, ~10 s fresh)
pip install -q onnxruntime-genai==0.18.0
# optimum (interop tests: ORTModelForCausalLM on a contiguous build, the tokenizer folder under
# transformers 4.x) in its own environment: optimum-onnx 0.1 pins transformers 4.57. torch 2.13.0
# (CPU) first, from the same place as above, so optimum's requirements pull no CUDA build. ~40 s.
[ -x .venv-optimum/bin/python ] || "$PY" -m venv .venv-optimum
.venv-optimum/bin/pip install -q --upgrade pip
.venv-optimum/bin/pip install -q torch==2.13.0
.venv-optimum/bin/pip install -q "optimum-onnx[onnxruntime]==0.1.0" "optimum==2.1.0" "transformers==4.57.6"
# Triton Inference Server for `kvexport triton` and its tests, in its own environment:
# nvidia-pytriton (the tritonserver binary + Python backend) pins numpy<2, and its backend
# stub is compiled against numpy 1.x and the system's libpython3.11, so the environment
# that runs the model (EXECUTION_ENV_PATH) is a venv of the system python3.11 with numpy<2,
# kvexport's runtime dependencies (no torch) and kvexport itself (editable: the working tree).
TPY=${TRITON_PYTHON:-/usr/bin/python3.11}
if [ ! -x "$TPY" ] || ! ldconfig -p | grep -c 'libpython3\.11\.so\.1\.0' >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get -qq update && DEBIAN_FRONTEND=noninteractive apt-get -qq install -y python3.11 python3.11-venv libpython3.11 >/dev/null
    fi
fi
if [ -x "$TPY" ]; then
    grep -qs "^home = $(dirname "$TPY")\$" .venv-triton/pyvenv.cfg || { rm -rf .venv-triton; "$TPY" -m venv .venv-triton; }
    .venv-triton/bin/pip install -q --upgrade pip
    .venv-triton/bin/pip install -q "numpy<2" onnx onnxruntime "transformers>=5.0,<6" jinja2
    # structured output (runtime/execution/structured.py) on Triton: xgrammar imports torch (the CPU build,
    # as .venv's; it runs with numpy<2) but not triton-lang, which --no-deps leaves out
    .venv-triton/bin/pip install -q torch==2.13.0 apache-tvm-ffi==0.1.15.post2 jsonschema
    .venv-triton/bin/pip install -q --no-deps xgrammar==0.2.8
    # --no-deps (so pip lists kvexport's and pytriton's other requirements as missing: only
    # the runtime's imports and the server binary are used here)
    .venv-triton/bin/pip install -q --no-deps -e .
    .venv-triton/bin/pip install -q --no-deps nvidia-pytriton==0.7.0
    # the native CPU PagedAttention op, so plugin builds served by Triton run it too. The library
    # links no onnxruntime (it gets the C API at registration) and is compiled for this CPU, so
    # .venv's copy serves .venv-triton as it is (a second compile took minutes)
    LIB=lib/kvexport/libkvexport_ort_ops.so
    if [ -f ".venv/$LIB" ]; then
        mkdir -p .venv-triton/lib/kvexport && cp ".venv/$LIB" ".venv-triton/$LIB.tmp" && mv ".venv-triton/$LIB.tmp" ".venv-triton/$LIB"
    elif [ -f .venv/share/kvexport/onnxruntime-include/onnxruntime_cxx_api.h ]; then
        PYTHON=.venv-triton/bin/python ORT_INCLUDE=.venv/share/kvexport/onnxruntime-include bash scripts/build_cpu_ops.sh \
            || echo "warning: the native CPU PagedAttention op was not built for .venv-triton" >&2
    fi
else
    echo "warning: no $TPY: the Triton tests will be skipped (set TRITON_PYTHON to a system Python 3.11)" >&2
fi
