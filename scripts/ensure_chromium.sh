#!/bin/sh
# Make sure Debian's Chromium is at /usr/bin/chromium for the dashboard's browser test
# (tests/e2e/test_dashboard.py). A no-op when it is already there. Installing needs root
# and the Debian package mirrors; without them it says why and leaves the test to skip.
set -eu

CHROMIUM=/usr/bin/chromium

if [ -x "$CHROMIUM" ]; then
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ensure_chromium: $CHROMIUM is missing and installing it needs root;" \
             "run: apt-get install chromium (the dashboard browser test will be skipped)" >&2
        exit 0
    fi
else
    SUDO=""
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: $CHROMIUM is missing and this is not a Debian-like system;" \
         "install Chromium by hand (the dashboard browser test will be skipped)" >&2
    exit 0
fi

echo "ensure_chromium: installing Debian's chromium package (once)..." >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
if [ -x "$CHROMIUM" ]; then
    echo "ensure_chromium: $("$CHROMIUM" --version 2>/dev/null || echo chromium) ready" >&2
else
    echo "ensure_chromium: apt-get finished but $CHROMIUM is still missing" >&2
    exit 1
fi
