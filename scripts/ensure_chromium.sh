#!/bin/sh
# Make sure Debian's Chromium is at /usr/bin/chromium for the dashboard's browser test
# (tests/e2e/test_dashboard.py). A no-op when it is already there. Installing needs root
# and the Debian package mirrors; without them it says why and leaves the test to skip.
set -eu

CHROMIUM=/usr/bin/chromium

if [ -x "$CHROMIUM" ]; then
    exit 0
fi

. "$(dirname "$0")/apt_prepare.sh"
apt_prepare ensure_chromium chromium "the dashboard browser test"

echo "ensure_chromium: installing Debian's chromium package (once)..." >&2
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
if [ -x "$CHROMIUM" ]; then
    echo "ensure_chromium: $("$CHROMIUM" --version 2>/dev/null || echo chromium) ready" >&2
else
    echo "ensure_chromium: apt-get finished but $CHROMIUM is still missing" >&2
    exit 1
fi
