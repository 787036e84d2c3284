"""The SDK installs without the server: beyond what httpx itself loads, importing it loads
only its own modules and the standard library."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import httpx
before = set(sys.modules)
import sluice.client
added = set(sys.modules) - before
print(" ".join(sorted(m for m in added if m.split(".")[0] not in sys.stdlib_module_names)))
"""


def test_importing_the_sdk_loads_only_the_sdk_httpx_and_the_stdlib() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    assert "sluice.client.transport" in loaded
    assert [m for m in loaded if m != "sluice" and not m.startswith("sluice.client")] == []
