#!/bin/sh
# Make sure Debian's redis-server is installed for the shared-quota tests
# (tests/integration/test_redis_quota.py starts its own instance on a free port; nothing
# here starts a server). A no-op when redis-server is already on the PATH. Installing needs
# root and the Debian package mirrors; without them it says why and leaves the tests to skip.
set -eu

if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi

. "$(dirname "$0")/apt_prepare.sh"
apt_prepare ensure_redis redis-server "the Redis quota tests"

echo "ensure_redis: installing Debian's redis-server package (once)..." >&2
$SUDO apt-get update -qq
# policy-rc.d 101: the package must not start a system-wide server on port 6379; the
# tests start their own on a free port.
POLICY=/usr/sbin/policy-rc.d
CREATED_POLICY=""
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod +x "$POLICY"
    CREATED_POLICY=1
fi
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
if [ -n "$CREATED_POLICY" ]; then
    $SUDO rm -f "$POLICY"
fi
if command -v redis-server >/dev/null 2>&1; then
    echo "ensure_redis: $(redis-server --version) ready" >&2
else
    echo "ensure_redis: apt-get finished but redis-server is still missing" >&2
    exit 1
fi
