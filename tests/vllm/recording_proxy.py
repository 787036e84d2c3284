"""A transparent HTTP proxy on 127.0.0.1 that records what the upstream answered: status
and the first bytes of each POST's answer. Put between the gateway and vLLM, it shows
which of vLLM's answers the gateway received, so a test can check what became of each.

    async with RecordingProxy("http://127.0.0.1:8001") as proxy:
        start_gateway([proxy.url]); ...; proxy.answers  # [Answer(path, status, head)]
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

import aiohttp
from aiohttp import web
from loadgen import CLIENT_KEEPALIVE_S

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "content-encoding",
}


@dataclass
class Answer:
    path: str
    status: int
    head: bytes  # the first bytes of the body (enough for one SSE event)

    @property
    def sse_error(self) -> bool:
        """HTTP 200 whose first event is an error: vLLM's late admission rejection."""
        return self.status == 200 and self.head.startswith(b'data: {"error"')

    @property
    def success(self) -> bool:
        return self.status == 200 and not self.sse_error


class RecordingProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.answers: list[Answer] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RecordingProxy:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S),
            auto_decompress=False,
        )
        app = web.Application(handler_args={"handler_cancellation": True})
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            data=await request.read(),
            headers=headers,
        ) as up:
            response = web.StreamResponse(
                status=up.status,
                headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP_BY_HOP},
            )
            await response.prepare(request)
            answer = Answer(request.path, up.status, b"")
            if request.method == "POST":
                self.answers.append(answer)  # recorded at once: the gateway may hang up early
            async for chunk in up.content.iter_any():
                if len(answer.head) < 400:
                    answer.head += chunk[: 400 - len(answer.head)]
                await response.write(chunk)
            await response.write_eof()
            return response
