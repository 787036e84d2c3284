"""The request path's cheaper histogram and counter updates expose exactly what
prometheus_client's own observe()/inc() would, in single- and multi-process mode."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from sluice.gateway.telemetry import LATENCY_BUCKETS, Telemetry, fast_inc, fast_observe

# bounds exactly, between them, below the first, past the last, and odd ones
AMOUNTS = [0.0, 0.025, 0.0250001, 0.003, -1.0, 1.0, 59.9, 60.0, 120.0, 121.0, 1e9, 7]
ODD = [math.inf, math.nan]


def exposition(fast: bool, amounts: list[float]) -> bytes:
    r = CollectorRegistry()
    h = Histogram("h_seconds", "h", ["priority"], buckets=LATENCY_BUCKETS, registry=r)
    c = Counter("c", "c", ["priority", "outcome"], registry=r)
    child, counter = h.labels("0"), c.labels("0", "ok")
    for a in amounts:
        if fast:
            fast_observe(child)(a)
            fast_inc(counter)(1)
        else:
            child.observe(a)
            counter.inc()
    return b"\n".join(line for line in generate_latest(r).splitlines() if b"_created" not in line)


def test_single_process_exposition_is_the_same() -> None:
    assert exposition(True, AMOUNTS + ODD) == exposition(False, AMOUNTS + ODD)
    assert b'h_seconds_bucket{le="0.025",priority="0"} 4.0' in exposition(True, AMOUNTS)


def test_the_telemetry_uses_it_for_every_class() -> None:
    t = Telemetry()
    for prio in (0, 1, 2):
        key = (prio, "chat")
        t.observe_latency[key](0.3)
        t.observe_queue_wait[key](0.0)
        t.observe_ttft[key](2.0)
        t.count[key, "ok"](1)
        t.count[key, "ok"](1)
    text = t.render().decode()
    for prio in "012":
        labels = f'priority="{prio}",route="chat"'
        assert f'sluice_request_duration_seconds_bucket{{le="0.5",{labels}}} 1.0' in text
        assert f'sluice_request_duration_seconds_bucket{{le="0.25",{labels}}} 0.0' in text
        assert f'sluice_queue_wait_seconds_bucket{{le="0.025",{labels}}} 1.0' in text
        assert f"sluice_ttft_seconds_sum{{{labels}}} 2.0" in text
        assert f'sluice_requests_total{{outcome="ok",{labels}}} 2.0' in text


MULTIPROCESS = """
import sys
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.multiprocess import MultiProcessCollector
from sluice.gateway.telemetry import LATENCY_BUCKETS, fast_inc, fast_observe

amounts = [float(x) for x in sys.argv[1:]]
for name, fast in (("fast", True), ("slow", False)):
    h = Histogram(name + "_seconds", "h", ["priority"], buckets=LATENCY_BUCKETS)
    c = Counter(name + "_requests", "c", ["priority"])
    for a in amounts:
        if fast:
            fast_observe(h.labels("1"))(a)
            fast_inc(c.labels("1"))(1)
        else:
            h.labels("1").observe(a)
            c.labels("1").inc()
r = CollectorRegistry()
MultiProcessCollector(r)
samples = {}
for fam in r.collect():
    for s in fam.samples:
        kind, rest = s.name.split("_", 1)
        samples.setdefault(kind, set()).add((rest, tuple(sorted(s.labels.items())), repr(s.value)))
assert samples["fast"] == samples["slow"] and len(samples["fast"]) > 10, samples
print("same")
"""


def test_multiprocess_exposition_is_the_same(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MULTIPROCESS), *map(str, AMOUNTS + ODD)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "same"
