#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) from the llama.cpp vendored in the llama-cpp-python sdist on PyPI,
# for the side-by-side speculative-decoding benchmark (bench/speculative.py, docs/BENCHMARKS.md).
#
#   bench/build_llama_server.sh [BUILD_ROOT]        # default BUILD_ROOT=/work/llama-build
#
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default 2), NICE (default 15), PIP (default .venv/bin/pip).
# Result: $BUILD_ROOT/bin/llama-server (a copy; the build tree is $BUILD_ROOT/build). About 9-10 minutes on 2 cores.
# Needs cmake >= 3.14 and a C++17 compiler; nothing but PyPI is downloaded (no web UI fetch, no curl/openssl).
set -euo pipefail

ROOT="${1:-/work/llama-build}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
NICE="${NICE:-15}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIP="${PIP:-$HERE/.venv/bin/pip}"

mkdir -p "$ROOT"
cd "$ROOT"
SDIST="llama_cpp_python-${VERSION}.tar.gz"
if [ ! -f "$SDIST" ]; then
  # The sdist only (no wheel, no dependencies): it carries llama.cpp under vendor/llama.cpp.
  "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==${VERSION}" -d .
fi
SRC="$ROOT/llama_cpp_python-${VERSION}/vendor/llama.cpp"
[ -d "$SRC" ] || tar xzf "$SDIST"

# CPU only (GGML_NATIVE tunes for this host's SIMD), Release, only what llama-server needs.
# LLAMA_USE_PREBUILT_UI=OFF / LLAMA_BUILD_UI=OFF: the server builds without downloading its web UI.
nice -n "$NICE" cmake -S "$SRC" -B "$ROOT/build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
nice -n "$NICE" cmake --build "$ROOT/build" --target llama-server -j "$JOBS"

mkdir -p "$ROOT/bin"
cp "$ROOT/build/bin/llama-server" "$ROOT/bin/llama-server"
"$ROOT/bin/llama-server" --version
# The two speculative modes the benchmark uses must be there.
"$ROOT/bin/llama-server" --help | grep -E -- "--spec-type|-md, --spec-draft-model|--model-draft"
echo "built $ROOT/bin/llama-server"
