"""The `openai` SDK against a real llama-server, directly and through Sluice: the same
answers (greedy decoding), streamed and not, chat and completions; and the gateway reads
llama.cpp through its own adapter (detected from /metrics, with what llama.cpp lacks)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from conftest import CTX, SLOTS, LlamaServer, wait_idle
from gateway_proc import start_gateway

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": "Bearer sk-demo-admin"}
MESSAGES = [{"role": "user", "content": "tell me the name of the water you find"}]


def _chat(client: openai.OpenAI, model: str, stream: bool) -> tuple[str, str | None, int]:
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "seed": 7}
    if not stream:
        r = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        return (
            r.choices[0].message.content or "",
            r.choices[0].finish_reason,
            r.usage.completion_tokens,
        )
    text, finish, tokens = "", None, 0
    for chunk in client.chat.completions.create(  # type: ignore[call-overload]
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, finish, tokens


def _completion(client: openai.OpenAI, model: str) -> tuple[str, str | None]:
    r = client.completions.create(
        model=model, prompt="the people of the water", max_tokens=20, temperature=0, seed=3
    )
    return r.choices[0].text, r.choices[0].finish_reason


def test_the_openai_sdk_gets_the_same_answers_directly_and_through_sluice(
    llama: LlamaServer,
) -> None:
    wait_idle(llama)
    direct = openai.OpenAI(base_url=llama.url + "/v1", api_key="none", max_retries=0)
    expected = {
        "chat": _chat(direct, llama.model, stream=False),
        "chat-stream": _chat(direct, llama.model, stream=True),
        "completion": _completion(direct, llama.model),
    }
    assert expected["chat"][0] and expected["completion"][0], expected
    gw = start_gateway([llama.url])
    try:
        via = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-demo-p1", max_retries=0)
        assert [m.id for m in via.models.list().data] == [llama.model]
        got = {
            "chat": _chat(via, llama.model, stream=False),
            "chat-stream": _chat(via, llama.model, stream=True),
            "completion": _completion(via, llama.model),
        }
    finally:
        gw.stop()
    assert got == expected
    # streamed and whole answers agree with each other too
    assert expected["chat"] == expected["chat-stream"]


def test_the_gateway_reads_llamacpp_through_its_adapter(llama: LlamaServer) -> None:
    wait_idle(llama)
    gw = start_gateway([llama.url])
    try:
        deadline = time.monotonic() + 15
        while True:
            state = httpx.get(gw.url + "/admin/state", headers=ADMIN, timeout=5).json()
            b = state["controller"]["backends"]["backend-0"]
            if b["signals"] is not None and b["metrics_fresh"]:
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        assert state["backends"]["backend-0"]["engine"] == "llamacpp"
        lacks = {s for s, has in b["signals"].items() if not has}
        assert lacks == {"preemptions", "ttft_p95", "tpot_p95"}, b
        assert b["limiter"]["kv_capacity_tokens"] == sum(s["n_ctx"] for s in llama.slots())
        assert len(llama.slots()) == SLOTS
        m = gw.metrics()
        key = 'sluice_backend_signal{backend="backend-0",signal="waiting"}'
        assert m[key] == 1.0, sorted(k for k in m if "signal" in k)
        # a prompt larger than the slots' whole context is the gateway's to refuse, at once
        huge = {"model": llama.model, "prompt": [1] * (CTX + 1), "max_tokens": 4}
        headers = {"Authorization": "Bearer sk-demo-p1"}
        r = httpx.post(gw.url + "/v1/completions", json=huge, headers=headers, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        m = gw.metrics()
        labels = 'code="context_length_exceeded",priority="1",route="completions"'
        assert m["sluice_rejections_total{" + labels + "}"] == 1.0
    finally:
        gw.stop()
