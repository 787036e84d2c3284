"""The Responses API's stored responses (response_store.py): a new response that
continues a stored one goes to the backend that holds it, and costs what it carries; an
answer with `store` on is remembered with its backend and tenant; GET and cancel of one
are sent to its backend, and only for its tenant."""

from __future__ import annotations

from aiohttp import web

from sluice.gateway.backend_pool import BackendPool
from sluice.gateway.relay import RelayResult
from sluice.gateway.request_context import RequestContext
from sluice.gateway.response_store import ResponseStore
from sluice.gateway.routes.responses import response_id_of


class StoredResponses:
    def __init__(self, store: ResponseStore, pool: BackendPool) -> None:
        self.store = store
        self.pool = pool

    def continuation(self, ctx: RequestContext) -> None:
        """A new response with `previous_response_id`: pinned to the backend that holds
        the one it continues (if this process relayed it), costed with what it holds."""
        previous = ctx.parsed.body.get("previous_response_id")
        if not isinstance(previous, str):
            return
        found = self.store.locate(previous, ctx.tenant.name)
        if found is None:
            return  # not relayed by this process: the backend chosen answers for it
        h = self.pool.backends.get(found.backend)
        if h is not None and h.healthy:  # (else its backend, gone, answers nowhere)
            ctx.pinned_backend = found.backend
        ctx.parsed.prompt_tokens_est += found.tokens

    def remember(self, ctx: RequestContext, result: RelayResult) -> None:
        """After a successful answer: which backend holds the response, if it is stored."""
        if ctx.parsed.body.get("store") is False:
            return
        response_id = response_id_of(result.head)
        if response_id is not None:
            tokens = (result.prompt_tokens or 0) + (result.completion_tokens or 0)
            self.store.remember(response_id, ctx.backend.name, ctx.tenant.name, tokens)

    def locate(self, ctx: RequestContext) -> web.Response | None:
        """GET or cancel of a stored response: its backend, or a 404."""
        response_id = ctx.request.match_info.get("response_id", "")
        found = self.store.locate(response_id, ctx.tenant.name)
        if found is None or found.backend not in self.pool.backends:
            return ctx.route.errors.response(
                404,
                f"No response found with id '{response_id}' (a stored response is "
                "found through the gateway process that relayed it).",
                "response_not_found",
                ctx.headers,
            )
        ctx.backend = self.pool.handle(found.backend)
        ctx.stream = ctx.request.query.get("stream", "").lower() == "true"
        return None
