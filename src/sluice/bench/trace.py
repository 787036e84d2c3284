"""Production request traces: read the Azure LLM inference trace and BurstGPT CSV files.

Two formats, told apart by the header line (nothing else is guessed):

* **Azure LLM inference trace** (the Azure Public Dataset's 2023 `AzureLLMInferenceTrace_*`
  and 2024 `*_1week` releases): `TIMESTAMP,ContextTokens,GeneratedTokens`. TIMESTAMP is a
  date and time (`2023-11-16 18:15:46.6805900`; the 2024 files add a UTC offset,
  `2024-05-10 00:00:00.009930+00:00`), read as UTC when it has no offset.
* **BurstGPT** (`Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`;
  newer releases add `Session ID` and `Elapsed time`, which are kept as columns too):
  Timestamp is seconds from the start of the collection. A row with 0 response tokens is a
  request that failed in the original service; it is skipped and counted (`skipped`).

Anything else (another header, a row with the wrong number of fields, a token count that
is not a non-negative integer, a time that does not parse) is refused with a `TraceError`
naming the file and the 1-based line. A `.gz` file is read through gzip. Arrival times are
seconds from the trace's first request; rows out of order are sorted (stably).
"""

from __future__ import annotations

import bisect
import csv
import gzip
import io
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

AZURE = "azure"
BURSTGPT = "burstgpt"

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_REQUIRED = ("Timestamp", "Request tokens", "Response tokens")
_BURSTGPT_COLUMNS = (
    "Timestamp",
    "Model",
    "Request tokens",
    "Response tokens",
    "Total tokens",
    "Log Type",
)


class TraceError(ValueError):
    """A trace file that cannot be replayed; `line` is 1-based (None: the file itself)."""

    def __init__(self, source: str, line: int | None, reason: str) -> None:
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {reason}")
        self.source = source
        self.line = line
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TraceRequest:
    line: int  # where it is in the file (1-based; the header is line 1)
    at: float  # arrival, seconds from the trace's first request
    prompt_tokens: int
    output_tokens: int
    column: str | None = None  # the value of the column asked for (`read_trace(column=)`)


@dataclass(frozen=True, slots=True)
class Trace:
    source: str
    format: str  # AZURE or BURSTGPT
    columns: tuple[str, ...]
    requests: tuple[TraceRequest, ...]  # by arrival
    skipped: int = 0  # rows left out (BurstGPT's failed requests)

    @property
    def duration(self) -> float:
        return self.requests[-1].at if self.requests else 0.0

    def slice(self, start: float = 0.0, duration: float | None = None) -> Trace:
        """The requests arriving in [start, start + duration), re-timed from `start`."""
        if start < 0 or (duration is not None and duration <= 0):
            raise ValueError("a slice needs start >= 0 and duration > 0")
        end = math.inf if duration is None else start + duration
        picked = tuple(replace(r, at=r.at - start) for r in self.requests if start <= r.at < end)
        return replace(self, requests=picked)

    def busiest(self, window_s: float) -> tuple[float, float]:
        """(requests per second, start) of the busiest `window_s`-long window: the most
        arrivals in any [t, t + window_s), t an arrival time."""
        if window_s <= 0:
            raise ValueError("the window must be positive")
        times = [r.at for r in self.requests]
        best, best_at = 0, 0.0
        for i, t in enumerate(times):
            n = bisect.bisect_left(times, t + window_s, lo=i) - i
            if n > best:
                best, best_at = n, t
        return best / window_s, best_at


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _count(value: str, name: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name} {value!r} is not an integer") from None
    if n < 0:
        raise ValueError(f"{name} {n} is negative")
    return n


def _azure_time(value: str) -> float:
    try:
        t = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"TIMESTAMP {value!r} is not a date and time") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


