"""Each stage of the request path on its own (gateway/stages/): a RequestContext made from a
mocked aiohttp request, the stage's real collaborators where they are pure (key ring,
features, controller, bridge) and small fakes where they do I/O (the backend pool, the
relay, the shared-quota gate). The whole path runs in the integration tests."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict, CIMultiDictProxy

from sluice.config import Policy, parse_policy
from sluice.core.circuit_breaker import BreakerState
from sluice.core.clock import Clock, FakeClock, MonotonicClock
from sluice.core.controller import Controller
from sluice.core.types import Outcome
from sluice.gateway.auth import KeyRing
from sluice.gateway.backend_pool import ModelLookup
from sluice.gateway.dispatch_bridge import DispatchBridge
from sluice.gateway.features import Features
from sluice.gateway.relay import RelayResult
from sluice.gateway.request_body import BadRequest
from sluice.gateway.request_context import RequestContext
from sluice.gateway.response_store import ResponseStore
from sluice.gateway.returns import BookingTokens
from sluice.gateway.routes import CHAT
from sluice.gateway.routes.pooling import EMBEDDINGS
from sluice.gateway.shared_quota import QuotaTicket
from sluice.gateway.stages.access_record import write_access_record
from sluice.gateway.stages.account import account
from sluice.gateway.stages.admission import MAX_ATTEMPTS, Admission, retry_attempt
from sluice.gateway.stages.authenticate import Authenticate
from sluice.gateway.stages.bypass import Bypass
from sluice.gateway.stages.classify import classify
from sluice.gateway.stages.draining import shutting_down
from sluice.gateway.stages.fallback import Fallback
from sluice.gateway.stages.feature_breaker import FeatureBreaker
from sluice.gateway.stages.forward import Forward, no_first_token
from sluice.gateway.stages.parse_body import ParseBody, client_timeouts
from sluice.gateway.stages.quota_ticket import QuotaTicketStage
from sluice.gateway.stages.read_body import ReadBody
from sluice.gateway.stages.refusal import Refusal
from sluice.gateway.stages.stored_responses import StoredResponses
from sluice.gateway.telemetry import Telemetry

POLICY = """
queues:
  - {priority: 0, name: realtime-interactive, maxQueueSize: 1, timeout: 8s, dropPolicy: tail}
  - {priority: 1, name: agent-workflow, maxQueueSize: 1, timeout: 15s, dropPolicy: tail}
  - {priority: 2, name: batch-extraction, maxQueueSize: 1, timeout: 60s, dropPolicy: tail}
tenants:
  - {name: chat-app, apiKeys: [sk-p0], priority: 0}
  - {name: agents, apiKeys: [sk-p1], priority: 1}
limiter: {algorithm: fixed, fixedLimit: 1}
dispatcher: {reserved: {p0: 0.0}}
features:
  - name: summarize
    core: false
    fallback: {static: "later"}
  - {name: chat, core: true}
