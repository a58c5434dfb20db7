"""The tenants file and the credentials directory (orchestrator/tenants.py), and the
lock-out of guessing (orchestrator/api/auth.py), without a server: what a file says, what
it refuses, how it is read again. tests/e2e/test_tenancy.py runs them in a real API."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.api.auth import AuthFailures, Open, authenticate
from orchestrator.tenants import (
    DEFAULT_TENANT,
    OPERATOR,
    Directory,
    Principal,
    Quotas,
    Tenants,
    TenantsError,
    digest,
    parse_tenants,
)

A_TOKEN = "a" * 43
B_TOKEN = "b" * 43


def _write(path: Path, tenants: dict[str, object]) -> None:
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    # The file is looked at once a second; its mtime must move for a read again.
    stamp = time.time() + 1
    os.utime(path, (stamp, stamp))


def test_a_principal_sees_its_own_and_an_admin_everything() -> None:
    assert Principal("a").sees("a") and not Principal("a").sees("b")
    assert Principal("a", admin=True).sees("b")
    assert OPERATOR.tenant == DEFAULT_TENANT and OPERATOR.admin


def test_tokens_are_looked_up_by_digest(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    _write(path, {"team-a": {"tokens": [digest(A_TOKEN)], "quotas": {"sandboxes": 4}}})
    tenants = Tenants(["plain-operator-token", digest("hashed-operator-token")], "", path)
    assert tenants.by_token(A_TOKEN) == Principal("team-a", quotas=Quotas(sandboxes=4))
    assert tenants.by_token("plain-operator-token") == OPERATOR
    assert tenants.by_token("hashed-operator-token") == OPERATOR
    assert tenants.by_token(digest(A_TOKEN)) is None  # the digest is no token
    assert tenants.by_token("") is None
    assert tenants.quotas("team-a").sandboxes == 4
    assert tenants.quotas("nobody").sandboxes is None


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"tenants": {"Team A": {}}}, "a name is"),
        ({"tenants": {"a": {"tokens": [A_TOKEN]}}}, "never the token itself"),
        ({"tenants": {"a": {"tokens": ["sha256:00"]}}}, "sha256:<64 hex digits>"),
        ({"tenants": {"a": {"token": []}}}, "Extra inputs"),
        ({"tenants": {"a": {"quotas": {"sandboxes": -1}}}}, "greater than or equal"),
        (
            {"tenants": {"a": {"tokens": [digest(A_TOKEN)]}, "b": {"tokens": [digest(A_TOKEN)]}}},
            "belongs to tenants 'a' and 'b'",
        ),
    ],
)
def test_a_wrong_file_says_what_is_wrong(body: dict[str, object], says: str) -> None:
    with pytest.raises(TenantsError, match=says):
        parse_tenants(yaml.safe_dump(body))


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_last(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    _write(path, {"team-a": {"tokens": [digest(A_TOKEN)]}})
    tenants = Tenants([], "", path)
    assert tenants.by_token(B_TOKEN) is None
    _write(path, {"team-a": {"tokens": [digest(A_TOKEN)]}, "team-b": {"tokens": [digest(B_TOKEN)]}})
    tenants._checked -= 2  # as if a second went by
    assert tenants.by_token(B_TOKEN) == Principal("team-b")
    path.write_text("tenants: [")
    os.utime(path, (time.time() + 2, time.time() + 2))
    tenants._checked -= 2
    assert tenants.by_token(B_TOKEN) == Principal("team-b")
    assert tenants.last_error is not None and "ORCH_TENANTS_FILE" in tenants.last_error
    # The same broken file is not read (nor logged) again every second.
    reads = 0
    read = tenants._read

    def counted() -> Directory:
        nonlocal reads
        reads += 1
        return read()

    tenants._read = counted  # type: ignore[method-assign]
    tenants._checked -= 2
    assert tenants.by_token(B_TOKEN) == Principal("team-b") and reads == 0
    _write(path, {"team-a": {"tokens": [digest(A_TOKEN)]}})
    os.utime(path, (time.time() + 3, time.time() + 3))
    tenants._checked -= 2
    assert tenants.by_token(B_TOKEN) is None and tenants.last_error is None


def test_a_file_that_cannot_be_read_fails_the_start(tmp_path: Path) -> None:
    with pytest.raises(TenantsError, match="No such file"):
        Tenants([], "", tmp_path / "missing.yaml")


def test_grader_secrets_and_the_one_rule_of_who_may_call(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    secret = "s" * 40
    _write(path, {"team-a": {"tokens": [digest(A_TOKEN)], "grader_secrets": [digest(secret)]}})
    tenants = Tenants(["op"], "o" * 40, path)
    bearer = {b"authorization": f"Bearer {A_TOKEN}".encode()}
    assert authenticate(tenants, "/v1/rollouts/x", bearer) == Principal("team-a")
    assert authenticate(tenants, "/v1/rollouts/x", {}) is None
    assert authenticate(tenants, f"/agent-rft/grade/{secret}", {}) == Principal("team-a")
    assert authenticate(tenants, "/agent-rft/grade/" + "o" * 40, {}) == OPERATOR
    assert authenticate(tenants, "/agent-rft/grade/nope", {}) is None
    assert authenticate(tenants, "/sandboxes", {b"x-api-key": A_TOKEN.encode()}) == Principal(
        "team-a"
    )
    assert authenticate(tenants, "/readyz", {}) is Open.PATH
    assert authenticate(tenants, "/metrics", {}) is None
    plane = {b"e2b-sandbox-id": b"sbx", b"x-access-token": b"t"}
    assert authenticate(tenants, "/files", plane) is Open.PATH
    assert authenticate(tenants, "/files", {}) is None


def test_failures_lock_an_address_out_for_the_rest_of_its_window() -> None:
    failures = AuthFailures(limit=3, window_s=0.5)
    for _ in range(3):
        assert failures.locked_for("10.0.0.1") == 0
        failures.failed("10.0.0.1")
    assert 0 < failures.locked_for("10.0.0.1") <= 0.5
    assert failures.locked_for("10.0.0.2") == 0
    time.sleep(0.55)
    assert failures.locked_for("10.0.0.1") == 0
    failures.failed("10.0.0.1")  # a new window: one failure in it
    assert failures.locked_for("10.0.0.1") == 0
