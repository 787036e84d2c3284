# Shared by the engines' build scripts (scripts/vllm/build.sh, scripts/llamacpp/build.sh):
# a cache directory outside the checkout, held under a lock while it is built, whose parts
# count as built only once their stamp files are written. Source it, then call
# `cache_open NAME DIR` and, for a fresh venv, `cache_new_venv`.

# cache_open NAME DIR: create DIR, take its lock (released when the script exits) and
# define `log` (messages on stderr, prefixed with NAME)
cache_open() {
    CACHE_NAME="$1"
    CACHE="$2"
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.lock"
    flock 9
}

log() { echo "$CACHE_NAME: $*" >&2; }

# cache_new_venv: a new $CACHE/venv (an interrupted build left one without its stamp),
# with a `pip` function for it that hides the machine's pip-config noise
cache_new_venv() {
    rm -rf "$CACHE/venv"
    "${PYTHON:-python3}" -m venv "$CACHE/venv"
    pip install --quiet --upgrade pip
}

pip() {
    "$CACHE/venv/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location '" >&2)
}

# cache_stamp PART: mark $CACHE/PART as complete
cache_stamp() { touch "$CACHE/$1/.sluice-complete"; }