breakers: {minRequests: 1, errorRate: 0.5}
server: {readTimeout: 100ms, maxBodyBytes: 2048}
"""

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]})


def _policy() -> Policy:
    return parse_policy(POLICY)


def _ctx(headers: dict[str, str] | None = None, **request: Any) -> RequestContext:
    req = make_mocked_request("POST", "/v1/chat/completions", headers=headers or {}, **request)
    return RequestContext(req, CHAT, 100.0)


def _error(response: web.StreamResponse | None) -> dict[str, Any]:
    assert isinstance(response, web.Response) and response.body is not None
    body = orjson.loads(response.body)  # type: ignore[arg-type]
    return body["error"]  # type: ignore[no-any-return]


def _identified(headers: dict[str, str] | None = None) -> RequestContext:
    ctx = _ctx({"Authorization": "Bearer sk-p0", **(headers or {})})
    assert Authenticate(KeyRing(_policy())).run(ctx) is None
    assert classify(ctx) is None
    return ctx


# --- authenticate, classify, draining ------------------------------------------------------


@pytest.mark.parametrize("header", [None, "Bearer sk-nobody", "Basic sk-p0", "Bearer "])
def test_authenticate_refuses_a_missing_or_unknown_key(header: str | None) -> None:
    ctx = _ctx({"Authorization": header} if header is not None else {})
    response = Authenticate(KeyRing(_policy())).run(ctx)
    assert response is not None and response.status == 401
    assert _error(response)["code"] == "invalid_api_key"
    assert "tenant" not in ctx.fields


def test_authenticate_names_the_tenant() -> None:
    ctx = _ctx({"Authorization": "Bearer sk-p1"})
    assert Authenticate(KeyRing(_policy())).run(ctx) is None
    assert ctx.tenant.name == "agents" and ctx.fields["tenant"] == "agents"


def test_classify_gives_the_tenants_class_or_a_lower_one_asked_for() -> None:
    ctx = _identified()
    assert ctx.priority == 0 and ctx.headers == {"X-Sluice-Priority": "0"}
    assert ctx.fields["priority"] == 0
    lower = _identified({"X-Priority": " 2 "})
    assert lower.priority == 2 and lower.headers["X-Sluice-Priority"] == "2"


def test_classify_refuses_a_higher_class_and_a_bad_header() -> None:
    ctx = _ctx({"Authorization": "Bearer sk-p1", "X-Priority": "0"})
    Authenticate(KeyRing(_policy())).run(ctx)
    response = classify(ctx)
    assert response is not None and response.status == 403
    assert _error(response)["code"] == "priority_not_allowed"
    assert response.headers["X-Sluice-Priority"] == "1"
    bad = _ctx({"Authorization": "Bearer sk-p1", "X-Priority": "high"})
    Authenticate(KeyRing(_policy())).run(bad)
    response = classify(bad)
    assert response is not None and response.status == 400
    assert _error(response)["code"] == "invalid_priority"


def test_draining_answers_503_with_retry_after() -> None:
    response = shutting_down(_identified())
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    assert response.headers["X-Sluice-Priority"] == "0"
    assert _error(response)["code"] == "shutting_down"


# --- read_body, parse_body ------------------------------------------------------------------


def _payload(data: bytes, eof: bool = True) -> Any:
    from unittest import mock

    from aiohttp.streams import StreamReader

    reader = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_read_body_reads_what_came() -> None:
    ctx = _ctx(payload=_payload(BODY))
    assert await ReadBody(_policy().server).run(ctx) is None
    assert ctx.raw == BODY


async def test_read_body_refuses_a_body_over_the_limit() -> None:
    ctx = _ctx(payload=_payload(b"x" * 4096), client_max_size=2048)
    response = await ReadBody(_policy().server).run(ctx)
    assert response is not None and response.status == 413
    assert _error(response)["code"] == "body_too_large"


async def test_read_body_gives_up_on_a_body_that_does_not_come() -> None:
    ctx = _ctx(payload=_payload(b'{"model"', eof=False))
    response = await asyncio.wait_for(ReadBody(_policy().server).run(ctx), 5)
    assert response is not None and response.status == 408
    assert _error(response)["code"] == "request_timeout"


class _Pool:
    """What the stages ask of the backend pool."""

    def __init__(self, models: set[str], not_yet_known: bool = False) -> None:
        self.models = models
        self.not_yet_known = not_yet_known  # a backend that is down may serve any model
        self.recorded: list[tuple[str, Outcome, bool]] = []
        self.backends = {"b0": self.handle("b0")}

    def lookup(self, model: str) -> ModelLookup:
        if model in self.models:
            return ModelLookup.SERVED
        return ModelLookup.NOT_YET_KNOWN if self.not_yet_known else ModelLookup.ABSENT

    def handle(self, name: str) -> Any:
        fields = {"name": name, "url": "http://b", "models": self.models, "healthy": True}
        return type("Handle", (), fields)()

    def pick(self, model: str) -> Any:
        healthy = [h for h in self.backends.values() if h.healthy and model in h.models]
        return healthy[0] if healthy else None

    def record(self, h: Any, outcome: Outcome, lost: bool) -> None:
        self.recorded.append((h.name, outcome, lost))


def _parsed(raw: bytes = BODY, headers: dict[str, str] | None = None) -> RequestContext:
    ctx = _identified(headers)
    ctx.raw = raw
    assert ParseBody(_Pool({"m"}), _refusal()).run(ctx) is None  # type: ignore[arg-type]
    return ctx


def test_parse_body_reads_model_stream_cost_and_deadlines() -> None:
    ctx = _parsed(headers={"X-Request-Timeout": "5", "X-Stainless-Read-Timeout": "2"})
    assert ctx.parsed.model == "m" and ctx.parsed.prompt_tokens_est > 0
    assert not ctx.stream and ctx.body == BODY
    assert ctx.wait_deadline == 102.0 and ctx.deadline == 105.0
    streamed = _parsed(orjson.dumps({**orjson.loads(BODY), "stream": True}))
    # the gateway asks a stream for its usage, and strips it for a client that did not
    assert streamed.stream and streamed.strip_usage
    assert orjson.loads(streamed.body)["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("raw", "headers", "status", "code"),
    [
        (b"{not json", {}, 400, "invalid_request"),
        (BODY, {"X-Request-Timeout": "soon"}, 400, "invalid_request"),
        (orjson.dumps({"model": "other", "messages": [{"content": "x"}]}), {}, 404, None),
    ],
)
def test_parse_body_refuses(raw: bytes, headers: dict[str, str], status: int, code: str) -> None:
    ctx = _identified(headers)
    ctx.raw = raw
    response = ParseBody(_Pool({"m"}), _refusal()).run(ctx)  # type: ignore[arg-type]
    assert response is not None and response.status == status
    assert _error(response)["code"] == (code or "model_not_found")


def _headers(**values: str) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(values))


def test_parse_body_answers_503_for_a_model_whose_backends_are_not_read_yet() -> None:
    """A model no backend lists while a backend is down may be that backend's: a retryable
    503 `no_backend`, not the 404 of a model that does not exist."""
    ctx = _identified()
    ctx.raw = orjson.dumps({"model": "later", "messages": [{"role": "user", "content": "x"}]})
    response = ParseBody(_Pool({"m"}, not_yet_known=True), _refusal()).run(ctx)  # type: ignore[arg-type]
    assert response is not None and response.status == 503
    assert _error(response)["code"] == "no_backend" and response.headers["Retry-After"] == "2"
    assert ctx.fields["outcome"] == "no_backend"
    ctx = _identified()
    ctx.raw = orjson.dumps({"model": "later", "messages": [{"role": "user", "content": "x"}]})
    response = ParseBody(_Pool({"m"}), _refusal()).run(ctx)  # type: ignore[arg-type]
    assert response is not None and response.status == 404


def test_client_timeouts_take_the_smallest_applicable() -> None:
    assert client_timeouts(_headers()) == (None, None)
    assert client_timeouts(_headers(**{"X-Request-Timeout": "9", "X-Stainless-Timeout": "4"})) == (
        4.0,
        4.0,
    )
    # a read timeout bounds only the wait for the first byte
    assert client_timeouts(_headers(**{"X-Stainless-Read-Timeout": "3"})) == (3.0, None)
    assert client_timeouts(
        _headers(**{"X-Stainless-Read-Timeout": "30", "X-Request-Timeout": "9"})
    ) == (9.0, 9.0)
    for bad in ("0", "-1", "inf", "nan", "x"):
        with pytest.raises(BadRequest, match="X-Request-Timeout"):
            client_timeouts(_headers(**{"X-Request-Timeout": bad}))
    # what an SDK writes when no timeout was set (the anthropic SDK's NOT_GIVEN) is ignored
    for unset in ("NOT_GIVEN", "None", "0", "inf"):
        hint = {"X-Stainless-Timeout": unset, "X-Stainless-Read-Timeout": unset}
        assert client_timeouts(_headers(**hint)) == (None, None)


def test_retry_attempt_names_the_client() -> None:
    assert retry_attempt(_headers()) is None
    assert retry_attempt(_headers(**{"X-Stainless-Retry-Count": "0"})) is None
    assert retry_attempt(_headers(**{"X-Stainless-Retry-Count": "2"})) == (2, "openai-sdk")
    assert retry_attempt(_headers(**{"X-Sluice-Retry": "5000"})) == (1000, "sluice-sdk")
    assert retry_attempt(_headers(**{"X-Sluice-Retry": "-1"})) is None


# --- feature breaker, quota ticket ---------------------------------------------------------


def test_feature_breaker_sends_a_non_core_feature_to_its_fallback_while_open() -> None:
    features = Features(_policy(), MonotonicClock())
    stage = FeatureBreaker(features)
    ctx = _parsed(headers={"X-Sluice-Feature": "summarize"})
    assert stage.run(ctx) is False and ctx.feature_name == "summarize"
    assert ctx.breaker is features.breakers["summarize"]
    ctx.breaker.record_failure()  # one failure of one: over the error rate
    assert ctx.breaker.state is BreakerState.OPEN
    again = _parsed(headers={"X-Sluice-Feature": "summarize"})
    assert stage.run(again) is True
    assert again.fields["outcome"] == "fallback" and again.fields["feature"] == "summarize"
    core = _parsed(headers={"X-Sluice-Feature": "chat"})
    assert stage.run(core) is False and core.breaker is None
    unknown = _parsed(headers={"X-Sluice-Feature": "typo"})
    assert stage.run(unknown) is False and unknown.feature is None


class _Ticket:
    def __init__(self, ok: bool) -> None:
        self.ok = ok
        self.retry_after_s = 7.5
        self.closed = False
        self.used_tokens: tuple[int | None, int | None] | None = None

    def finished(self, outcome: Outcome, prompt: int | None, completion: int | None) -> None:
        self.used_tokens = (prompt, completion)

    def close(self) -> None:
        self.closed = True


class _Gate:
    def __init__(self, ok: bool, limited: bool = True) -> None:
        self.ok = ok
        self.limited = limited
        self.charged: list[tuple[str, int]] = []

    def limits(self, tenant: str) -> object:
        return self.limited

    async def acquire(self, tenant: str, tokens: int) -> _Ticket:
        self.charged.append((tenant, tokens))
        return _Ticket(self.ok)


def _refusal(clock: Clock | None = None) -> Refusal:
    clock = clock or MonotonicClock()
    return Refusal(Telemetry(), _policy(), _tokens(clock), clock)


def _tokens(clock: Clock) -> BookingTokens:
    return BookingTokens(b"test-key", clock.now)


async def test_quota_ticket_refuses_a_tenant_over_its_shared_quota() -> None:
    ctx = _parsed()
    ctx.base_id = "q1"
    gate = _Gate(ok=False)
    controller = Controller(_policy().core_settings(), MonotonicClock(), ["b0"])
    response = await QuotaTicketStage(gate, controller, _refusal()).run(ctx)  # type: ignore[arg-type]
    assert response is not None and response.status == 429
    assert response.headers["Retry-After"] == "8"
    assert _error(response)["code"] == "tenant_quota"
    assert ctx.fields["outcome"] == "tenant_quota" and ctx.ticket is None
    # charged as the core charges its own quotas: prompt plus the expected output (half of
    # 1024, max_tokens being unset, until an output length is learned)
    assert gate.charged == [("chat-app", ctx.parsed.prompt_tokens_est + 512)]


async def test_quota_ticket_past_the_clients_deadline_cannot_serve_it_in_time() -> None:
    clock = FakeClock(100.0)  # the contexts arrive at 100.0
    controller = Controller(_policy().core_settings(), clock, ["b0"])
    stage = QuotaTicketStage(_Gate(ok=False), controller, _refusal(clock))  # type: ignore[arg-type]
    late = _parsed(headers={"X-Request-Timeout": "5"})  # the quota refills in 7.5 s
    response = await stage.run(late)
    assert response is not None and response.status == 429
    assert _error(response)["code"] == "cannot_serve_in_time"
    assert "Retry-After" not in response.headers
    assert response.headers["x-should-retry"] == "false"
    assert late.fields["outcome"] == "cannot_serve_in_time"
    in_time = _parsed(headers={"X-Request-Timeout": "10"})
    response = await stage.run(in_time)
    assert response is not None and _error(response)["code"] == "tenant_quota"
    assert response.headers["Retry-After"] == "8"


async def test_quota_ticket_is_kept_for_the_way_out() -> None:
    ctx = _parsed()
    controller = Controller(_policy().core_settings(), MonotonicClock(), ["b0"])
    stage = QuotaTicketStage(_Gate(ok=True), controller, _refusal())  # type: ignore[arg-type]
    assert await stage.run(ctx) is None
    assert ctx.ticket is not None
    unlimited = _parsed()
    gate = _Gate(ok=True, limited=False)
    stage = QuotaTicketStage(gate, controller, _refusal())  # type: ignore[arg-type]
    assert await stage.run(unlimited) is None
    assert unlimited.ticket is None and gate.charged == []


# --- admission -----------------------------------------------------------------------------


def _admission(clock: MonotonicClock | None = None) -> tuple[Admission, Controller, _Pool]:
    clock = clock or MonotonicClock()
    controller = Controller(_policy().core_settings(), clock, ["b0"])
    controller.set_backend_health("b0", True)
    pool = _Pool({"m"})
    bridge = DispatchBridge(controller, clock)
    stage = Admission(bridge, pool, Telemetry(), clock, _refusal(clock), _tokens(clock))  # type: ignore[arg-type]
    return stage, controller, pool


def _begun(admission: Admission, headers: dict[str, str] | None = None) -> RequestContext:
    ctx = _parsed(headers=headers)
    ctx.started = admission.clock.now()
    admission.begin(ctx)
    return ctx


async def test_admission_places_the_request_and_names_its_backend() -> None:
    admission, controller, _pool = _admission()
    ctx = _begun(admission, {"X-Stainless-Retry-Count": "1"})
    assert ctx.headers["X-Request-Id"] == ctx.base_id and ctx.fields["request_id"] == ctx.base_id
    assert ctx.retry_attempt == 1
    assert await admission.run(ctx) is None
    assert ctx.backend.name == "b0" and ctx.request_id == ctx.base_id
    assert ctx.headers["X-Sluice-Backend"] == "b0" and ctx.headers["X-Sluice-Queue-Ms"] == "0"
    assert ctx.fields["attempt"] == 1 and ctx.fields["outcome"] == "cancelled"
    assert controller.backend_of(ctx.request_id) == "b0"


async def test_admission_refuses_with_the_cores_code_and_retry_after() -> None:
    admission, _controller, _pool = _admission()
    first, second, third = (_begun(admission) for _ in range(3))
    assert await admission.run(first) is None  # the only slot
    waiting = asyncio.ensure_future(admission.run(second))  # the only queue place
    await asyncio.sleep(0)
    response = await admission.run(third)
    assert response is not None and response.status == 429
    assert _error(response)["code"] == "queue_full" and int(response.headers["Retry-After"]) >= 1
    assert third.fields["outcome"] == "queue_full"
    waiting.cancel()


def _failed(ctx: RequestContext) -> RelayResult:
    return RelayResult(web.Response(status=502), Outcome.ERROR, retryable=True)


async def test_one_retry_after_a_failure_and_never_past_the_clients_deadline() -> None:
    admission, controller, _pool = _admission()
    ctx = _begun(admission)
    await admission.run(ctx)
    controller.on_finish(ctx.request_id, Outcome.ERROR)
    assert admission.retry_after_failure(ctx, _failed(ctx)) is True
    assert await admission.run(ctx) is None
    assert ctx.request_id == ctx.base_id + "-r1" and ctx.fields["attempt"] == 2
    controller.on_finish(ctx.request_id, Outcome.ERROR)
    assert MAX_ATTEMPTS == 2 and admission.retry_after_failure(ctx, _failed(ctx)) is False
    late = _begun(admission, {"X-Request-Timeout": "1"})
    late.deadline = admission.clock.now() - 0.001
    assert admission.retry_after_failure(late, _failed(late)) is False


async def test_a_retry_that_finds_no_slot_returns_the_first_answer() -> None:
    admission, controller, _pool = _admission()
    holder = _begun(admission)
    await admission.run(holder)  # keeps the only slot
    ctx = _begun(admission)
    first = RelayResult(web.Response(status=502), Outcome.ERROR, retryable=True)
    ctx.failed = first
    ctx.attempt = 1
    ctx.queued_s = 0.25
    ctx.headers["X-Sluice-Queue-Ms"] = "250"
    response = await asyncio.wait_for(admission.run(ctx), 5)  # waits RETRY_WAIT_S at most
    assert response is first.response and ctx.fields["outcome"] == "error"
    assert int(response.headers["X-Sluice-Queue-Ms"]) >= 250
    controller.cancel(holder.request_id)


# --- forward, account, access record -------------------------------------------------------


class _Relay:
    def __init__(self, result: RelayResult | BaseException) -> None:
        self.result = result
        self.first_token: Any = None

    async def forward(self, ctx: RequestContext, on_first_token: Any) -> RelayResult:
        self.first_token = on_first_token
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


def _forward(relay: _Relay) -> tuple[Forward, Admission, Controller, _Pool]:
    admission, controller, pool = _admission()
    clock = admission.clock
    forward = Forward(relay, controller, admission.bridge, pool, Telemetry(), clock)  # type: ignore[arg-type]
    return forward, admission, controller, pool


async def test_forward_reports_the_finish_to_the_core_and_the_pool() -> None:
    result = RelayResult(web.Response(), Outcome.OK, prompt_tokens=5, completion_tokens=3)
    relay = _Relay(result)
    forward, admission, controller, pool = _forward(relay)
    ctx = _begun(admission)
    await admission.run(ctx)
    assert await forward.run(ctx) is result
    assert relay.first_token is no_first_token  # an answer relayed whole has none
    assert controller.backend_of(ctx.request_id) is None  # finished: the slot is free
    assert pool.recorded == [("b0", Outcome.OK, False)]


async def test_forward_gives_the_slot_back_when_the_client_goes_away() -> None:
    forward, admission, controller, pool = _forward(_Relay(asyncio.CancelledError()))
    ctx = _begun(admission)
    await admission.run(ctx)
    with pytest.raises(asyncio.CancelledError):
        await forward.run(ctx)
    assert controller.backend_of(ctx.request_id) is None and pool.recorded == []
    next_one = _begun(admission)
    assert await admission.run(next_one) is None  # the slot came back


class _Finishes:
    """A shared-quota gate that records what tickets give back: (tenant, requests, tokens)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def finish(self, tenant: str, slots: int, tokens: int) -> None:
        self.calls.append((tenant, slots, tokens))


