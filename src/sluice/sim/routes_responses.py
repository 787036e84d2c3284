"""`POST /v1/responses`, `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`.

As vLLM 0.32 serves them (vllm/entrypoints/openai/responses/api_router.py and
serving.py; shapes in `sim.responses_api`):

- `store` works only when the store is enabled (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE`,
  here `--enable-responses-store` or that variable): otherwise a request with
  `store: true` is served and silently not stored, and `background: true` is a 400 saying
  so. A stored response can be fetched (`GET`), and continued with `previous_response_id`
  (its prompt and answer come before the new input).
- `background: true` answers at once with the stored response in status "queued" and
  generates without the client; the stored response becomes the finished one at the end.
  With `stream: true` as well, the answer is the event stream replayed from the store, and
  `GET /v1/responses/{id}?stream=true&starting_after=N` replays it from event N+1.
  Neither is aborted when a client disconnects; `cancel` aborts it (status "cancelled";
  the engine frees its KV blocks at the next step and counts an abort).
- Cancelling a response that is not queued or in progress is vLLM's 400 "Cannot cancel a
  synchronous response.".

Two deliberate differences from vLLM: the store keeps the newest `STORE_LIMIT` responses
(vLLM never forgets, a known leak), and a replay of a cancelled background stream ends
after the events it had (vLLM's waits forever for a `response.completed` that never comes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sluice.sim import responses_api
from sluice.sim.driver import RequestHandle
from sluice.sim.engine import FINISH_ABORT
from sluice.sim.openai_api import ApiError, new_id
from sluice.sim.responses_api import ResponsesRequest, ResponseWriter
from sluice.sim.serving import (
    SSE_HEADERS,
    StreamShape,
    engine_id,
    error_response,
    json_response,
    read_json,
    run_to_end,
    stream_generation,
)

if TYPE_CHECKING:
    from sluice.sim.server import SimServer

STORE_LIMIT = 10_000
STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"


def store_enabled_by_env() -> bool:
    return os.environ.get(STORE_ENV, "").strip().lower() in ("1", "true")


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # prompt and answer, for previous_response_id
    events: list[bytes] | None = None  # a background stream's events, by sequence number
    done: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class ResponsesRoutes:
    def __init__(self, server: SimServer, *, store_enabled: bool) -> None:
        self.server = server
        self.store_enabled = store_enabled
        self.store: OrderedDict[str, Stored] = OrderedDict()
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel)
        app.on_cleanup.insert(0, self._cancel_all)

    async def _cancel_all(self, app: web.Application) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        for task in list(self.tasks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- the store -------------------------------------------------------------------

    def _keep(self, response_id: str, stored: Stored) -> None:
        self.store[response_id] = stored
        self.store.move_to_end(response_id)
        while len(self.store) > STORE_LIMIT:
            self.store.popitem(last=False)

    def _save_final(self, req: ResponsesRequest, final: dict[str, Any], text: str) -> None:
        stored = self.store.get(req.request_id)
        if stored is not None and stored.response["status"] == "cancelled":
            return  # vLLM keeps a cancelled response cancelled
        answer = {"role": "assistant", "content": text}
        if stored is None:
            self._keep(req.request_id, Stored(final, [*req.messages, answer]))
        else:
            stored.response = final
            stored.messages = [*req.messages, answer]
            stored.notify()

    def _previous(self, response_id: str) -> list[dict[str, Any]] | None:
        stored = self.store.get(response_id)
        return None if stored is None else stored.messages

    # -- create ----------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        try:
            body = await read_json(request)
            req = responses_api.parse_request(
                body,
                resolve_model=server.models_registry.resolve,
                max_model_len=server.profile.max_model_len,
                store_enabled=self.store_enabled,
                previous_messages=self._previous,
            )
        except ApiError as err:
            return error_response(err)
        writer = ResponseWriter(req)
        engine_req = server.engine.make_request(
            engine_id(req.request_id),
            req.prompt_tokens,
            req.max_tokens,
            ignore_eos=req.ignore_eos,
            sample_key=req.sample_key,
        )
        if req.background:
            return await self._start_background(request, req, writer, engine_req)
        if req.stream:

            def closing(handle: RequestHandle) -> bytes:
                if req.store:
                    final = writer.final(handle.generated, handle.finish_reason, writer.item_id)
                    self._save_final(req, final, writer.text(handle.generated))
                return b"".join(writer.closing_events(handle.generated, handle.finish_reason))

            shape = StreamShape(
                render=writer.delta,
                opening=b"".join(writer.opening_events()),
                first=writer.first,
                closing=closing,
            )
            return await stream_generation(request, server.driver, engine_req, shape)
        (handle,) = await run_to_end(server.driver, [engine_req])
        if handle.finish_reason == FINISH_ABORT:
            return error_response(ApiError(500, "request aborted", "InternalServerError"))
        final = writer.final(handle.generated, handle.finish_reason, new_id("msg_"))
        if req.store:
            self._save_final(req, final, writer.text(handle.generated))
        return json_response(final)

    async def _start_background(
        self, request: web.Request, req: ResponsesRequest, writer: ResponseWriter, engine_req: Any
    ) -> web.StreamResponse:
        queued = writer.queued()
        stored = Stored(queued, list(req.messages), events=[] if req.stream else None)
        self._keep(req.request_id, stored)
        run = self._run_background_stream if req.stream else self._run_background
        task = asyncio.get_running_loop().create_task(
            run(req, writer, engine_req, stored), name=f"sim-response-{req.request_id}"
        )
        self.tasks[req.request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(req.request_id, None))
        if req.stream:
            return await self._replay(request, stored, 0)
        return json_response(queued)

    async def _run_background(
        self, req: ResponsesRequest, writer: ResponseWriter, engine_req: Any, stored: Stored
    ) -> None:
        try:
            (handle,) = await run_to_end(self.server.driver, [engine_req])
            if handle.finish_reason == FINISH_ABORT:
                if stored.response["status"] not in ("completed", "cancelled"):
                    stored.response["status"] = "failed"
                return
            final = writer.final(handle.generated, handle.finish_reason, new_id("msg_"))
            self._save_final(req, final, writer.text(handle.generated))
        finally:
            stored.done = True
            stored.notify()

    async def _run_background_stream(
        self, req: ResponsesRequest, writer: ResponseWriter, engine_req: Any, stored: Stored
    ) -> None:
        assert stored.events is not None
        events = stored.events
        handle = RequestHandle(writer.delta)
        driver = self.server.driver
        events.extend(writer.opening_events())
        stored.notify()
        driver.submit(engine_req, handle)
        try:
            first = True
            while True:
                await handle.wait()
                chunks = list(handle.chunks)
                handle.chunks.clear()
                if chunks and first:
                    events.extend(writer.first_events())
                    first = False
                events.extend(chunks)
                if handle.done:
                    if handle.finish_reason != FINISH_ABORT:
                        events.extend(writer.closing_events(handle.generated, handle.finish_reason))
                        final = writer.final(handle.generated, handle.finish_reason, writer.item_id)
                        self._save_final(req, final, writer.text(handle.generated))
                    break
                stored.notify()
        finally:
            if not handle.done:
                driver.abort(engine_req.request_id)
            stored.done = True
            stored.notify()

    async def _replay(self, request: web.Request, stored: Stored, start: int) -> web.StreamResponse:
        assert stored.events is not None
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        index = start
        try:
            while True:
                changed = stored.changed
                events = stored.events
                if index < len(events):
                    await response.write(b"".join(events[index:]))
                    index = len(events)
                if stored.done and index >= len(stored.events):
                    break
                await changed.wait()
        except ConnectionError:
            pass  # a replay's client may leave: the response goes on in the background
        return response

    # -- retrieve and cancel ---------------------------------------------------------

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            return error_response(responses_api.not_found(response_id))
        stream = request.query.get("stream", "false").lower() in ("1", "true")
        if not stream:
            return json_response(stored.response)
        after = request.query.get("starting_after")
        try:
            start = 0 if after is None else int(after) + 1
        except ValueError:
            return error_response(
                ApiError(400, "starting_after must be an integer", "Bad Request", "starting_after")
            )
        if stored.events is None:
            return error_response(
                ApiError(
                    400, f"Unknown response_id: {response_id}", "BadRequestError", "response_id"
                )
            )
        return await self._replay(request, stored, max(0, start))

    async def cancel(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            return error_response(responses_api.not_found(response_id))
        if stored.response["status"] not in ("queued", "in_progress"):
            return error_response(
                ApiError(
                    400,
                    "Cannot cancel a synchronous response.",
                    responses_api.INVALID_REQUEST,
                    "response_id",
                )
            )
        stored.response["status"] = "cancelled"
        task = self.tasks.get(response_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return json_response(stored.response)
