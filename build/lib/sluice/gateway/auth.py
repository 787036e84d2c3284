"""API key -> tenant. Keys are never stored or logged in plaintext: the policy's plaintext
keys are hashed at load, and a presented key is hashed before lookup. The lookup is by
sha256 digest (timing reveals nothing about the key itself) and the final comparison is
constant-time."""

from __future__ import annotations

import hashlib
import hmac

from sluice.config import Policy, Tenant


class KeyRing:
    def __init__(self, policy: Policy) -> None:
        self._tenants: dict[str, tuple[str, Tenant]] = {}
        for tenant in policy.tenants:
            for digest in tenant.key_digests():
                self._tenants[digest] = (digest, tenant)
        self._admin = set(policy.admin.key_digests())

    @staticmethod
    def bearer(header: str | None) -> str | None:
        if not header:
            return None
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return key.strip()

    def tenant_for(self, key: str) -> Tenant | None:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        found = self._tenants.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            return None
        return found[1]

    def is_admin(self, key: str) -> bool:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        return any(hmac.compare_digest(digest, d) for d in self._admin)
