#!/usr/bin/env bash
# Build the native CPU PagedAttention op (plugins/paged_attention/cpu/paged_attention_ort.cc) and
# PagedMLA (plugins/paged_mla/cpu/paged_mla_ort.cc) and GatedDeltaRule (plugins/gated_delta/cpu/
# gated_delta_ort.cc), the same library and domain, into the
# environment: <venv>/lib/kvexport/libkvexport_ort_ops.so, compiled for this CPU (the sources
# compile at the same time, one g++ each, then link: native.build).
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
PKG=com.github.asus4.onnxruntime@0.4.9
# sha256 of that package's tarball (npm also checks the registry's integrity hash)
PKG_SHA256=e59788788818fdde1b2e522e766a21ba0f7d8391de55737abf81e32cc801785d
HDRS='package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64/onnxruntime.framework/Headers'
if [ -n "${ORT_INCLUDE:-}" ]; then
    INC=$ORT_INCLUDE
    [ -f "$INC/onnxruntime_cxx_api.h" ] || { echo "error: ORT_INCLUDE=$INC has no onnxruntime_cxx_api.h" >&2; exit 1; }
else
    INC="$PREFIX/share/kvexport/onnxruntime-include"
fi
if [ ! -f "$INC/onnxruntime_cxx_api.h" ]; then
    command -v npm >/dev/null || { echo "error: npm is needed to fetch the onnxruntime headers ($PKG)" >&2; exit 1; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    (cd "$tmp" && npm pack --silent "$PKG" >/dev/null)
    echo "$PKG_SHA256  $(ls "$tmp"/*.tgz)" | sha256sum -c --quiet - \
        || { echo "error: $PKG does not have the expected sha256" >&2; exit 1; }
    tar -xzf "$tmp"/*.tgz -C "$tmp" --wildcards "$HDRS/*"
    rm -rf "$INC.tmp" && mkdir -p "$INC.tmp" && cp "$tmp/$HDRS"/*.h "$INC.tmp"/ && rm -rf "$INC" && mv "$INC.tmp" "$INC"
fi
"$PY" -P -m kvexport.plugins.paged_attention.native --include "$INC"
