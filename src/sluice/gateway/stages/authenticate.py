"""Stage 1: the API key names the tenant (401 without a known key)."""

from __future__ import annotations

from aiohttp import web

from sluice.gateway.auth import KeyRing
from sluice.gateway.errors import error_response
from sluice.gateway.request_context import RequestContext


def unauthorized() -> web.Response:
    return error_response(
        401, "Missing or unknown API key: send Authorization: Bearer <key>.", "invalid_api_key"
    )


class Authenticate:
    def __init__(self, keyring: KeyRing) -> None:
        self.keyring = keyring

    def run(self, ctx: RequestContext) -> web.Response | None:
        key = KeyRing.bearer(ctx.request.headers.get("Authorization"))
        tenant = self.keyring.tenant_for(key) if key else None
        if tenant is None:
            return unauthorized()
        ctx.tenant = tenant
        ctx.fields["tenant"] = tenant.name
        return None
