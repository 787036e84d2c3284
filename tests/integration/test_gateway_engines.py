"""A real gateway in front of one real `sluice sim --engine NAME` per engine: each engine
is detected from what it answers (or pinned with `engine:`), read by its own adapter, and
/admin/state, the sluice_backend_signal metric and the requests through it show it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tests.integration.conftest import SimFactory
from tests.integration.gateway_proc import EXAMPLE_POLICY, start_gateway

from sluice.bench.real import free_port
from sluice.core.types import SIGNALS

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": "Bearer sk-demo-admin"}
LACKS = {
    "vllm": set(),
    "sglang": set(),
    "trtllm": set(),
    "llamacpp": {"preemptions", "ttft_p95", "tpot_p95"},
    "tgi": {"preemptions", "ttft_p95"},
    "none": set(SIGNALS),
}


def _state(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/admin/state", headers=ADMIN, timeout=5)
    r.raise_for_status()
    return r.json()


@pytest.mark.timeout(300)  # eight processes start: slow on a busy machine
def test_each_engine_is_read_by_its_adapter_through_the_gateway(sim_factory: SimFactory) -> None:
    backends = []
    for engine in ("vllm", "sglang", "trtllm", "llamacpp", "tgi"):
        sim = sim_factory("--profile", "tiny", "--speed", "4", "--engine", engine)
        backends.append({"name": f"b-{engine}", "url": sim.url})
    # a vLLM pinned `none` (metrics not read) and a TGI pinned by name
    extra = sim_factory("--profile", "tiny", "--speed", "4")
    backends.append({"name": "b-none", "url": extra.url, "engine": "none"})
    pinned = sim_factory("--profile", "tiny", "--speed", "4", "--engine", "tgi")
    backends.append({"name": "b-tgi-pinned", "url": pinned.url, "engine": "tgi"})
    # a server that is no inference engine at all: not recognised, read as `none`
    port = free_port()
    plain = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    backends.append({"name": "b-unknown", "url": f"http://127.0.0.1:{port}"})
    policy = yaml.safe_load(Path(EXAMPLE_POLICY).read_text())
    policy["backends"] = backends
    gw = start_gateway([], yaml.safe_dump(policy))
    try:
        deadline = time.monotonic() + 20
        while True:
            state = _state(gw.url)
            ctl = state["controller"]["backends"]
            if all(ctl[b["name"]]["signals"] is not None for b in backends):
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        assert state["backends"]["b-unknown"]["engine"] is None  # looked at again later
        for b in backends[:-1]:
            name = b["name"]
            engine = b.get("engine", name.removeprefix("b-"))
            assert state["backends"][name]["engine"] == engine
            assert state["backends"][name]["engine_pinned"] == b.get("engine", "auto")
            assert ctl[name]["engine"] == engine
            lacks = {s for s, has in ctl[name]["signals"].items() if not has}
            assert lacks == LACKS[engine], (name, ctl[name])
            assert ctl[name]["metrics_fresh"] == (engine != "none")
        m = gw.metrics()
        assert (
            m['sluice_backend_signal{backend="b-llamacpp",engine="llamacpp",signal="waiting"}'] == 1
        )
        assert m['sluice_backend_signal{backend="b-tgi",engine="tgi",signal="ttft_p95"}'] == 0
        assert m['sluice_backend_signal{backend="b-none",engine="none",signal="running"}'] == 0
        assert m['sluice_backend_metrics_fresh{backend="b-trtllm"}'] == 1
        # requests go through whatever engine serves them
        headers = {"Authorization": "Bearer sk-demo-p1"}
        body = {"model": "sluice-sim", "prompt": "hello " * 20, "max_tokens": 4}
        for _ in range(14):
            r = httpx.post(gw.url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
        lacks = {s for s, has in ctl["b-unknown"]["signals"].items() if not has}
        assert ctl["b-unknown"]["engine"] == "none" and lacks == set(SIGNALS)
    finally:
        gw.stop()
        plain.terminate()
        plain.wait()
    log = "\n".join(gw.output)
    assert "backend b-llamacpp: engine llamacpp" in log
    assert "backend b-unknown: engine not recognised" in log


@pytest.mark.parametrize("engine", ["sglang", "tgi", "llamacpp"])
def test_a_prompt_larger_than_a_cache_stated_in_tokens_is_refused_at_once(
    sim_factory: SimFactory, engine: str
) -> None:
    # SGLang's max_total_num_tokens, TGI's max_batch_total_tokens and llama.cpp's slots'
    # n_ctx hold the prompt as vLLM's blocks do: tiny holds 4,096 tokens
    sim = sim_factory("--profile", "tiny", "--speed", "4", "--engine", engine)
    policy = yaml.safe_load(Path(EXAMPLE_POLICY).read_text())
    policy["backends"] = [{"name": "b0", "url": sim.url}]
    gw = start_gateway([], yaml.safe_dump(policy))
    try:
        deadline = time.monotonic() + 20
        while not _state(gw.url)["controller"]["backends"]["b0"]["signals"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        headers = {"Authorization": "Bearer sk-demo-p1"}
        url = gw.url + "/v1/completions"
        huge = {"model": "sluice-sim", "prompt": [7] * 5000, "max_tokens": 4}
        r = httpx.post(url, json=huge, headers=headers, timeout=30)
        assert r.status_code == 400 and "retry-after" not in r.headers, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        rejected = gw.metrics()
        labels = 'code="context_length_exceeded",priority="1",route="completions"'
        key = "sluice_rejections_total{" + labels + "}"
        assert rejected.get(key) == 1, {k: v for k, v in rejected.items() if "reject" in k}
        fits = {"model": "sluice-sim", "prompt": [7] * 200, "max_tokens": 4}
        assert httpx.post(url, json=fits, headers=headers, timeout=30).status_code == 200
    finally:
        gw.stop()
