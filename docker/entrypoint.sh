#!/usr/bin/env bash
# Entry point of the kvexport images (docker/README.md).
#   build MODEL [kvexport build options]          export MODEL into /models/builds/<name>
#   triton BUILD_DIR [kvexport triton options]    write /models/repo for BUILD_DIR, then exec tritonserver on it
#   serve BUILD_DIR [kvexport serve options]      the OpenAI-compatible server on 0.0.0.0:8000
#   anything else                                 exec'd as given (kvexport ..., tritonserver ..., bash)
set -euo pipefail
MODELS=${KVEXPORT_MODELS:-/models}

case "${1:-}" in
    build)
        shift
        model=${1:?usage: build MODEL [options]}
        shift
        name=$(basename "${model%.gguf}")
        exec kvexport build "$model" --out "$MODELS/builds/$name" "$@"
        ;;
    triton)
        shift
        build_dir=${1:?usage: triton BUILD_DIR [kvexport triton options]}
        shift
        kvexport triton "$build_dir" --out "$MODELS/repo" --force "$@"
        exec tritonserver --model-repository="$MODELS/repo" ${TRITONSERVER_ARGS:-}
        ;;
    serve)
        shift
        build_dir=${1:?usage: serve BUILD_DIR [options]}
        shift
        exec kvexport serve "$build_dir" --host 0.0.0.0 --port 8000 "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
