"""What differs from one route to the next, as data: every route goes through the same
request path (request_path.py); its RouteSpec says how to read its body and cost, where
its answer goes upstream, and how its fallback is written."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sluice.gateway.request_body import ParsedRequest, parse_request


@dataclass(frozen=True, slots=True)
class RouteSpec:
    name: str  # its label in the access log and the metrics
    upstream_path: str  # where it goes on the backend
    parse: Callable[[bytes], ParsedRequest]  # body -> model, stream, cost; BadRequest
    chat: bool  # the fallback answers in chat's shape (else completions')


def _parse_chat(raw: bytes) -> ParsedRequest:
    return parse_request(raw, True)


def _parse_completion(raw: bytes) -> ParsedRequest:
    return parse_request(raw, False)


CHAT = RouteSpec("chat", "/v1/chat/completions", _parse_chat, chat=True)
COMPLETIONS = RouteSpec("completions", "/v1/completions", _parse_completion, chat=False)
