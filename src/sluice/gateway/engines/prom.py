"""Reading the few wanted series out of a Prometheus text page, fast.

The gateway scrapes every 250 ms on its own event loop, and a vLLM /metrics page is ~56 KB
(~450 samples) of which about 40 lines matter: a full Prometheus parse of it took ~24 ms
of CPU, enough to stall every stream the gateway relays (and its notice of client
disconnects) under CPU contention. So the page is scanned line by line and only the lines
of the wanted series are parsed (well under a millisecond). Histograms are turned into
P95s over the window since the previous scrape (bucket deltas), so the figures are recent
rather than lifetime averages. Pure: text in, numbers out."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_LE = re.compile(r'(?:^|[,\s])le\s*=\s*"([^"]*)"')


def quantile(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style histogram_quantile over (le, cumulative count) pairs."""
    if not cumulative:
        return None
    total = cumulative[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in cumulative:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _sample(line: str) -> tuple[str, str, float]:
    """`name{labels} value [timestamp]` -> (name, labels text, value); ValueError if
    the line is not a sample."""
    brace = line.find("{")
    if brace < 0:
        parts = line.split()
        if len(parts) < 2:
            raise ValueError(f"not a sample: {line[:80]!r}")
        return parts[0], "", float(parts[1])
    close = line.rfind("}")
    rest = line[close + 1 :].split()
    if close < brace or not rest:
        raise ValueError(f"not a sample: {line[:80]!r}")
    return line[:brace].strip(), line[brace + 1 : close], float(rest[0])


def labels(text: str) -> dict[str, str]:
    return {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(text)}


@dataclass
class Page:
    """The wanted series of one page."""

    values: dict[str, float] = field(default_factory=dict)  # summed over label sets
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # le -> cumulative
    infos: dict[str, dict[str, str]] = field(default_factory=dict)  # an info gauge's labels

    def first(self, names: Iterable[str]) -> float | None:
        for n in names:
            if n in self.values:
                return self.values[n]
        return None

    def has_any(self, names: Iterable[str]) -> bool:
        return any(n in self.values or n in self.buckets for n in names)


class Scanner:
    """Scans pages for a fixed set of series: `values` (gauges, and counters named with or
    without `_total`), `histograms` (their `_bucket` lines) and `infos` (labels only)."""

    def __init__(
        self, values: Iterable[str], histograms: Iterable[str] = (), infos: Iterable[str] = ()
    ) -> None:
        self._values = frozenset(values)
        self._buckets = {f"{h}_bucket": h for h in histograms}
        self._infos = frozenset(infos)
        starts = {*self._values, *(f"{n}_total" for n in self._values), *self._buckets}
        self._starts = tuple(sorted(starts | self._infos))

    def scan(self, text: str) -> Page:
        """Raises ValueError on a malformed line among the wanted series."""
        page = Page()
        values, hists, infos = page.values, page.buckets, page.infos
        for line in text.split("\n"):
            if not line.startswith(self._starts):
                continue  # comments, blank lines, the other series
            end = line.find("{")
            if end < 0:
                end = line.find(" ")
            name = line[:end].rstrip() if end >= 0 else line
            key = name.removesuffix("_total")  # counters, whichever way TYPE spells them
            if key in self._values:
                value = _sample(line)[2]
                values[key] = values.get(key, 0.0) + value
            elif name in self._buckets:
                _, text_labels, value = _sample(line)
                m = _LE.search(text_labels)
                if m is None:
                    raise ValueError(f"a histogram bucket without le: {line[:80]!r}")
                le = float(m.group(1))
                h = hists.setdefault(self._buckets[name], {})
                h[le] = h.get(le, 0.0) + value
            elif name in self._infos:
                infos[name] = labels(_sample(line)[1])
        return page


class WindowedP95:
    """P95 of a histogram over the window since the previous page (bucket deltas)."""

    def __init__(self) -> None:
        self._prev: dict[str, dict[float, float]] = {}

    def update(self, page: Page, names: Iterable[str]) -> tuple[float | None, bool]:
        """(P95 of the first of `names` on the page, whether any of them is there)."""
        for name in names:
            h = page.buckets.get(name)
            if h is None:
                continue
            prev = self._prev.get(name)
            self._prev[name] = h
            les = sorted(h)
            window = [(le, h[le] - (prev.get(le, 0.0) if prev else 0.0)) for le in les]
            if window and window[-1][1] < 0:
                # A restarted backend resets its counters: the lifetime figures.
                window = [(le, h[le]) for le in les]
            return quantile(window, 0.95), True
        return None, False


def int_or_none(value: object) -> int | None:
    if value is None:
        return None
    try:
        return int(float(str(value)))
    except ValueError:
        return None
