"""`POST /v1/audio/transcriptions` and `POST /v1/audio/translations`: multipart uploads,
answered as vLLM 0.32 answers them (vllm/entrypoints/speech_to_text/transcription/,
translation/ and base/serving.py): JSON `{"text", "usage": {"type": "duration",
"seconds"}}` (translations: `{"text"}`), for `response_format` "json" and "text" alike, or,
with `stream=true`, SSE chunks of `transcription.chunk` / `translation.chunk` objects with
a `finish_reason` at the end of each 30 s window, an optional usage chunk
(`stream_include_usage`, `stream_continuous_usage_stats`) and `data: [DONE]`. What an
upload costs the engine is `sim.audio`'s rule. `language` defaults to "en" (vLLM would
detect it with one more engine request). "verbose_json" and "diarized_json" are refused
as vLLM refuses them for a model without segment timestamps or diarization."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import BodyPartReader, web

from sluice.sim import audio, fields, tokens
from sluice.sim.driver import RequestHandle
from sluice.sim.engine import FINISH_ABORT, EngineRequest
from sluice.sim.openai_api import DONE_CHUNK, ApiError, bad_request, new_id
from sluice.sim.serving import (
    SSE_HEADERS,
    engine_id,
    error_response,
    header_request_id,
    json_response,
    run_to_end,
)

if TYPE_CHECKING:
    from sluice.sim.server import SimServer

FORMATS = ("json", "text", "srt", "verbose_json", "vtt", "diarized_json")


def _flag(form: dict[str, Any], name: str) -> bool:
    value = form.get(name)
    if value is None:
        return False
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", ""):
        return False
    raise fields.invalid(name, "Input should be a valid boolean", "bool_type")


async def _read_form(request: web.Request) -> tuple[dict[str, str], bytes]:
    if not request.content_type.startswith("multipart/"):
        raise fields.invalid("file", "Field required", "missing")
    form: dict[str, str] = {}
    data: bytes | None = None
    try:
        reader = await request.multipart()
        async for part in reader:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "file":
                data = bytes(await part.read(decode=False))
            elif part.name:
                form[part.name] = await part.text()
    except (ValueError, AssertionError, UnicodeDecodeError, LookupError) as exc:
        # a malformed multipart body (no boundary, bad headers, an unknown charset)
        raise bad_request(f"malformed multipart body: {exc}") from None
    if data is None:
        raise fields.invalid("file", "Field required", "missing")
    return form, data


class AudioRoutes:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/audio/transcriptions", self.transcriptions)
        app.router.add_post("/v1/audio/translations", self.translations)

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self._speech_to_text(request, "transcribe")

    async def translations(self, request: web.Request) -> web.StreamResponse:
        return await self._speech_to_text(request, "translate")

    async def _speech_to_text(self, request: web.Request, task: str) -> web.StreamResponse:
        server = self.server
        max_model_len = server.profile.max_model_len
        try:
            form, data = await _read_form(request)
            model = server.models_registry.resolve(form.get("model"))
            fmt = form.get("response_format") or "json"
            if fmt not in FORMATS:
                raise fields.invalid("response_format", f"Input should be one of {FORMATS}")
            if fmt not in ("text", "json", "verbose_json", "diarized_json"):
                raise bad_request(
                    "Currently only support response_format: `text`, `json`, `verbose_json` "
                    "or `diarized_json`"
                )
            if fmt in ("verbose_json", "diarized_json"):
                raise bad_request(f"Currently do not support {fmt} for {model}")
            if not data:
                raise bad_request("the uploaded audio file is empty")
            stream = _flag(form, "stream")
            include_usage = _flag(form, "stream_include_usage")
            continuous = include_usage and _flag(form, "stream_continuous_usage_stats")
            limit_raw = form.get("max_completion_tokens")
            try:
                limit = int(limit_raw) if limit_raw else None
            except ValueError:
                raise fields.invalid(
                    "max_completion_tokens", "Input should be a valid integer", "int_type"
                ) from None
            try:
                cost = audio.cost(data, form.get("prompt") or "")
            except ValueError as exc:
                raise bad_request(str(exc)) from None
            prompt_tokens = cost.windows[0].prompt_tokens
            if prompt_tokens >= max_model_len:
                raise bad_request(
                    f"Input length ({prompt_tokens}) exceeds model's maximum context length "
                    f"({max_model_len})."
                )
            max_tokens = max_model_len - prompt_tokens
            if limit is not None:
                if limit < 1:
                    raise bad_request(f"max_tokens must be at least 1, got {limit}.")
                max_tokens = min(max_tokens, limit)
        except ApiError as err:
            return error_response(err)
        given = header_request_id(request)
        request_id = f"{task}-{given}" if given else new_id(f"{task}-")
        engine_reqs = [
            EngineRequest(
                engine_id(request_id), w.prompt_tokens, max_tokens, min(w.output_tokens, max_tokens)
            )
            for w in cost.windows
        ]
        if stream:
            return await self._stream(
                request, task, request_id, model, cost, engine_reqs, include_usage, continuous
            )
        handles = await run_to_end(server.driver, engine_reqs)
        if any(h.finish_reason == FINISH_ABORT for h in handles):
            return error_response(ApiError(500, "request aborted", "InternalServerError"))
        texts = []
        start = cost.offset
        for handle in handles:
            texts.append(_words(start, handle.generated))
            start += handle.generated
        body: dict[str, Any] = {"text": " ".join(texts)}
        if task == "transcribe":
            body["usage"] = {"type": "duration", "seconds": cost.usage_seconds}
        return json_response(body)

    async def _stream(
        self,
        request: web.Request,
        task: str,
        request_id: str,
        model: str,
        cost: audio.AudioCost,
        engine_reqs: list[EngineRequest],
        include_usage: bool,
        continuous: bool,
    ) -> web.StreamResponse:
        obj = "transcription.chunk" if task == "transcribe" else "translation.chunk"
        created = int(time.time())
        prompt_tokens = cost.stream_prompt_tokens
        state = {"completion": 0}

        def renderer(window: int, start: int) -> Any:
            def render(index: int, finish_reason: str | None) -> bytes:
                state["completion"] += 1
                text = _words(start + index, 1)
                if window and index == 0:
                    text = " " + text  # vLLM's separator between windows
                choice: dict[str, Any] = {"delta": {"content": text}}
                if finish_reason is not None:
                    choice["finish_reason"] = finish_reason
                    choice["stop_reason"] = None
                chunk: dict[str, Any] = {
                    "id": request_id,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
                if continuous:
                    done = state["completion"]
                    chunk["usage"] = {
                        "prompt_tokens": prompt_tokens,
                        "total_tokens": prompt_tokens + done,
                        "completion_tokens": done,
                    }
                return b"data: " + orjson.dumps(chunk) + b"\n\n"

            return render

        handles = []
        start = cost.offset
        for i, req in enumerate(engine_reqs):
            handles.append(RequestHandle(renderer(i, start)))
            start += req.output_tokens
        driver = self.server.driver
        for req, handle in zip(engine_reqs, handles, strict=True):
            driver.submit(req, handle)
        response = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await response.prepare(request)
            for handle in handles:
                while True:
                    await handle.wait()
                    data = handle.take()
                    if data:
                        await response.write(data)
                    if handle.done:
                        break
            tail = b""
            if include_usage:
                done = state["completion"]
                usage = {
                    "id": request_id,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "total_tokens": prompt_tokens + done,
                        "completion_tokens": done,
                    },
                }
                tail = b"data: " + orjson.dumps(usage) + b"\n\n"
            await response.write(tail + DONE_CHUNK)
        except ConnectionError:
            pass  # the client went away; aborted below
        finally:
            for req, handle in zip(engine_reqs, handles, strict=True):
                if not handle.done:
                    driver.abort(req.request_id)
        return response


def _words(start: int, n: int) -> str:
    words = tokens.WORDS
    return "".join(words[(start + i) % len(words)] for i in range(n))