async def test_forward_charges_a_hang_up_at_the_backend_to_the_shared_quota() -> None:
    """A request that reached its backend and whose client then went away has used the
    GPU: its ticket keeps the charge (a refused one would give it all back)."""
    forward, admission, _controller, _pool = _forward(_Relay(asyncio.CancelledError()))
    ctx = _begun(admission)
    await admission.run(ctx)
    gate = _Finishes()
    ctx.ticket = QuotaTicket(gate, "chat-app", 600, ok=True, shared=True)  # type: ignore[arg-type]
    with pytest.raises(asyncio.CancelledError):
        await forward.run(ctx)
    ctx.ticket.close()
    assert gate.calls == [("chat-app", 0, 0)]  # the estimate kept: nothing given back
    refused = QuotaTicket(gate, "chat-app", 600, ok=True, shared=True)  # type: ignore[arg-type]
    refused.close()  # never reached a backend
    assert gate.calls[-1] == ("chat-app", 1, 600)


async def test_bypass_goes_to_a_healthy_backend_without_a_slot() -> None:
    """A route outside the queues: no admission, a healthy backend serving the model, and
    the backend's health learns from the answer."""
    pool = _Pool({"m"})
    result = RelayResult(web.Response(), Outcome.OK)
    bypass = Bypass(pool, _Relay(result), _refusal(), expose_backend=False)  # type: ignore[arg-type]
    ctx = _parsed()
    ctx.base_id = "t1"
    assert bypass.place(ctx) is None and ctx.backend.name == "b0"
    assert await bypass.forward(ctx) is result
    assert ctx.request_id == "t1" and "X-Sluice-Backend" not in ctx.headers
    assert pool.recorded == [("b0", Outcome.OK, False)]
    pool.backends["b0"].healthy = False
    down = _parsed()
    response = bypass.place(down)
    assert response is not None and response.status == 503
    assert _error(response)["code"] == "no_backend"


