"""Which backend made each stored response (the Responses API's `store`), and for whom.

A stored response lives on the backend that generated it: GET, cancel and a continuation
(`previous_response_id`) must go there, and only for the tenant that made it (a response
id is not a credential: another tenant asking for it gets a 404, as if it did not exist).
The newest `limit` responses are remembered (vLLM itself keeps them until it restarts);
each record is ~200 bytes. Per gateway process: with `--workers N` or several replicas,
the process that relayed a response is the one that can find it again (a client's
keep-alive connection stays on one worker; docs/routes.md)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredResponse:
    backend: str
    tenant: str
    tokens: int  # its prompt and answer: what a continuation carries before its input


class ResponseStore:
    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()

    def remember(self, response_id: str, backend: str, tenant: str, tokens: int) -> None:
        self._by_id[response_id] = StoredResponse(backend, tenant, tokens)
        self._by_id.move_to_end(response_id)
        while len(self._by_id) > self.limit:
            self._by_id.popitem(last=False)

    def locate(self, response_id: str, tenant: str) -> StoredResponse | None:
        found = self._by_id.get(response_id)
        return found if found is not None and found.tenant == tenant else None

    def __len__(self) -> int:
        return len(self._by_id)
