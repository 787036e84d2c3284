"""Policy loading: deploy/k8s/configmap.yaml as it stands, durations, strict validation."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.config import (
    ConfigError,
    DropPolicy,
    load_policy,
    lockout_errors,
    missing_environment,
    parse_duration,
    parse_policy,
)

REPO = Path(__file__).resolve().parents[2]

SEED_CONFIGMAP = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: gateway-overload-policy
  namespace: ai-gateway
data:
  policy.yaml: |
    queues:
    - priority: 0
      name: realtime-interactive
      maxQueueSize: 200
      timeout: 8s
      dropPolicy: tail
    - priority: 1
      name: agent-workflow
      maxQueueSize: 500
      timeout: 15s
      dropPolicy: early-drop-on-pressure
    - priority: 2
      name: batch-extraction
      maxQueueSize: 1000
      timeout: 60s
      dropPolicy: fast-reject
"""


def test_seed_configmap_is_valid_as_it_stands() -> None:
    policy = parse_policy(SEED_CONFIGMAP)
    assert [(q.name, q.max_queue_size, q.timeout, q.drop_policy) for q in policy.queues] == [
        ("realtime-interactive", 200, 8.0, DropPolicy.TAIL),
        ("agent-workflow", 500, 15.0, DropPolicy.EARLY_DROP_ON_PRESSURE),
        ("batch-extraction", 1000, 60.0, DropPolicy.FAST_REJECT),
    ]


def test_bare_policy_yaml_is_valid() -> None:
    inner = SEED_CONFIGMAP.split("policy.yaml: |\n", 1)[1]
    bare = "\n".join(line[4:] for line in inner.splitlines())
    assert parse_policy(bare).queue(2).timeout == 60.0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("8s", 8.0), ("500ms", 0.5), ("1m", 60.0), ("2h", 7200.0), ("1.5s", 1.5), (3, 3.0)],
)
def test_durations(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["8", "8 sec", "-1s", "", True, None, "1d"])
def test_bad_durations_are_refused(bad: object) -> None:
    if bad == "8":  # a bare number string is seconds, like a bare number
        assert parse_duration(bad) == 8.0
        return
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_every_error_is_reported_with_its_field_path() -> None:
    text = """
queues:
  - {priority: 0, name: a, maxQueueSize: -1, timeout: 8q, dropPolicy: tail, bogus: 1}
  - {priority: 1, name: b, maxQueueSize: 1, timeout: 1s, dropPolicy: nope}
  - {priority: 2, name: c, maxQueueSize: 1, timeout: 1s, dropPolicy: tail}
tenants:
  - {name: t, apiKeySha256: [xyz]}
"""
    with pytest.raises(ConfigError) as info:
        parse_policy(text)
    errors = info.value.errors
    assert "queues.0.maxQueueSize: Input should be greater than or equal to 0" in errors
    assert any(e.startswith("queues.0.timeout: expected a duration") for e in errors)
    assert "queues.0.bogus: Extra inputs are not permitted" in errors
    assert any(e.startswith("queues.1.dropPolicy:") for e in errors)
    assert "tenants.0.apiKeySha256: apiKeySha256 entries must be 64 hex digits" in errors


def test_each_priority_exactly_once() -> None:
    text = """
queues:
  - {priority: 0, name: a, maxQueueSize: 1, timeout: 1s, dropPolicy: tail}
  - {priority: 0, name: b, maxQueueSize: 1, timeout: 1s, dropPolicy: tail}
  - {priority: 2, name: c, maxQueueSize: 1, timeout: 1s, dropPolicy: tail}
"""
    with pytest.raises(ConfigError, match="priorities 0, 1 and 2 exactly once"):
        parse_policy(text)


def test_a_key_may_not_name_two_tenants() -> None:
    digest = hashlib.sha256(b"k").hexdigest()
    text = f"""
tenants:
  - {{name: a, apiKeys: [k]}}
  - {{name: b, apiKeySha256: ["{digest}"]}}
"""
    with pytest.raises(ConfigError, match="more than one tenant"):
        parse_policy(text)


def test_fallback_backend_must_exist() -> None:
    text = """
features:
  - {name: f, core: false, fallback: {backend: nowhere}}
"""
    with pytest.raises(ConfigError, match="nowhere"):
        parse_policy(text)


def test_example_policy_is_complete() -> None:
    policy = load_policy(REPO / "examples" / "policy.yaml")
    keys = {k for t in policy.tenants for k in t.api_keys}
    assert {"sk-demo-p0", "sk-demo-p1", "sk-demo-p2"} <= keys
    assert policy.admin.api_keys == ["sk-demo-admin"]
    summarize = next(f for f in policy.features if f.name == "summarize")
    assert summarize.core is False and summarize.fallback and summarize.fallback.static


def _check_config(path: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", "check-config", path],
        capture_output=True,
        text=True,
        env=env,
    )


