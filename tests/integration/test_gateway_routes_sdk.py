"""The official `openai` and `anthropic` SDKs through the gateway on the routes besides
chat: Responses (stream and not), embeddings, Anthropic Messages (create, stream,
count_tokens), each answer compared with the same request straight to the backend (a
`sluice sim`, whose answer depends only on the prompt and the seed at temperature 0)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest
from conftest import SimProcess, start_sim
from gateway_proc import GatewayProcess, start_gateway

pytestmark = pytest.mark.integration

MODEL = "sluice-sim"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[SimProcess, GatewayProcess]]:
    sim = start_sim("--profile", "tiny", "--speed", "4", "--seed", "3")
    gw = start_gateway([sim.url])
    yield sim, gw
    gw.stop()
    sim.stop()


def _oai(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def _ant(url: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=30)


def test_responses_create_same_as_direct(stack: tuple[SimProcess, GatewayProcess]) -> None:
    sim, gw = stack
    ask = {"model": MODEL, "input": "Tell me about rivers.", "max_output_tokens": 24, **GREEDY}
    direct = _oai(sim.url, "x").responses.create(**ask)  # type: ignore[call-overload]
    via = _oai(gw.url, "sk-demo-p0").responses.create(**ask)  # type: ignore[call-overload]
    assert via.output_text == direct.output_text and via.output_text
    assert via.usage is not None and direct.usage is not None
    assert (via.usage.input_tokens, via.usage.output_tokens) == (
        direct.usage.input_tokens,
        direct.usage.output_tokens,
    )
    assert via.status == direct.status


def test_responses_stream_same_as_direct(stack: tuple[SimProcess, GatewayProcess]) -> None:
    sim, gw = stack
    ask = {"model": MODEL, "input": "Count the bridges.", "max_output_tokens": 16, **GREEDY}

    def run(client: openai.OpenAI) -> tuple[list[str], str, tuple[int, int]]:
        kinds: list[str] = []
        with client.responses.stream(**ask) as stream:  # type: ignore[arg-type]
            for event in stream:
                kinds.append(event.type)
            final = stream.get_final_response()
        assert final.usage is not None
        return kinds, final.output_text, (final.usage.input_tokens, final.usage.output_tokens)

    direct = run(_oai(sim.url, "x"))
    via = run(_oai(gw.url, "sk-demo-p0"))
    assert via == direct
    assert via[0][0] == "response.created" and via[0][-1] == "response.completed"


def test_embeddings_same_as_direct(stack: tuple[SimProcess, GatewayProcess]) -> None:
    sim, gw = stack
    texts = ["a river under a bridge", "seven wizards"]
    direct = _oai(sim.url, "x").embeddings.create(model=MODEL, input=texts)
    via = _oai(gw.url, "sk-demo-p1").embeddings.create(model=MODEL, input=texts)
    assert [d.embedding for d in via.data] == [d.embedding for d in direct.data]
    assert len(via.data) == 2 and len(via.data[0].embedding) > 8
    assert via.usage.prompt_tokens == direct.usage.prompt_tokens


def test_anthropic_messages_create_same_as_direct(
    stack: tuple[SimProcess, GatewayProcess],
) -> None:
    sim, gw = stack
    ask = {
        "model": MODEL,
        "max_tokens": 20,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Tell me about rivers."}],
        "extra_body": GREEDY,  # (this SDK takes no temperature of its own)
    }
    direct = _ant(sim.url, "x").messages.create(**ask)  # type: ignore[arg-type]
    # the anthropic SDK sends its key as x-api-key, which the gateway takes as a Bearer key
    via = _ant(gw.url, "sk-demo-p0").messages.create(**ask)  # type: ignore[arg-type]
    assert [b.model_dump() for b in via.content] == [b.model_dump() for b in direct.content]
    assert via.stop_reason == direct.stop_reason
    assert (via.usage.input_tokens, via.usage.output_tokens) == (
        direct.usage.input_tokens,
        direct.usage.output_tokens,
    )


def test_anthropic_messages_stream_same_as_direct(
    stack: tuple[SimProcess, GatewayProcess],
) -> None:
    sim, gw = stack
    ask = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Count the bridges."}],
        "extra_body": GREEDY,
    }

    def run(client: anthropic.Anthropic) -> tuple[list[str], str, int]:
        kinds: list[str] = []
        with client.messages.stream(**ask) as stream:  # type: ignore[arg-type]
            for event in stream:
                kinds.append(event.type)
            final = stream.get_final_message()
        text = "".join(b.text for b in final.content if b.type == "text")
        return kinds, text, final.usage.output_tokens

    direct = run(_ant(sim.url, "x"))
    via = run(_ant(gw.url, "sk-demo-p0"))
    assert via == direct
    assert via[0][0] == "message_start" and via[0][-1] == "message_stop"


def test_anthropic_count_tokens_same_as_direct(
    stack: tuple[SimProcess, GatewayProcess],
) -> None:
    sim, gw = stack
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "How many tokens is this?"}]}
    direct = _ant(sim.url, "x").messages.count_tokens(**ask)  # type: ignore[arg-type]
    via = _ant(gw.url, "sk-demo-p2").messages.count_tokens(**ask)  # type: ignore[arg-type]
    assert via.input_tokens == direct.input_tokens > 0


def test_anthropic_sdk_raises_its_own_errors(stack: tuple[SimProcess, GatewayProcess]) -> None:
    _sim, gw = stack
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _ant(gw.url, "sk-unknown").messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 401
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"


def test_openai_sdk_refuses_a_background_response_clearly(
    stack: tuple[SimProcess, GatewayProcess],
) -> None:
    _sim, gw = stack
    with pytest.raises(openai.BadRequestError) as caught:
        _oai(gw.url, "sk-demo-p0").responses.create(model=MODEL, input="x", background=True)
    assert caught.value.code == "background_not_supported"
    assert "background" in caught.value.message
