#!/usr/bin/env bash
# Build the native CPU PagedAttention op (plugins/paged_attention/cpu/paged_attention_ort.cc)
# into the environment: <venv>/lib/kvexport/libkvexport_ort_ops.so, compiled for this CPU.
#
# The onnxruntime wheel ships no C/C++ headers. The npm package com.github.asus4.onnxruntime
# carries onnxruntime's release headers (C API version 29); only the headers are extracted,
# once, into <venv>/share/kvexport/onnxruntime-include. The library works with any installed
# onnxruntime whose API version is >= 29 (kvexport.plugins.paged_attention.native checks).
# PYTHON picks the environment (default .venv); ORT_INCLUDE reuses headers already fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PREFIX=$("$PY" -c 'import sys; print(sys.prefix)')
INC=${ORT_INCLUDE:-"$PREFIX/share/kvexport/onnxruntime-include"}
PKG=com.github.asus4.onnxruntime@0.4.9
HDRS='package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64/onnxruntime.framework/Headers'
if [ ! -f "$INC/onnxruntime_cxx_api.h" ]; then
    command -v npm >/dev/null || { echo "error: npm is needed to fetch the onnxruntime headers ($PKG)" >&2; exit 1; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    (cd "$tmp" && npm pack --silent "$PKG" >/dev/null)
    tar -xzf "$tmp"/*.tgz -C "$tmp" --wildcards "$HDRS/*"
    mkdir -p "$INC.tmp" && cp "$tmp/$HDRS"/*.h "$INC.tmp"/ && rm -rf "$INC" && mv "$INC.tmp" "$INC"
fi
"$PY" -P -m kvexport.plugins.paged_attention.native --include "$INC"