TENANT = "    tenants:\n    - {name: app, apiKeys: [sk-app]}\n"


def test_check_config_command(tmp_path: Path) -> None:
    good = tmp_path / "cm.yaml"
    good.write_text(SEED_CONFIGMAP + TENANT)
    ok = _check_config(str(good))
    assert ok.returncode == 0, ok.stderr
    assert "1 tenants" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("queues: 3\nextra: 1\n")
    res = _check_config(str(bad))
    assert res.returncode == 1
    assert "queues: Input should be a valid tuple" in res.stderr
    assert "extra: Extra inputs are not permitted" in res.stderr
    missing = _check_config(str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1 and "cannot read" in missing.stderr


KEYED = """
tenants: [{name: app, apiKeys: [sk-app]}]
backends:
  - {name: a, url: "http://10.0.0.1:8000", apiKeyEnv: SLUICE_TEST_KEY_A}
  - {name: b, url: "http://10.0.0.2:8000"}
"""


def test_a_backend_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = parse_policy(KEYED)
    a, b = policy.backends
    monkeypatch.delenv("SLUICE_TEST_KEY_A", raising=False)
    assert missing_environment(policy) == [
        "backends.0.apiKeyEnv: the environment variable SLUICE_TEST_KEY_A (the backend's "
        "API key) is not set or empty"
    ]
    assert a.auth_headers() == {} and b.auth_headers() == {}
    monkeypatch.setenv("SLUICE_TEST_KEY_A", "k-123")
    assert missing_environment(policy) == []
    assert a.auth_headers() == {"Authorization": "Bearer k-123"}
    assert b.auth_headers() == {}


def test_a_backend_key_is_named_not_written_in_the_policy(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_policy('backends: [{name: a, url: "http://h:1", apiKeyEnv: "sk-live 123"}]')
    assert err.value.errors[0].startswith("backends.0.apiKeyEnv: String should match pattern")
    with pytest.raises(ConfigError) as err:
        parse_policy('backends: [{name: a, url: "http://h:1", apiKey: "sk-live-123"}]')
    assert err.value.errors == ["backends.0.apiKey: Extra inputs are not permitted"]
    # check-config may run where the secret is not: it warns and passes
    path = tmp_path / "keyed.yaml"
    path.write_text(KEYED)
    res = _check_config(
        str(path), env={k: v for k, v in os.environ.items() if k != "SLUICE_TEST_KEY_A"}
    )
    assert res.returncode == 0, res.stderr
    assert "warning: backends.0.apiKeyEnv: the environment variable SLUICE_TEST_KEY_A" in (
        res.stderr
    )


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "(file): the file is empty"),
        (b"  \n\n", "(file): the file is empty"),
        (b"queues: caf\xe9\n", "(file): not UTF-8 text (byte 0xe9 at offset 11)"),
        (SEED_CONFIGMAP.encode(), "tenants: no tenant has an API key"),
        (b"tenants: [{name: a}]\n", "tenants: no tenant has an API key"),
    ],
    ids=["empty", "blank", "not-utf8", "seed-without-tenants", "tenant-without-key"],
)
def test_check_config_refuses_a_file_that_cannot_serve_anyone(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    """Empty (a half-written file), not UTF-8, or no tenant with a key (every client
    would get 401): a clear message, exit 1, never a traceback."""
    path = tmp_path / "policy.yaml"
    path.write_bytes(content)
    res = _check_config(str(path))
    assert res.returncode == 1, res.stdout
    assert f"{path}: invalid policy" in res.stderr
    assert reason in res.stderr, res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_a_lockout_is_accepted_only_when_the_policy_says_so(tmp_path: Path) -> None:
    path = tmp_path / "maintenance.yaml"
    path.write_text("allowLockout: [tenants]\n")
    res = _check_config(str(path))
    assert res.returncode == 0, res.stderr
    assert lockout_errors(parse_policy("allowLockout: [tenants]")) == []


def test_a_policy_that_drops_every_admin_key_is_refused_against_one_that_had_some() -> None:
    keyed = parse_policy("tenants: [{name: a, apiKeys: [k]}]\nadmin: {apiKeys: [adm]}")
    no_admin = parse_policy("tenants: [{name: a, apiKeys: [k]}]")
    assert lockout_errors(no_admin) == []  # at start: no admin API, nobody locked out
    [error] = lockout_errors(no_admin, current=keyed)
    assert error.startswith("admin: the policy in force has admin keys and this one none")
    explicit = parse_policy("tenants: [{name: a, apiKeys: [k]}]\nallowLockout: [admin]")
    assert lockout_errors(explicit, current=keyed) == []


def test_any_failure_to_read_a_policy_is_a_config_error(tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 1000 + "]" * 1000 + "\n")
    with pytest.raises(ConfigError) as err:
        load_policy(deep)
    assert err.value.errors[0].startswith("(file): ")
