"""Property-based tests of the gateway's input handling, against real processes: whatever
headers and bodies a client sends, the answer is never a 5xx and never a crash, every
error is in OpenAI's shape, and a well-formed request in flight meanwhile is unharmed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from conftest import SimProcess, start_sim
from gateway_proc import GatewayProcess, start_gateway
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration

_HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(
    str.strip
)
_KEYS = st.sampled_from(["sk-demo-p0", "sk-demo-p1", "sk-demo-p2", "nope", ""])
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[SimProcess, GatewayProcess]]:
    sim = start_sim("--profile", "tiny", "--speed", "20")
    gw = start_gateway([sim.url])
    yield sim, gw
    gw.stop()
    sim.stop()


def _body(draw_obj: Any, model: str) -> dict[str, Any]:
    """Mostly-valid chat bodies with one field replaced by something arbitrary."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    if isinstance(draw_obj, dict):
        body.update({k: v for k, v in draw_obj.items() if k})
    return body


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500 or r.status_code in (502, 503, 504), r.text
    assert r.status_code != 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert "type" in err and "code" in err


_FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@settings(max_examples=150, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(
    key=_KEYS,
    priority=st.one_of(st.none(), _HEADER_TEXT, st.sampled_from(["0", "1", "2", "3", "-1"])),
    timeout=st.one_of(
        st.none(), _HEADER_TEXT, st.sampled_from(["0", "-1", "nan", "inf", "1e9", "0.5"])
    ),
    feature=st.one_of(st.none(), _HEADER_TEXT, st.just("summarize")),
    fields=st.dictionaries(
        st.sampled_from(
            [
                "model",
                "messages",
                "max_tokens",
                "max_completion_tokens",
                "stream",
                "stream_options",
                "prompt",
                "n",
                "temperature",
                "ignore_eos",
                "extra",
            ]
        ),
        _JSON,
        max_size=3,
    ),
    completions=st.booleans(),
)
def test_headers_and_json_bodies_never_give_a_server_error(
    stack: tuple[SimProcess, GatewayProcess],
    key: str,
    priority: str | None,
    timeout: str | None,
    feature: str | None,
    fields: dict[str, Any],
    completions: bool,
) -> None:
    _, gw = stack
    headers = {"Authorization": f"Bearer {key}".strip()}
    for name, value in (
        ("X-Priority", priority),
        ("X-Request-Timeout", timeout),
        ("X-Sluice-Feature", feature),
    ):
        if value is not None:
            headers[name] = value
    body = _body(fields, "sluice-sim")
    path = "/v1/completions" if completions else "/v1/chat/completions"
    if completions:
        body.setdefault("prompt", "hello")
    r = httpx.post(gw.url + path, content=orjson.dumps(body), headers=headers, timeout=30)
    _check(r)


@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(
    raw=st.binary(max_size=300),
    content_type=st.sampled_from(
        ["application/json", "text/plain", "application/x-www-form-urlencoded", ""]
    ),
)
def test_arbitrary_bytes_are_a_clean_400(
    stack: tuple[SimProcess, GatewayProcess], raw: bytes, content_type: str
) -> None:
    _, gw = stack
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        content=raw,
        headers={"Authorization": "Bearer sk-demo-p0", "Content-Type": content_type},
        timeout=30,
    )
    _check(r)
    if r.status_code != 200:
        assert r.status_code in (400, 404, 413)


def test_bad_requests_do_not_harm_a_stream_in_flight(
    stack: tuple[SimProcess, GatewayProcess],
) -> None:
    _, gw = stack
    result: dict[str, Any] = {}

    def stream() -> None:
        with httpx.stream(
            "POST",
            gw.url + "/v1/chat/completions",
            headers={"Authorization": "Bearer sk-demo-p0"},
            json={
                "model": "sluice-sim",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 300,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            timeout=60,
        ) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        result["lines"] = lines

    t = threading.Thread(target=stream)
    t.start()
    for raw in (b"{", b"[]", b'{"model": 3}', b"\xff" * 100, b'{"model":"x","messages":[]}'):
        _check(
            httpx.post(
                gw.url + "/v1/chat/completions",
                content=raw,
                headers={"Authorization": "Bearer sk-demo-p1"},
            )
        )
    t.join(60)
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]"
    usage = orjson.loads(lines[-2][6:])["usage"]
    assert usage["completion_tokens"] == 300
