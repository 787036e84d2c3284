"""Hot reload is all or nothing (issue 14, items 3 and 4), without a running gateway: a
fake clock drives `PolicyWatcher.poll`, the file is written as editors and `kubectl cp`
write it, and every way a file can fail to load is a refused reload, counted, after which
the watcher still applies the next good file."""

from __future__ import annotations

import os
from pathlib import Path

from sluice.config import Policy, parse_policy
from sluice.gateway.policy_watch import PolicyWatcher

GOOD = "tenants: [{name: a, apiKeys: [sk-a]}]\nadmin: {apiKeys: [sk-admin]}\n"
OTHER = GOOD.replace("sk-a]", "sk-a, sk-b]")


class Harness:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.now = 0.0
        self.applied: list[Policy] = []
        self.results: list[tuple[bool, list[str]]] = []
        self.current = parse_policy(GOOD)
        self.watcher = PolicyWatcher(
            path,
            self._apply,
            lambda ok, errors: self.results.append((ok, errors)),
            current=lambda: self.current,
            clock=lambda: self.now,
        )

    def _apply(self, policy: Policy) -> None:
        self.applied.append(policy)
        self.current = policy

    def poll(self, at: float) -> None:
        self.now = at
        self.watcher.poll()


def _write_in_place(path: Path, data: bytes, mtime_ns: int) -> None:
    with open(path, "r+b") as f:  # same inode: truncated, then written
        f.truncate(0)
        f.write(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_a_file_written_in_two_parts_is_read_once_whole(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    h = Harness(path)
    data = OTHER.encode()
    _write_in_place(path, data[:10], 1_000)  # the first part (half a key)
    h.poll(0.5)
    h.poll(1.0)
    _write_in_place(path, data, 2_000)  # the rest, 0.8 s later
    h.poll(1.3)
    h.poll(3.2)
    assert h.results == [] and h.applied == []  # not yet unchanged for 2 s
    h.poll(3.5)
    assert h.results == [(True, [])]
    assert h.applied[0].tenants[0].api_keys == ["sk-a", "sk-b"]


def test_a_file_replaced_whole_is_read_at_once(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    h = Harness(path)
    new = tmp_path / "policy.yaml.tmp"
    new.write_text(OTHER)
    os.replace(new, path)  # a rename: a new inode
    h.poll(0.5)
    assert h.results == [(True, [])]


def test_every_kind_of_bad_file_is_a_refused_reload_and_the_watcher_goes_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    h = Harness(path)
    at = 0.0
    bad = [
        b"",  # empty: a write caught half-way
        b"tenants: [{name: a, apiKeys: [caf\xe9]}]\n",  # not UTF-8
        b"queues: [",  # not YAML
        b"a: " + b"[" * 1000 + b"]" * 1000 + b"\n",  # nesting deep enough to hurt
        b"limiter: {algorithm: fixed}\n",  # no tenant: everyone 401
        b"tenants: [{name: a, apiKeys: [sk-a]}]\n",  # drops the admin key
    ]
    for i, data in enumerate(bad):
        replacement = tmp_path / f"new-{i}"
        replacement.write_bytes(data)
        os.replace(replacement, path)
        at += 0.5
        h.poll(at)
    assert h.applied == []
    assert [ok for ok, _ in h.results] == [False] * len(bad)
    reasons = [errors[0] for _, errors in h.results]
    assert reasons[0] == "(file): the file is empty"
    assert reasons[1].startswith("(file): not UTF-8 text")
    assert reasons[4].startswith("tenants: no tenant has an API key")
    assert reasons[5].startswith("admin: the policy in force has admin keys")
    fixed = tmp_path / "fixed"
    fixed.write_text(OTHER)
    os.replace(fixed, path)
    h.poll(at + 0.5)
    assert h.results[-1] == (True, [])


def test_a_failure_while_applying_is_a_refused_reload(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    results: list[bool] = []

    def apply(_policy: Policy) -> None:
        raise RuntimeError("surprise")

    watcher = PolicyWatcher(path, apply, lambda ok, _errors: results.append(ok))
    applied, errors = watcher.reload(force=True)
    assert (applied, results) == (False, [False])
    assert errors == ["(reload): RuntimeError: surprise"]
