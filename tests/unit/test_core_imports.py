"""The core imports nothing of Sluice outside it (docs/architecture.md, "Which part may
import which"): not the policy's models, not the gateway, the simulator, the bench or the
CLI. Its settings are its own (core/settings.py)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "src" / "sluice" / "core"


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_the_core_imports_only_the_core_of_sluice() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 20  # the walk found the core
    outside = {
        f"{path.relative_to(CORE)}: {name}"
        for path in files
        for name in _imported(path)
        if (name == "sluice" or name.startswith("sluice.")) and not name.startswith("sluice.core")
    }
    assert outside == set()
