"""Trace replay (issue 16): the Azure LLM inference trace and BurstGPT CSV files are read
as their publishers wrote them, anything else is refused with its line number, and a
trace scenario replays the slice asked for with the classes, lengths and time scale
docs/bench.md promises."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sluice.bench.runner import make_plan
from sluice.bench.scenario import ScenarioError, load_scenario
from sluice.bench.trace import AZURE, BURSTGPT, TraceError, read_trace, resolve_trace_path
from sluice.cli import main

AZURE_2023 = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
"""

AZURE_2024 = """TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-10 00:00:00.009930+00:00,100,10
2024-05-10 02:00:01+02:00,200,20
2024-05-10 00:00:02.5+00:00,300,30
"""

BURSTGPT_V2 = (
    "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,"
    "Log Type\n"
    """5,a,1,ChatGPT,472,18,490,Conversation log
45,b,1,ChatGPT,1087,230,1317,Conversation log
50,c,1,GPT-4,300,0,300,Conversation log
118,d,1,GPT-4,417,276,693,API log
"""
)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_azure_2023_rows_become_requests_in_seconds_from_the_first(tmp_path: Path) -> None:
    trace = read_trace(_write(tmp_path, "a.csv", AZURE_2023))
    assert trace.format == AZURE
    assert [r.line for r in trace.requests] == [2, 3, 4]
    assert [round(r.at, 6) for r in trace.requests] == [0.0, 4.314579, 4.541877]
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.requests] == [
        (374, 44),
        (396, 109),
        (879, 55),
    ]


def test_azure_2024_offsets_are_honoured_and_rows_sorted(tmp_path: Path) -> None:
    trace = read_trace(_write(tmp_path, "b.csv", AZURE_2024))
    # 02:00:01+02:00 is 00:00:01 UTC: between the two others
    assert [r.line for r in trace.requests] == [2, 3, 4]
    assert [round(r.at, 6) for r in trace.requests] == [0.0, 0.99007, 2.49007]


def test_burstgpt_keeps_a_column_and_skips_failed_requests(tmp_path: Path) -> None:
    trace = read_trace(_write(tmp_path, "c.csv", BURSTGPT_V2), column="Model")
    assert trace.format == BURSTGPT
    assert trace.skipped == 1  # 0 response tokens: failed in the original service
    assert [(r.at, r.prompt_tokens, r.output_tokens, r.column) for r in trace.requests] == [
        (0.0, 472, 18, "ChatGPT"),
        (40.0, 1087, 230, "ChatGPT"),
        (113.0, 417, 276, "GPT-4"),
    ]


def test_gzip_files_are_read_through(tmp_path: Path) -> None:
    path = tmp_path / "a.csv.gz"
    path.write_bytes(gzip.compress(AZURE_2023.encode()))
    assert len(read_trace(path).requests) == 3


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("a,b,c\n1,2,3\n", 1, "not a known trace format"),
        ("", None, "empty file"),
        (AZURE_2023 + "2023-11-16 18:16:00,12\n", 5, "2 fields, the header has 3"),
        (AZURE_2023 + "2023-11-16 18:16:00,12,x\n", 5, "GeneratedTokens 'x' is not an integer"),
        (AZURE_2023 + "2023-11-16 18:16:00,-3,4\n", 5, "ContextTokens -3 is negative"),
        (AZURE_2023 + "yesterday,3,4\n", 5, "not a date and time"),
        (AZURE_2023 + "2023-11-16 18:16:00,0,4\n", 5, "at least one prompt"),
        (
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\nx,M,1,1,2,L\n",
            2,
            "not a number of seconds",
        ),
    ],
)
def test_bad_files_are_refused_with_their_line(
    tmp_path: Path, text: str, line: int | None, reason: str
) -> None:
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert err.value.line == line
    assert reason in str(err.value)
    assert str(err.value).startswith(f"{path}:{line}:" if line else f"{path}:")


