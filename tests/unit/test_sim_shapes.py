"""The simulator's Responses, Messages and pooling answers have the shapes vLLM 0.32's own
protocol models dump (tests/unit/data/vllm_0_32_shapes.json, from
scripts/vllm/golden_shapes.py): key order, nesting, nulls and value types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.shapes import golden, same_shape

from sluice.sim import messages_api, pooling_api, responses_api
from sluice.sim.messages_api import MessageWriter
from sluice.sim.openai_api import ApiError
from sluice.sim.responses_api import ResponseWriter

GOLDEN = golden()


def sse(data: bytes) -> list[tuple[str, Any]]:
    """`event: KIND\\ndata: JSON\\n\\n` events as (kind, payload)."""
    out = []
    assert data.endswith(b"\n\n")
    for block in data.decode().split("\n\n")[:-1]:
        head, _, body = block.partition("\n")
        assert head.startswith("event: ") and body.startswith("data: ")
        out.append((head[len("event: ") :], json.loads(body[len("data: ") :])))
    return out


def writer(**body: Any) -> ResponseWriter:
    req = responses_api.parse_request(
        {"input": "hello", "model": "m", **body},
        resolve_model=lambda m: "m",
        max_model_len=2048,
        store_enabled=True,
        previous_messages=lambda _: None,
    )
    return ResponseWriter(req)


def test_the_golden_shapes_are_vllm_0_32s() -> None:
    assert GOLDEN["vllm"] == "0.32.0"


def test_a_responses_stream_has_vllms_events_in_order() -> None:
    w = writer(max_output_tokens=2)
    data = b"".join(
        [
            *w.opening_events(),
            *w.first_events(),
            w.delta(0, None),
            w.delta(1, "length"),
            *w.closing_events(2, "length"),
        ]
    )
    events = sse(data)
    kinds = [k for k, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [p["sequence_number"] for _, p in events] == list(range(10))
    for kind, payload in events:
        assert payload["type"] == kind
        assert same_shape(payload, GOLDEN["responses"][kind]), kind
    text = "".join(p["delta"] for k, p in events if k == "response.output_text.delta")
    done = events[-1][1]["response"]
    assert done["output"][0]["content"][0]["text"] == text == w.text(2)
    assert done["status"] == "incomplete"
    assert done["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["usage"]["input_tokens"] == 12 and done["usage"]["output_tokens"] == 2
    # the streamed item and the completed response's item are the same message
    assert done["output"][0]["id"] == events[2][1]["item"]["id"]


def test_a_whole_response_and_a_queued_one_have_vllms_shape() -> None:
    w = writer(max_output_tokens=10)
    final = w.final(10, "length", "msg_1")
    assert same_shape(final, GOLDEN["responses"]["response"])
    assert final["status"] == "incomplete"
    stopped = w.final(3, "stop", "msg_1")
    assert stopped["status"] == "completed" and stopped["incomplete_details"] is None
    queued = writer(background=True).queued()
    assert same_shape(queued, GOLDEN["responses"]["queued"])
    assert (queued["status"], queued["background"], queued["usage"]) == ("queued", True, None)


@pytest.mark.parametrize(
    ("body", "status", "message", "param"),
    [
        ({"prompt": {"id": "p"}}, 400, "prompt template is not supported", "prompt"),
        (
            {"background": True, "store": False},
            400,
            "only be used when `store` is true",
            "background",
        ),
        ({"tool_choice": "required"}, 400, "must be specified with 'tools'", "tool_choice"),
        ({"input": 5}, 400, "valid string or list", "body.input"),
        ({"max_output_tokens": "x"}, 400, "valid integer", "body.max_output_tokens"),
        ({"input": "x" * 8200}, 400, "exceeds the max_model_len 2048", "input"),
        (
            {"previous_response_id": "resp_1"},
            404,
            "Response with id 'resp_1' not found.",
            "response_id",
        ),
    ],
)
def test_responses_request_errors(
    body: dict[str, Any], status: int, message: str, param: str
) -> None:
    with pytest.raises(ApiError) as err:
        writer(**body)
    assert (err.value.status, err.value.param) == (status, param)
    assert message in err.value.message


def test_background_without_the_store_is_vllms_400() -> None:
    with pytest.raises(ApiError) as err:
        responses_api.parse_request(
            {"input": "x", "background": True},
            resolve_model=lambda m: "m",
            max_model_len=2048,
            store_enabled=False,
            previous_messages=lambda _: None,
        )
    assert err.value.message == responses_api.STORE_DISABLED
    assert (err.value.err_type, err.value.param) == ("invalid_request_error", "background")
    silent = responses_api.parse_request(
        {"input": "x"},  # store defaults to true: served, not stored
        resolve_model=lambda m: "m",
        max_model_len=2048,
        store_enabled=False,
        previous_messages=lambda _: None,
    )
    assert silent.store is False


def test_responses_input_items_are_counted_as_chat_messages() -> None:
    req = writer(
        instructions="abcd",
        input=[
            {"role": "user", "content": "abcdefgh"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "abcd"}],
            },
            {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"},
            {"type": "function_call_output", "call_id": "c", "output": "abcd"},
        ],
    ).req
    # 5 for the prompt; 5 per message plus its text: 1, 2, 1, (1 + 1), 1
    assert req.prompt_tokens == 5 + 5 * 5 + 1 + 2 + 1 + 2 + 1


def test_a_messages_stream_has_vllms_events_in_order() -> None:
    w = MessageWriter("chatcmpl-1", "m", 7, None)
    events = sse(w.first() + w.delta(0, None) + w.delta(1, "stop") + w.closing(2, "stop"))
    assert [k for k, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for kind, payload in events:
        assert payload["type"] == kind
        assert same_shape(payload, GOLDEN["messages"][kind]), kind
    assert events[0][1]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert events[5][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[5][1]["usage"] == {"input_tokens": 7, "output_tokens": 2}
    assert sse(w.closing(2, "length"))[1][1]["delta"]["stop_reason"] == "max_tokens"


def test_a_whole_message_count_and_error_have_vllms_shape() -> None:
    w = MessageWriter("chatcmpl-1", "m", 7, None)
    assert same_shape(w.full(1, "stop"), GOLDEN["messages"]["message"])
    count = json.loads(messages_api.count_tokens_body(5))
    assert same_shape(count, GOLDEN["messages"]["count_tokens"])
    err = json.loads(messages_api.anthropic_error_body(ApiError(404, "x", "NotFoundError")))
    assert err == GOLDEN["messages"]["error"]


def test_messages_requests_become_chat_requests() -> None:
    body = {
        "model": "m",
        "max_tokens": 10,
        "system": [{"type": "text", "text": "abcd"}],
        "messages": [
            {"role": "user", "content": "abcdefgh"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "abcd"}],
            },
        ],
    }
    model, g = messages_api.parse_messages(body, max_model_len=2048)
    # prompt 5; system 5 + 1; user 5 + 2; assistant's call 5 + 1 ("f") + 1 ("{}"); tool 5 + 1
    assert (model, g.prompt_tokens, g.max_tokens) == ("m", 5 + 6 + 7 + 7 + 6, 10)
    assert messages_api.count_tokens(body) == ("m", 31)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": [], "max_tokens": 1}, "body.model", "Field required"),
        ({"model": "", "messages": [], "max_tokens": 1}, "model", "Model is required"),
        ({"model": "m", "max_tokens": 1}, "body.messages", "Field required"),
        ({"model": "m", "messages": []}, "body.max_tokens", "Field required"),
        ({"model": "m", "messages": [], "max_tokens": 0}, "max_tokens", "must be positive"),
        (
            {"model": "m", "messages": [{"role": "bot", "content": "x"}], "max_tokens": 1},
            "body.messages.0.role",
            "'user', 'assistant' or 'system'",
        ),
    ],
)
def test_messages_validation_errors_are_fastapis_400(
    body: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(ApiError) as err:
        messages_api.parse_messages(body, max_model_len=2048)
    assert (err.value.status, err.value.param, err.value.err_type) == (400, param, "Bad Request")
    assert message in err.value.message
    # vLLM answers these in OpenAI's shape, from FastAPI's validation handler
    assert json.loads(messages_api.anthropic_error_body(err.value))["error"]["code"] == 400


def test_embeddings_rerank_and_score_have_vllms_shape() -> None:
    emb = pooling_api.parse_embeddings({"input": "a"}, model="m", max_model_len=2048)
    assert same_shape(
        pooling_api.embeddings_response(emb, "embd-1", "m"), GOLDEN["pooling"]["embeddings"]
    )
    coh = pooling_api.parse_cohere(
        {"texts": ["a"], "embedding_types": ["float", "binary", "base64"]},
        model="m",
        max_model_len=2048,
    )
    assert same_shape(pooling_api.cohere_response(coh, "embd-1"), GOLDEN["pooling"]["cohere"])
    rr = pooling_api.parse_rerank({"query": "q", "documents": ["d"]}, max_model_len=2048)
    assert same_shape(pooling_api.rerank_response(rr, "score-1", "m"), GOLDEN["pooling"]["rerank"])
    sc = pooling_api.parse_score({"text_1": "q", "text_2": "d"}, max_model_len=2048)
    assert same_shape(pooling_api.score_response(sc, "score-1", "m"), GOLDEN["pooling"]["score"])
