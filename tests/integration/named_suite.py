"""For the real-engine suites (tests/vllm, tests/llamacpp): collected only when the command
line names them (they build and start a real engine), each test bounded in its body only
(building the cache and starting the engine happen in session fixtures with deadlines of
their own)."""

from __future__ import annotations

from pathlib import Path

import pytest


def ignore_unless_named(here: Path, collection_path: Path, config: pytest.Config) -> bool | None:
    if here not in (collection_path, *collection_path.parents):
        return None
    named = [Path(a.split("::")[0]).resolve() for a in config.args]
    if any(p == here or here in p.parents for p in named):
        return None
    return True


def bound_tests(here: Path, items: list[pytest.Item], timeout_s: float) -> None:
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(timeout_s, func_only=True))
