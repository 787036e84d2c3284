"""The request path's counter and histogram updates (pre-bound children of
prometheus_client's own metrics), in single- and multi-process mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from sluice.gateway.telemetry import Telemetry


def update_every_class(t: Telemetry) -> None:
    for prio in (0, 1, 2):
        key = (prio, "chat")
        t.observe_latency[key](0.3)
        t.observe_latency[key](0.5)  # on a bucket's bound: in that bucket
        t.observe_queue_wait[key](0.0)
        t.observe_ttft[key](2.0)
        t.count[key, "ok"](1)
        t.count[key, "ok"](1)


def test_each_class_gets_its_own_series() -> None:
    t = Telemetry()
    update_every_class(t)
    text = t.render().decode()
    for prio in "012":
        labels = f'priority="{prio}",route="chat"'
        assert f'sluice_request_duration_seconds_bucket{{le="0.5",{labels}}} 2.0' in text
        assert f'sluice_request_duration_seconds_bucket{{le="0.25",{labels}}} 0.0' in text
        assert f"sluice_request_duration_seconds_sum{{{labels}}} 0.8" in text
        assert f'sluice_queue_wait_seconds_bucket{{le="0.025",{labels}}} 1.0' in text
        assert f"sluice_ttft_seconds_sum{{{labels}}} 2.0" in text
        assert f'sluice_requests_total{{outcome="ok",{labels}}} 2.0' in text


MULTIPROCESS = """
from sluice.gateway.telemetry import Telemetry
import sys
sys.path.insert(0, sys.argv[1])
from test_gateway_telemetry import update_every_class

t = Telemetry()
assert t.multiprocess
update_every_class(t)
sys.stdout.write(t.render().decode())
"""


def test_workers_values_add_up_through_their_files(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    here = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MULTIPROCESS), here],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    labels = 'priority="1",route="chat"'
    assert f'sluice_request_duration_seconds_bucket{{le="0.5",{labels}}} 2.0' in text
    assert f"sluice_request_duration_seconds_sum{{{labels}}} 0.8" in text
    assert f'sluice_requests_total{{outcome="ok",{labels}}} 2.0' in text