def _seconds(value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise ValueError(f"Timestamp {value!r} is not a number of seconds") from None
    if not math.isfinite(t):
        raise ValueError(f"Timestamp {value!r} is not a number of seconds")
    return t


def detect_format(header: list[str]) -> str | None:
    names = tuple(h.strip() for h in header)
    if names == _AZURE_COLUMNS:
        return AZURE
    if all(c in names for c in _BURSTGPT_REQUIRED) and "Model" in names:
        return BURSTGPT
    return None


def _rows(path: Path, source: str) -> Iterator[tuple[int, list[str]]]:
    try:
        f = _open_text(path)
    except OSError as exc:
        raise TraceError(source, None, f"cannot read ({exc.strerror or exc})") from exc
    with f:
        reader = csv.reader(f)
        try:
            for row in reader:
                yield reader.line_num, row
        except (csv.Error, UnicodeDecodeError, OSError, EOFError) as exc:
            raise TraceError(source, reader.line_num + 1, f"not CSV text ({exc})") from exc


def read_trace(path: str | Path, *, column: str | None = None) -> Trace:
    """Read a trace file. `column`: keep this column's value on each request (for a class
    rule that reads it); it must exist in the file."""
    path = Path(path)
    source = str(path)
    rows = _rows(path, source)
    first = next(rows, None)
    if first is None:
        raise TraceError(source, None, "empty file (no header line)")
    _, header = first
    header = [h.strip() for h in header]
    if header and header[0].startswith("\ufeff"):
        header[0] = header[0][1:]
    fmt = detect_format(header)
    if fmt is None:
        raise TraceError(
            source,
            1,
            "not a known trace format: the header must be "
            + ",".join(_AZURE_COLUMNS)
            + " (Azure LLM inference trace) or "
            + ",".join(_BURSTGPT_COLUMNS)
            + " (BurstGPT), got "
            + ",".join(header),
        )
    if column is not None and column not in header:
        raise TraceError(
            source, 1, f"no column {column!r} to assign classes by (columns: {', '.join(header)})"
        )
    index = {name: i for i, name in enumerate(header)}
    if fmt == AZURE:
        t_i, p_i, o_i = (index[c] for c in _AZURE_COLUMNS)
        parse_time = _azure_time
    else:
        t_i, p_i, o_i = (index[c] for c in _BURSTGPT_REQUIRED)
        parse_time = _seconds
    c_i = None if column is None else index[column]
    width = len(header)
    raw: list[tuple[float, int, int, int, str | None]] = []
    skipped = 0
    for line, row in rows:
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # a blank line (one at the end is common)
        if len(row) != width:
            raise TraceError(source, line, f"{len(row)} fields, the header has {width}")
        try:
            at = parse_time(row[t_i])
            prompt = _count(row[p_i], header[p_i])
            output = _count(row[o_i], header[o_i])
        except ValueError as exc:
            raise TraceError(source, line, str(exc)) from None
        if fmt == BURSTGPT and output == 0:
            skipped += 1  # failed in the original service: nothing to replay
            continue
        if prompt == 0 or output == 0:
            raise TraceError(
                source, line, "a request needs at least one prompt and one output token"
            )
        raw.append((at, line, prompt, output, None if c_i is None else row[c_i].strip()))
    if not raw:
        raise TraceError(source, None, "no request to replay")
    raw.sort(key=lambda x: (x[0], x[1]))
    t0 = raw[0][0]
    requests = tuple(
        TraceRequest(line=line, at=at - t0, prompt_tokens=p, output_tokens=o, column=c)
        for at, line, p, o, c in raw
    )
    return Trace(
        source=source, format=fmt, columns=tuple(header), requests=requests, skipped=skipped
    )


# -- traces shipped with Sluice ---------------------------------------------------------

BUILTIN_TRACES = {"azure-conv-2023": "AzureLLMInferenceTrace_conv_2023.csv.gz"}


def resolve_trace_path(name: str, relative_to: Path | None = None) -> Path:
    """A trace by path (absolute, from the working directory, or beside `relative_to`, the
    scenario file) or by the name of one shipped with Sluice."""
    path = Path(name)
    if path.is_absolute() or path.exists():
        return path
    if relative_to is not None and (relative_to / path).exists():
        return relative_to / path
    if name in BUILTIN_TRACES:
        from importlib import resources

        resource = resources.files("sluice.bench").joinpath(f"traces/{BUILTIN_TRACES[name]}")
        with resources.as_file(resource) as p:
            return Path(p)
    known = ", ".join(sorted(BUILTIN_TRACES))
    raise TraceError(name, None, f"no such file, nor a trace shipped with Sluice ({known})")
