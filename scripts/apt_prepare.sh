# Sourced by scripts/ensure_*.sh: the checks before installing a Debian package.
# `apt_prepare NAME WHAT SKIPPED` sets SUDO (empty as root, "sudo -n" with password-less
# sudo) and DEBIAN_FRONTEND, or says why NAME cannot be installed and exits 0 (the tests
# that need it skip): WHAT names what is missing, SKIPPED what is skipped without it.
apt_prepare() {
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            SUDO="sudo -n"
        else
            echo "$1: $2 is missing and installing it needs root; run: apt-get install" \
                 "$2 ($3 will be skipped)" >&2
            exit 0
        fi
    else
        SUDO=""
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "$1: $2 is missing and this is not a Debian-like system; install it by hand" \
             "($3 will be skipped)" >&2
        exit 0
    fi
    export DEBIAN_FRONTEND=noninteractive
}
