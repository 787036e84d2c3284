"""The live dashboard in a real headless Chromium: two `sluice sim --profile tiny` processes,
a real `sluice serve`, a burst of streaming traffic, and the page at /dashboard watched while
the burst runs. Skipped only when Debian's Chromium is not installed
(scripts/ensure_chromium.sh installs it)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEYS = ["sk-demo-p0", "sk-demo-p1", "sk-demo-p2", "sk-demo-p2"]  # P2-heavy, like a batch job
CLIENTS = 80  # concurrent streams: well above the two backends' starting limits (8 each)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM),
        reason=f"{CHROMIUM} is missing: run scripts/ensure_chromium.sh "
        "(installs Debian's chromium package)",
    ),
]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _integration_helpers() -> tuple[ModuleType, ModuleType]:
    """Reuse tests/integration's process helpers. gateway_proc.py does `from conftest import
    ...`; give it the integration conftest without disturbing whichever conftest pytest has
    loaded as `conftest`."""
    here = Path(__file__).resolve().parents[1] / "integration"
    conftest = _load("sluice_integration_conftest", here / "conftest.py")
    saved = sys.modules.get("conftest")
    sys.modules["conftest"] = conftest
    try:
        gateway_proc = _load("sluice_integration_gateway_proc", here / "gateway_proc.py")
    finally:
        if saved is None:
            del sys.modules["conftest"]
        else:
            sys.modules["conftest"] = saved
    return conftest, gateway_proc


_conftest, _gateway_proc = _integration_helpers()


@pytest.fixture
def gateway_url() -> Iterator[str]:
    sims = [_conftest.start_sim("--profile", "tiny", "--seed", str(i)) for i in range(2)]
    try:
        gw = _gateway_proc.start_gateway([s.url for s in sims])
        try:
            yield gw.url
        finally:
            gw.stop()
    finally:
        for s in sims:
            s.stop()


class Burst:
    """CLIENTS streaming clients in a background thread, each sending requests back to back
    until stop() is called; stop() lets the requests under way finish (none is cut), so
    the gateway settles afterwards. `statuses` counts the answers by HTTP status."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.statuses: Counter[int | str] = Counter()
        self.scheduled = 0  # 429s whose client will come back with the booking they gave
        self.returns = 0  # ... attempts sent back with it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the burst's requests did not finish"

    async def _one(
        self, client: httpx.AsyncClient, rng: random.Random, key: str, booking: str | None
    ) -> tuple[int | str, httpx.Headers | None]:
        body = {
            "model": "sluice-sim",
            "stream": True,
            "max_tokens": rng.randint(16, 96),
            "messages": [{"role": "user", "content": "lorem " * rng.randint(50, 300)}],
        }
        headers = {"Authorization": "Bearer " + key}
        if booking is not None:
            headers["X-Sluice-Booking"] = booking
            self.returns += 1
        try:
            async with client.stream(
                "POST", self.url + "/v1/chat/completions", json=body, headers=headers
            ) as response:
                async for _ in response.aiter_bytes():
                    pass
                return response.status_code, response.headers
        except httpx.HTTPError as e:
            return type(e).__name__, None

    async def _client(self, client: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        booking = None
        key = rng.choice(KEYS)
        while not self._stop.is_set():
            if booking is None:
                key = rng.choice(KEYS)
            status, headers = await self._one(client, rng, key, booking)  # a return: same key
            self.statuses[status] += 1
            booking = None
            if status == 429 and headers is not None:
                # back at a short Retry-After with the booking it gave (a long one would
                # outlast the test: then a short back-off, as a fresh request)
                ra = int(headers.get("retry-after-ms", "100")) / 1000
                if ra <= 6.0 and "x-sluice-booking" in headers:
                    booking = headers["x-sluice-booking"]
                    self.scheduled += 1
                await asyncio.sleep(ra if booking else 0.1)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(timeout=20.0, limits=limits) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(CLIENTS)))


# In the page: are the counters of the last state it drew equal to `want`?
SAME_COUNTERS = """want => {
  const eq = (a, b) => a !== null && typeof a === "object"
    ? b !== null && typeof b === "object" && Object.keys(a).length === Object.keys(b).length
      && Object.keys(a).every((k) => eq(a[k], b[k]))
    : a === b;
  return eq(sluiceDashboard.lastState.counters, want);
}"""


def _settled_state(url: str, timeout: float = 15.0) -> dict[str, Any]:
    """The gateway's /dashboard/state once nothing is queued or in flight and two reads
    half a second apart agree."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        state = httpx.get(url + "/dashboard/state", timeout=5).json()
        ctl = state["controller"]
        idle = all(c["queued"] == 0 for c in ctl["classes"].values()) and all(
            b["inflight"] == 0 for b in ctl["backends"].values()
        )
        if idle and last is not None and last["counters"] == state["counters"]:
            return state
        last = state if idle else None
        time.sleep(0.5)  # the page's own poll period; we wait for two equal reads
    raise AssertionError("the gateway did not settle after the burst")


def _chart(page: Any, chart: str) -> tuple[int, float]:
    """(points drawn, largest value drawn) of a chart, from its data attributes."""
    attrs = page.eval_on_selector(
        f'canvas[data-chart="{chart}"]', "c => [c.dataset.points, c.dataset.max]"
    )
    return int(attrs[0] or 0), float(attrs[1] or 0)


def test_dashboard_charts_follow_a_burst(gateway_url: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(gateway_url + "/dashboard")

            # Idle gateway: the page polls, says "live", and draws flat charts.
            page.wait_for_function(
                "window.sluiceDashboard && sluiceDashboard.polls >= 3", timeout=10_000
            )
            assert page.inner_text("#status") == "live"
            polls_before = page.evaluate("sluiceDashboard.polls")
            points_before, queue_before = _chart(page, "queue")
            assert points_before >= 2
            assert queue_before == 0
            assert page.eval_on_selector_all("[data-chart^=backend-]", "cs => cs.length") == 2

            # During the burst the charts fill: requests queue, backends have work in flight.
            burst = Burst(gateway_url)
            burst.start()
            try:
                page.wait_for_function(
                    """() => ['queue', 'inflight'].every(
                         n => Number(document.querySelector(`[data-chart="${n}"]`)
                                       .dataset.max) > 0)""",
                    timeout=15_000,
                )
                seen = page.evaluate("sluiceDashboard.polls")
                page.wait_for_function(f"sluiceDashboard.polls >= {seen + 2}", timeout=5_000)
                page.screenshot(path=str(tmp_path / "dashboard-burst.png"), full_page=True)
                cards = page.inner_text("#backend-charts")
            finally:
                burst.stop()

            assert page.evaluate("sluiceDashboard.polls") > polls_before + 2
            points_after, queue_max = _chart(page, "queue")
            assert points_after > points_before
            assert queue_max > 0
            _, inflight_max = _chart(page, "inflight")
            assert inflight_max > 0
            assert "in flight" in cards and "limit" in cards
            rejected = [_chart(page, f"rejected-P{i}")[1] for i in range(3)]
            admitted_points, admitted_max = _chart(page, "admitted")
            assert admitted_points > 0 and admitted_max > 0
            assert sum(burst.statuses.values()) > CLIENTS
            if burst.statuses[429]:  # the gateway refused some: the page drew those refusals
                page.wait_for_function(
                    "[0,1,2].some(i => Number(document.querySelector("
                    '`[data-chart="rejected-P${i}"]`).dataset.max) > 0)',
                    timeout=5_000,
                )
                assert _chart(page, "retry")[1] > 0  # and the Retry-After they were given

            # Once the burst is over the page shows the gateway's numbers as they are now:
            # the same counters, empty queues and idle backends in the tiles.
            settled = _settled_state(gateway_url)
            page.wait_for_function(SAME_COUNTERS, arg=settled["counters"], timeout=5_000)
            back = [c["returns"] for c in settled["controller"]["classes"].values()]
            if any(r["returned_admitted"] for r in back):  # some were let in on their return
                assert _chart(page, "returns")[1] > 0
            if any(r["waited"] for r in back):
                assert _chart(page, "waited")[1] > 0
            for c in ("P0", "P1", "P2"):
                assert page.inner_text(f'#tile-{c} [data-field="queued"]') == "0"
            drawn = page.evaluate("sluiceDashboard.lastState.controller.backends")
            assert list(drawn) == list(settled["controller"]["backends"])
            for i, (name, b) in enumerate(drawn.items()):
                card = page.inner_text(f"#backend-{i}")
                assert name in card and f"in flight 0 / limit {b['limit']}" in card
                # the simulator presents vLLM's surface: detected, every signal there
                assert "engine vllm · every signal" in card, card

            # Polls that fail turn the page "disconnected"; it recovers by itself.
            page.route("**/dashboard/state", lambda route: route.abort())
            page.wait_for_function(
                "document.getElementById('status').textContent === 'disconnected'", timeout=5_000
            )
            assert "Disconnected" in page.inner_text("#banner")
            page.unroute("**/dashboard/state")
            polls = page.evaluate("sluiceDashboard.polls")
            page.wait_for_function(
                f"sluiceDashboard.connected && sluiceDashboard.polls > {polls}", timeout=5_000
            )
            assert page.inner_text("#status") == "live"
            assert not page.is_visible("#banner")
            assert errors == []
            print(
                f"burst: {dict(burst.statuses)}; returns {burst.returns} of "
                f"{burst.scheduled} told to come back within 6 s; "
                f"rejected/s max per class {rejected}"
            )
        finally:
            browser.close()
