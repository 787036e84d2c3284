"""The official `openai` and `anthropic` SDKs as real clients of a `sluice sim` process, on
the routes besides chat and completions: Responses (stream and not), embeddings, Anthropic
Messages (create, stream, count_tokens) and their errors."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from tests.integration.conftest import SimProcess, start_sim

pytestmark = pytest.mark.integration

MODEL = "sluice-sim"


@pytest.fixture(scope="module")
def shared_sim() -> Iterator[SimProcess]:
    sim = start_sim("--profile", "tiny", "--speed", "4")
    yield sim
    sim.stop()


def oai(sim: SimProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0, timeout=20)


def ant(sim: SimProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=sim.url, api_key="x", max_retries=0, timeout=20)


# -- Responses -----------------------------------------------------------------------------


def test_responses_create(shared_sim: SimProcess) -> None:
    client = oai(shared_sim)
    # "Say hi" is 2 tokens, plus 5 for the message and 5 for the prompt
    response = client.responses.create(
        model=MODEL, input="Say hi", max_output_tokens=7, extra_body={"ignore_eos": True}
    )
    assert response.object == "response"
    assert response.status == "incomplete"  # stopped at max_output_tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert len(response.output_text.split()) == 7
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (12, 7)
    assert response.usage.total_tokens == 19
    assert response.model == MODEL


def test_responses_same_answer_for_a_greedy_request(shared_sim: SimProcess) -> None:
    client = oai(shared_sim)
    ask = {"model": MODEL, "input": "What is 2+2?", "instructions": "Be brief.", "temperature": 0}
    first = client.responses.create(max_output_tokens=50, **ask)  # type: ignore[call-overload]
    second = client.responses.create(max_output_tokens=50, **ask)  # type: ignore[call-overload]
    assert first.output_text == second.output_text
    assert first.id != second.id
    assert first.usage is not None and second.usage is not None
    # the instructions are a system message: 3 + 5, the input 3 + 5, the prompt 5
    assert first.usage.input_tokens == 21


def test_responses_stream(shared_sim: SimProcess) -> None:
    client = oai(shared_sim)
    kinds: list[str] = []
    sequence: list[int] = []
    text = ""
    completed = None
    with client.responses.stream(
        model=MODEL, input="Count to five", max_output_tokens=5, extra_body={"ignore_eos": True}
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            sequence.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                completed = event.response
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 5,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert sequence == list(range(len(kinds)))
    assert completed is not None and completed.usage is not None
    assert completed.output_text == text
    assert (completed.usage.input_tokens, completed.usage.output_tokens) == (14, 5)


def test_responses_errors(shared_sim: SimProcess) -> None:
    client = oai(shared_sim)
    with pytest.raises(openai.NotFoundError, match="The model `other` does not exist"):
        client.responses.create(model="other", input="x")
    with pytest.raises(openai.BadRequestError, match="does not support `store=True`"):
        client.responses.create(model=MODEL, input="x", background=True)  # store is off
    with pytest.raises(openai.BadRequestError, match="exceeds the max_model_len 2048"):
        client.responses.create(model=MODEL, input="word " * 2000)
    with pytest.raises(openai.NotFoundError, match="Response with id 'resp_none' not found"):
        client.responses.retrieve("resp_none")


# -- embeddings ----------------------------------------------------------------------------


def test_embeddings_float_and_base64_agree(shared_sim: SimProcess) -> None:
    client = oai(shared_sim)
    texts = ["the quick brown fox", "a lazy dog"]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1]
    assert all(len(d.embedding) == 384 for d in floats.data)
    assert sum(v * v for v in floats.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    assert floats.usage.prompt_tokens == 5 + 3 == floats.usage.total_tokens
    # the SDK asks for base64 by default and decodes it; the values are the same float32s
    default = client.embeddings.create(model=MODEL, input=texts)
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    raw = httpx.post(
        shared_sim.url + "/v1/embeddings",
        json={"input": texts[0], "encoding_format": "base64"},
        timeout=10,
    ).json()
    decoded = struct.unpack("<384f", base64.b64decode(raw["data"][0]["embedding"]))
    assert list(decoded) == floats.data[0].embedding
    short = client.embeddings.create(model=MODEL, input=texts[0], dimensions=64)
    assert len(short.data[0].embedding) == 64


def test_embeddings_are_the_same_in_another_process(shared_sim: SimProcess) -> None:
    other = start_sim("--profile", "tiny", "--seed", "7")
    try:
        here = oai(shared_sim).embeddings.create(model=MODEL, input="same text")
        there = oai(other).embeddings.create(model=MODEL, input="same text")
    finally:
        other.stop()
    assert here.data[0].embedding == there.data[0].embedding


# -- Anthropic Messages --------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Hello, Claude"}]  # 4 tokens + 5 + 5


def test_messages_create(shared_sim: SimProcess) -> None:
    # the SDK no longer takes `temperature`; vLLM still does: greedy gives the same answer
    greedy = {"temperature": 0}
    message = ant(shared_sim).messages.create(
        model=MODEL, max_tokens=6, messages=MESSAGES, system="Be kind.", extra_body=greedy
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens")
    block = message.content[0]
    assert block.type == "text"
    assert 1 <= len(block.text.split()) <= 6
    assert message.usage.input_tokens == 14 + 2 + 5  # the system prompt: 2 + 5
    assert message.usage.output_tokens == len(block.text.split())
    again = ant(shared_sim).messages.create(
        model=MODEL, max_tokens=6, messages=MESSAGES, system="Be kind.", extra_body=greedy
    )
    assert again.content[0].type == "text" and again.content[0].text == block.text


def test_messages_stream(shared_sim: SimProcess) -> None:
    kinds: list[str] = []
    with ant(shared_sim).messages.stream(
        model=MODEL, max_tokens=4, messages=MESSAGES, extra_body={"ignore_eos": True}
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    # the SDK adds its own "text" events after each content_block_delta
    raw = [k for k in kinds if k != "text"]
    assert raw == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 4,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == 14 and final.usage.output_tokens == 4
    assert final.content[0].type == "text" and len(final.content[0].text.split()) == 4


def test_messages_count_tokens(shared_sim: SimProcess) -> None:
    client = ant(shared_sim)
    count = client.messages.count_tokens(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert count.input_tokens == 14
    created = client.messages.create(model=MODEL, max_tokens=1, messages=MESSAGES)  # type: ignore[arg-type]
    assert created.usage.input_tokens == count.input_tokens


def test_messages_errors_in_anthropics_shape(shared_sim: SimProcess) -> None:
    client = ant(shared_sim)
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client.messages.create(model="other", max_tokens=5, messages=MESSAGES)  # type: ignore[arg-type]
    assert not_found.value.body == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "The model `other` does not exist."},
    }
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.create(model=MODEL, max_tokens=4000, messages=MESSAGES)  # type: ignore[arg-type]
    body = too_long.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert "maximum context length is 2048 tokens" in body["error"]["message"]
