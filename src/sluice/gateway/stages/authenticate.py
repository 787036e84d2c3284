"""Stage 1: the API key names the tenant (401 without a known key)."""

from __future__ import annotations

from aiohttp import web

from sluice.gateway.auth import KeyRing
from sluice.gateway.error_shapes import OPENAI, ErrorShape
from sluice.gateway.request_context import RequestContext


def unauthorized(errors: ErrorShape = OPENAI, key_header: str | None = None) -> web.Response:
    also = f" (or {key_header}: <key>)" if key_header else ""
    return errors.response(
        401,
        f"Missing or unknown API key: send Authorization: Bearer <key>{also}.",
        "invalid_api_key",
    )


class Authenticate:
    def __init__(self, keyring: KeyRing) -> None:
        self.keyring = keyring

    def run(self, ctx: RequestContext) -> web.Response | None:
        headers = ctx.request.headers
        key = KeyRing.bearer(headers.get("Authorization"))
        if key is None and (other := ctx.route.key_header) is not None:
            key = (headers.get(other) or "").strip() or None  # Anthropic's x-api-key
        tenant = self.keyring.tenant_for(key) if key else None
        if tenant is None:
            return unauthorized(ctx.route.errors, ctx.route.key_header)
        ctx.tenant = tenant
        ctx.fields["tenant"] = tenant.name
        return None