def test_stored_responses_go_to_their_backend_for_their_tenant_only() -> None:
    store = ResponseStore()
    pool = _Pool({"m"})
    pool.backends["b1"] = pool.handle("b1")
    stored = StoredResponses(store, pool)  # type: ignore[arg-type]
    made = _parsed()
    made.backend = pool.backends["b1"]
    head = b'{"id":"resp_1","object":"response"}'
    stored.remember(made, RelayResult(web.Response(), Outcome.OK, 30, 12, head=head))
    assert store.locate("resp_1", "chat-app") is not None
    # a continuation: pinned to b1, costed with the 42 tokens the stored response holds
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    follow = _parsed(orjson.dumps({**body, "previous_response_id": "resp_1"}))
    before = follow.parsed.prompt_tokens_est
    stored.continuation(follow)
    assert follow.pinned_backend == "b1" and follow.parsed.prompt_tokens_est == before + 42
    # GET of it: its backend; another tenant's GET: a 404, as if it did not exist
    get = _parsed()
    get.request = make_mocked_request("GET", "/v1/responses/resp_1", match_info={})
    get.request.match_info["response_id"] = "resp_1"  # type: ignore[index]
    assert stored.locate(get) is None and get.backend.name == "b1"
    other = _parsed()
    other.tenant = other.tenant.model_copy(update={"name": "agents"})
    other.request = get.request
    response = stored.locate(other)
    assert response is not None and response.status == 404
    # an answer with `store: false` is not remembered
    unstored = _parsed(orjson.dumps({**body, "store": False}))
    unstored.backend = pool.backends["b0"]
    head2 = b'{"id":"resp_2"}'
    stored.remember(unstored, RelayResult(web.Response(), Outcome.OK, head=head2))
    assert store.locate("resp_2", "chat-app") is None


