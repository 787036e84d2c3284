"""The bench is an optional part: `pip install sluice` brings what the gateway, the
simulator and the client use, and `sluice bench` / `sluice demo` without the `bench` extra
say how to get it instead of failing on an import."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

from sluice import cli

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _names(requirements: list[str]) -> set[str]:
    return {r.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip() for r in requirements}


def test_the_runtime_dependencies_leave_the_bench_out() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    runtime = _names(project["dependencies"])
    assert not runtime & {"rich", "matplotlib"}, runtime
    assert {"rich", "matplotlib"} <= _names(project["optional-dependencies"]["bench"])


@pytest.mark.parametrize("verb", ["bench", "demo"])
def test_bench_verbs_without_the_extra_say_how_to_install_it(
    verb: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    assert cli.main([verb, "--help"]) == 2
    err = capsys.readouterr().err
    assert f"sluice {verb} needs the optional `bench` part (matplotlib missing)" in err
    assert "pip install 'sluice[bench]'" in err


def test_other_verbs_need_no_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    for verb in ("serve", "sim", "check-config"):
        assert cli.missing_extra(verb) is None