def test_a_class_column_must_exist(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no column 'Model'"):
        read_trace(_write(tmp_path, "a.csv", AZURE_2023), column="Model")


def test_the_shipped_trace_is_the_azure_conversation_hour() -> None:
    path = resolve_trace_path("azure-conv-2023")
    assert path.name == "AzureLLMInferenceTrace_conv_2023.csv.gz"
    assert (path.parent / "README.md").read_text().count("CC BY 4.0") >= 1
    trace = read_trace(path)
    assert len(trace.requests) == 19366
    assert round(trace.duration) == 3502
    assert trace.busiest(60.0)[0] == pytest.approx(8.7)
    part = trace.slice(600, 120)
    assert part.requests[0].at >= 0 and part.duration < 120
    assert all(600 <= r.at + 600 < 720 for r in part.requests)


SCENARIO = """
name: small-trace
backends: {count: 2, profile: tiny}
clients:
  P0: {deadline: 30s}
trace:
  path: azure-conv-2023
  start: 1800s
  duration: 120s
  peak: 2
  classes: {P0: 0.2, P1: 0.4, P2: 0.4}
"""


def test_a_trace_scenario_replays_its_slice_at_the_peak_asked_for(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.yaml", SCENARIO)
    plan = make_plan(load_scenario(str(path)))
    trace = plan.scenario.trace
    assert trace is not None
    n = len(trace.requests)
    assert len(plan.workload) == n == plan.trace["requests"]
    k = plan.trace["time_scale"]
    # the busiest minute of the slice now offers 2 x the two backends' capacity
    capacity = plan.capacities[0].rps * 2
    busiest = trace.busiest(60.0)[0]
    assert busiest * k == pytest.approx(2 * capacity, rel=1e-3)
    assert plan.scenario.duration == pytest.approx(trace.duration / k, rel=1e-3)
    by_line = {r.line: r for r in trace.requests}
    counts = [0, 0, 0]
    for req, row in zip(plan.workload, trace.requests, strict=True):
        assert req.arrival == pytest.approx(row.at / k, rel=1e-3)
        # outputs are forced: the request declares exactly what it will generate
        assert req.output_tokens == req.max_tokens == min(row.output_tokens, 2047)
        assert req.prompt_tokens + req.output_tokens <= 2048  # tiny's max_model_len
        assert by_line[row.line] is row
        counts[req.priority] += 1
    assert [round(c / n, 1) for c in counts] == [0.2, 0.4, 0.4]
    assert plan.trace["prompts_clamped"] == sum(
        1 for r in trace.requests if r.prompt_tokens + min(r.output_tokens, 2047) > 2048
    )
    # a request keeps its class whatever else changes (a stable hash of its line)
    other = make_plan(
        load_scenario(str(path), {"trace": {"start": 1860, "duration": 60, "peak": 1}})
    )
    mine = {row.line: req.priority for req, row in zip(plan.workload, trace.requests, strict=True)}
    theirs = other.scenario.trace
    assert theirs is not None
    shared = [
        (mine[row.line], req.priority)
        for req, row in zip(other.workload, theirs.requests, strict=True)
        if row.line in mine
    ]
    assert len(shared) > 50 and all(a == b for a, b in shared)


def test_a_class_column_maps_values_to_classes(tmp_path: Path) -> None:
    _write(tmp_path, "b.csv", BURSTGPT_V2)
    scenario = """
name: by-model
backends: {count: 1, profile: tiny}
trace: {path: b.csv, classColumn: Model, classValues: {GPT-4: P0, ChatGPT: P2}}
"""
    path = _write(tmp_path, "m.yaml", scenario)
    plan = make_plan(load_scenario(str(path)))
    assert [r.priority for r in plan.workload] == [2, 2, 0]
    bad = _write(tmp_path, "n.yaml", scenario.replace("ChatGPT: P2", "Other: P2"))
    with pytest.raises(ScenarioError, match=r"b\.csv:2: Model 'ChatGPT' has no class"):
        load_scenario(str(bad))


def test_a_trace_scenario_refuses_routes(tmp_path: Path) -> None:
    """The replay sends every request of a trace to chat: a route mix beside a trace is
    refused rather than silently ignored."""
    _write(tmp_path, "b.csv", BURSTGPT_V2)
    scenario = """
name: trace-routes
backends: {count: 1, profile: tiny}
trace: {path: b.csv}
routes: {chat: {share: 0.5}, embeddings: {share: 0.5, pooling: true}}
"""
    path = _write(tmp_path, "r.yaml", scenario)
    with pytest.raises(ScenarioError, match="routes: not with a trace"):
        load_scenario(str(path))
    plain = _write(
        tmp_path,
        "p.yaml",
        scenario.replace(", embeddings: {share: 0.5, pooling: true}", "").replace("0.5}", "1}"),
    )
    assert len(make_plan(load_scenario(str(plain))).workload) == 3


def test_bench_refuses_a_bad_trace_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _write(tmp_path, "bad.csv", AZURE_2023 + "2023-11-16 18:16:00,1,2,3\n")
    assert main(["bench", "--trace", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert f"{bad}:5: 4 fields, the header has 3" in capsys.readouterr().err.replace("\n", "")
    assert main(["bench", "burst", "--peak", "2"]) == 2
    assert "the trace options need --trace" in capsys.readouterr().err


def test_bench_replays_a_trace_file_from_the_command_line(tmp_path: Path) -> None:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [
        f"2023-11-16 18:15:{i // 10:02d}.{i % 10}000000,{100 + 7 * i % 200},{20 + i % 30}"
        for i in range(300)
    ]
    path = _write(tmp_path, "mini.csv", "\n".join(rows) + "\n")
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "--trace",
            str(path),
            "--peak",
            "1.5",
            "--arms",
            "direct,sluice,litellm",
            "--out",
            str(out),
            "--no-plots",
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["scenario"] == "trace-mini"
    assert results["plan"]["trace"]["requests"] == 300
    assert results["plan"]["trace"]["peak_x_capacity"] == 1.5
    for arm in results["arms"].values():
        assert sum(c["offered"] for c in arm["classes"].values()) == 300