async def test_a_route_without_a_text_fallback_answers_503_while_its_feature_degrades() -> None:
    """An embedding of a non-core feature whose breaker is open: no text can stand in for
    a vector, so a retryable 503 `feature_degraded`, never a chat answer."""
    features = Features(_policy(), MonotonicClock())
    ctx = _identified({"X-Sluice-Feature": "summarize"})
    ctx.route = EMBEDDINGS
    ctx.raw = orjson.dumps({"model": "m", "input": "a river"})
    assert ParseBody(_Pool({"m"}), _refusal()).run(ctx) is None
    FeatureBreaker(features).run(ctx)
    fallback = Fallback(Telemetry(), _Pool({"m"}), _Relay(RuntimeError()))  # type: ignore[arg-type]
    response = await fallback.run(ctx)
    assert response.status == 503 and response.headers["Retry-After"] == "5"
    assert _error(response)["code"] == "feature_degraded"


def test_account_feeds_the_ticket_the_breaker_and_the_record() -> None:
    features = Features(_policy(), MonotonicClock())
    ctx = _parsed(headers={"X-Sluice-Feature": "summarize"})
    FeatureBreaker(features).run(ctx)
    ticket = _Ticket(ok=True)
    ctx.ticket = ticket  # type: ignore[assignment]
    ok = RelayResult(web.Response(), Outcome.OK, prompt_tokens=5, completion_tokens=3)
    assert account(ctx, ok) == "ok"
    assert ticket.used_tokens == (5, 3) and ctx.fields["completion_tokens"] == 3
    assert ctx.breaker is not None and ctx.breaker.state is BreakerState.CLOSED
    assert account(ctx, RelayResult(web.Response(), Outcome.TIMEOUT)) == "timeout"
    assert ctx.breaker.state is BreakerState.OPEN  # 1 failure in 2: the error rate


def test_access_record_is_written_once_with_499_when_the_client_went_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    written: list[dict[str, Any]] = []
    monkeypatch.setattr(
        "sluice.gateway.stages.access_record.access", lambda f: written.append(dict(f))
    )
    ctx = _identified()
    ticket = _Ticket(ok=True)
    ctx.ticket = ticket  # type: ignore[assignment]
    write_access_record(ctx, None, 100.25)
    assert written == [
        {
            "path": "/v1/chat/completions",
            "route": "chat",
            "tenant": "chat-app",
            "priority": 0,
            "status": 499,
            "duration_ms": 250.0,
        }
    ]
    assert ticket.closed
    write_access_record(_identified(), web.Response(status=201), 100.0)
    assert written[-1]["status"] == 201
