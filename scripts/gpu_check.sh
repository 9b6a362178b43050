#!/usr/bin/env bash
# Every GPU check of the project in one go (see ../shared/GPU.md): the PagedAttention
# Triton kernels — correctness at Llama-3-8B shapes against the torch reference, decode
# bandwidth against the copy bandwidth, int8 vs fp16 KV — then the PagedMLA kernels at
# DeepSeek-V3 shapes (plugins/paged_mla/gpu_check.py); both with their attention_scores pass
# (importance eviction: correctness and the cost of a scored step). Results: $OUT/gpu_check.json and
# $OUT/gpu_check_mla.json; then GatedDeltaRule (plugins/gated_delta/gpu_check.py) into
# $OUT/gpu_check_gated_delta.json; summaries on stdout. Needs torch with CUDA and triton (3.6 on the
# lent machine); no TensorRT.
#   OUT=/tmp/out bash scripts/gpu_check.sh            # on the GPU machine
#   bash scripts/gpu_check.sh --tiny                  # the same logic on CPU, toy sizes
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
[ -x "$REPO/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && "$REPO/.venv/bin/python" -c "import torch, triton" 2>/dev/null \
    && PY=$REPO/.venv/bin/python

# The package maps top-level folders into `kvexport.*` (pyproject.toml), so a plain PYTHONPATH
# cannot import it from a checkout; without installing anything, lay out the two parts the
# kernels need (src/kvexport/'s modules and plugins/ as kvexport.plugins) in a temporary folder.
PKG=$(mktemp -d)
trap 'rm -rf "$PKG"' EXIT
mkdir -p "$PKG/kvexport"
cp "$REPO"/src/kvexport/*.py "$PKG/kvexport/"
ln -s "$REPO/plugins" "$PKG/kvexport/plugins"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$OUT/.triton-cache}
cd "$PKG"

"$PY" - <<'PYEOF' || { echo "gpu_check: python environment unusable" >&2; exit 2; }
import sys, torch, triton
print(f"python {sys.version.split()[0]} | torch {torch.__version__} (cuda {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}) | triton {triton.__version__}")
PYEOF

# the whole check is sized to finish well inside 5 minutes; the timeout is a backstop
timeout 280 "$PY" -m kvexport.plugins.paged_attention.gpu_check --out "$OUT" "$@"
rc=$?
[ -f "$OUT/gpu_check.json" ] || echo '{"error": "gpu_check.py wrote nothing (rc '"$rc"')"}' > "$OUT/gpu_check.json"
# PagedMLA (DeepSeek-V2/V3 latent attention): its own report, sized to about 2 minutes
timeout 180 "$PY" -m kvexport.plugins.paged_mla.gpu_check --out "$OUT" "$@"
rc_mla=$?
[ -f "$OUT/gpu_check_mla.json" ] || echo '{"error": "paged_mla gpu_check wrote nothing (rc '"$rc_mla"')"}' \
    > "$OUT/gpu_check_mla.json"
# GatedDeltaRule (Qwen3.5 / Qwen3-Next gated DeltaNet layers): its own report, sized to about a minute
timeout 120 "$PY" -m kvexport.plugins.gated_delta.gpu_check --out "$OUT" "$@"
rc_gdn=$?
[ -f "$OUT/gpu_check_gated_delta.json" ] || echo '{"error": "gated_delta gpu_check wrote nothing (rc '"$rc_gdn"')"}' \
    > "$OUT/gpu_check_gated_delta.json"
[ $rc_gdn -ne 0 ] && [ $rc -eq 0 ] && rc=$rc_gdn
[ $rc -ne 0 ] && exit $rc
exit $rc_mla
