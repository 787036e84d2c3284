"""Class queue: deficit round robin between tenants, O(1) removal, deadlines."""

from __future__ import annotations

from sluice.config import DropPolicy, QueuePolicy
from sluice.core.class_queue import ClassQueue
from sluice.core.request_record import RequestRecord
from sluice.core.types import RequestInfo

POLICY = QueuePolicy(
    priority=1, name="p1", max_queue_size=100, timeout=10.0, drop_policy=DropPolicy.TAIL
).core_settings()

_seq = 0


def rec(
    rid: str,
    tenant: str,
    cost: int = 100,
    now: float = 0.0,
    weight: float = 1.0,
    deadline: float | None = None,
) -> RequestRecord:
    global _seq
    _seq += 1
    info = RequestInfo(rid, tenant, 1, "m", cost, 0, weight=weight, client_deadline=deadline)
    return RequestRecord(info, seq=_seq, now=now, prompt_est=cost, expected_output=0, cost=cost)


def drain(q: ClassQueue, n: int) -> list[str]:
    out = []
    for _ in range(n):
        r = q.pop()
        assert r is not None
        out.append(r.request_id)
    return out


def test_round_robin_between_tenants_of_equal_cost() -> None:
    q = ClassQueue(POLICY)
    for i in range(6):
        q.push(rec(f"a{i}", "A"))
    for i in range(2):
        q.push(rec(f"b{i}", "B"))
    assert q.peek() is not None and q.peek().request_id == "a0"  # type: ignore[union-attr]
    assert drain(q, 8) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]
    assert q.pop() is None
    assert len(q) == 0


def test_token_costs_share_tokens_not_requests() -> None:
    q = ClassQueue(POLICY)
    for i in range(4):
        q.push(rec(f"big{i}", "A", cost=400))
    for i in range(20):
        q.push(rec(f"s{i}", "B", cost=100))
    # quantum = largest cost seen (400): per turn A serves one 400-token request and B
    # four 100-token ones
    order = drain(q, 10)
    assert order == ["big0", "s0", "s1", "s2", "s3", "big1", "s4", "s5", "s6", "s7"]


def test_weights_share_in_proportion() -> None:
    q = ClassQueue(POLICY)
    for i in range(30):
        q.push(rec(f"a{i}", "A", weight=2.0))
        q.push(rec(f"b{i}", "B", weight=1.0))
    served = drain(q, 30)
    assert sum(1 for r in served if r.startswith("a")) == 20
    assert sum(1 for r in served if r.startswith("b")) == 10


def test_remove_by_id_anywhere() -> None:
    q = ClassQueue(POLICY)
    for i in range(3):
        q.push(rec(f"a{i}", "A"))
    q.push(rec("b0", "B"))
    assert "a1" in q
    removed = q.remove("a1")
    assert removed is not None and removed.request_id == "a1"
    assert "a1" not in q
    assert q.remove("a1") is None
    assert q.remove("nope") is None
    assert len(q) == 3
    assert q.tenant_depths() == {"A": 2, "B": 1}
    q.remove("b0")  # B's sub-queue empties: it leaves the round robin
    assert drain(q, 2) == ["a0", "a2"]
    assert q.peek() is None


def test_an_emptied_tenant_loses_its_credit() -> None:
    q = ClassQueue(POLICY)
    q.push(rec("a0", "A", cost=400))  # quantum 400
    q.push(rec("b0", "B", cost=100))
    assert drain(q, 1) == ["a0"]
    q.remove("b0")
    q.push(rec("b1", "B", cost=100))
    q.push(rec("a1", "A", cost=400))
    # B re-enters with no credit left over from its last turn
    assert q.peek() is not None
    assert drain(q, 2) == ["b1", "a1"]


def test_oldest_and_sojourn_follow_arrival_order() -> None:
    q = ClassQueue(POLICY)
    q.push(rec("a0", "A", now=1.0))
    q.push(rec("b0", "B", now=2.0))
    oldest = q.oldest()
    assert oldest is not None and oldest.request_id == "a0"
    assert q.head_sojourn(4.5) == 3.5
    q.remove("a0")
    assert q.head_sojourn(4.5) == 2.5


def test_due_by_class_timeout_and_by_client_deadline() -> None:
    q = ClassQueue(POLICY)  # timeout 10 s
    q.push(rec("a0", "A", now=0.0))
    q.push(rec("a1", "A", now=1.0, deadline=4.0))
    q.push(rec("a2", "A", now=2.0))
    assert q.next_due(0.0) == 4.0
    assert q.pop_due(3.99, 0.0) == []
    assert [r.request_id for r in q.pop_due(4.0, 0.0)] == ["a1"]
    assert q.next_due(0.0) == 10.0
    # with a slack of 0.5 s everything is due half a second earlier
    assert q.next_due(0.5) == 9.5
    assert [r.request_id for r in q.pop_due(9.5, 0.5)] == ["a0"]
    assert [r.request_id for r in q.pop_due(12.0, 0.0)] == ["a2"]
    assert q.next_due(0.0) is None


def test_removed_requests_leave_the_deadline_heap() -> None:
    q = ClassQueue(POLICY)
    q.push(rec("a0", "A", now=0.0, deadline=1.0))
    q.push(rec("a1", "A", now=0.0, deadline=2.0))
    q.remove("a0")
    assert q.next_due(0.0) == 2.0
    assert [r.request_id for r in q.pop_due(5.0, 0.0)] == ["a1"]


def test_returns_lane_is_in_the_per_model_index() -> None:
    # a returned request is its model's oldest for the dispatcher's other-model pass, and
    # leaves the index however it leaves the queue (taken, popped, parked then removed)
    q = ClassQueue(POLICY)
    q.push(rec("fresh", "A"))
    q.push(rec("back", "R"), returning=True)
    q.push(rec("back2", "R"), returning=True)
    assert list(q.by_model["m"]) == ["fresh", "back", "back2"]
    q.take(q.by_model["m"]["back"])  # another model's pass took it: no tenant to charge
    assert list(q.by_model["m"]) == ["fresh", "back2"] and "back" not in q.returns
    q.park(q.returns["back2"])
    assert "back2" in q.by_model["m"] and "back2" not in q.returns
    q.remove("back2")
    assert q.pop() is not None and q.pop() is None
    assert q.by_model == {} and len(q) == 0
