#!/usr/bin/env bash
# guidellm (https://github.com/vllm-project/guidellm), installed as its docs say
# (`pip install guidellm`) into a venv cached outside the checkout, with the CPU build of
# torch that lies on this machine's disk (torch==2.13.0: asked for first, so that pip
# does not fetch a CUDA build), and a small tokenizer built offline (no hub at run time).
# Prints the venv's folder. Safe to run concurrently (flock).
set -euo pipefail
VERSION="${GUIDELLM_VERSION:-0.8.1}"
CACHE="${SLUICE_CACHE:-$HOME/.cache/sluice}"
DIR="$CACHE/guidellm-$VERSION"
HERE="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$CACHE"
exec 9>"$DIR.lock"
flock 9
if [ ! -x "$DIR/bin/guidellm" ]; then
  echo "installing guidellm $VERSION into $DIR (a few minutes, once)" >&2
  python3 -m venv "$DIR"
  "$DIR/bin/pip" install -q torch==2.13.0
  "$DIR/bin/pip" install -q "guidellm==$VERSION"
fi
if [ ! -f "$DIR/tokenizer/tokenizer.json" ]; then
  HF_HUB_OFFLINE=1 "$DIR/bin/python" "$HERE/tokenizer.py" "$DIR/tokenizer" >&2
fi
echo "$DIR"
