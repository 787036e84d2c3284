"""The official `openai` SDK, sync and async, streaming and not, against `sluice sim`."""

from __future__ import annotations

import openai
import pytest
from tests.integration.conftest import SimProcess

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Say something, please."}]  # 6 tokens + 10


def test_sync_chat(sim: SimProcess) -> None:
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x")
    completion = client.chat.completions.create(
        model="sluice-sim",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (16, 6)
    assert [m.id for m in client.models.list()] == ["sluice-sim"]


def test_sync_chat_stream(sim: SimProcess) -> None:
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x")
    stream = client.chat.completions.create(
        model="sluice-sim",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text = ""
    usage = None
    finish = None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(text.split()) == 5
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 5 and usage.total_tokens == 21


def test_sync_completions(sim: SimProcess) -> None:
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x")
    completion = client.completions.create(model="sluice-sim", prompt="abcd" * 10, max_tokens=3)
    assert completion.usage is not None and completion.usage.prompt_tokens == 10
    assert 1 <= completion.usage.completion_tokens <= 3
    stream = client.completions.create(
        model="sluice-sim",
        prompt="abcd",
        max_tokens=4,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert len([c for c in stream if c.choices and c.choices[0].text]) == 4


def test_sdk_errors_map_to_sdk_exceptions(sim: SimProcess) -> None:
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(
            model="sluice-sim",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=5000,
        )


async def test_async_chat_and_stream(sim: SimProcess) -> None:
    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x")
    try:
        completion = await client.chat.completions.create(
            model="sluice-sim",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 4
        stream = await client.chat.completions.create(
            model="sluice-sim",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        contents = [c.choices[0].delta.content async for c in stream if c.choices]
        assert contents[0] == ""  # the role chunk, as vLLM sends it
        assert len([c for c in contents if c]) == 3
    finally:
        await client.close()
