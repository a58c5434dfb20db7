"""Bad input end to end: each rejection has its documented status and changes no state
(no rollout record, no sandbox)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from orchestrator.tls import tls
from tests.e2e.helpers import (
    assert_no_rollout,
    error_code,
    function_call,
    new_trace,
    owned_count,
    sandboxes_of,
)
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")

PROTECTED = [
    ("POST", "/agent-rft/tools"),
    ("POST", "/agent-rft/tools/shell"),
    ("POST", "/agent-rft/grade"),
    ("POST", "/v1/rollouts"),
    ("GET", "/v1/rollouts/ro_x"),
    ("GET", "/v1/rollouts/ro_x/trajectory"),
    ("POST", "/v1/rollouts/ro_x/tools/shell"),
    ("POST", "/v1/rollouts/ro_x/grade"),
    ("DELETE", "/v1/rollouts/ro_x"),
]


def test_malformed_json_is_400(stack: Stack) -> None:
    trace = new_trace()
    before = owned_count(stack.settings)
    with stack.client() as client:
        for path in ("/agent-rft/tools", "/agent-rft/tools/shell", "/agent-rft/grade"):
            text = f'{{"trace_id": "{trace}", "call_id": "c1", "name": "shell", "arguments": '
            response = client.post(path, content=text, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, response.text
            assert response.json()["error"] == {
                "type": "rejected",
                "code": "malformed_json",
                "message": "the body is not valid JSON",
            }
        # No content type at all: still read as JSON, still 400.
        assert client.post("/v1/rollouts", content=b"{nope").status_code == 400
        assert_no_rollout(client, stack.settings, trace)
    assert owned_count(stack.settings) == before


def test_arguments_not_json_on_first_call(stack: Stack, planning_item: dict[str, Any]) -> None:
    trace = new_trace()
    with stack.client() as client:
        body = {**function_call(trace, planning_item, "shell", {}), "arguments": "{command: ls"}
        response = client.post("/agent-rft/tools", json=body)
        assert response.status_code == 200
        assert "not valid JSON" in response.json()["output"]
        assert response.json()["call_id"] == body["call_id"]
        assert_no_rollout(client, stack.settings, trace)


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("shell", {"command": 5}, "command: input should be a valid string, got integer 5"),
        ("shell", {"command": ""}, "command"),
        ("shell", {"command": "ls", "timeout_s": -1}, "timeout_s"),
        ("shell", {"command": "ls", "timeout_s": 10_000}, "at most"),
        ("shell", '["ls"]', "arguments must be a JSON object, got array"),
        ("read_file", {"path": "README.md", "start_line": "1"}, "start_line"),
        ("read_file", {}, "path: required argument is missing"),
        ("grep", {"pattern": "x"}, "unknown tool 'grep'"),
    ],
)
def test_agent_argument_errors_are_200_and_create_nothing(
    stack: Stack, planning_item: dict[str, Any], name: str, arguments: Any, expected: str
) -> None:
    trace = new_trace()
    with stack.client() as client:
        body = function_call(trace, planning_item, name, arguments)
        response = client.post("/agent-rft/tools", json=body)
        assert response.status_code == 200, response.text
        assert expected in response.json()["output"]
        assert_no_rollout(client, stack.settings, trace)


@pytest.mark.parametrize("missing", ["trace_id", "call_id"])
def test_missing_ids_are_422(stack: Stack, planning_item: dict[str, Any], missing: str) -> None:
    trace = new_trace()
    before = owned_count(stack.settings)
    with stack.client() as client:
        body = function_call(trace, planning_item, "shell", {"command": "ls"})
        del body[missing]
        for path in ("/agent-rft/tools", "/agent-rft/tools/shell"):
            response = client.post(path, json=body)
            assert response.status_code == 422, response.text
            assert error_code(response) == "invalid_request"
            assert missing in response.json()["error"]["message"]
        if missing == "trace_id":
            graded = client.post("/agent-rft/grade", json={"sample": {}, "item": planning_item})
            assert graded.status_code == 422
        assert_no_rollout(client, stack.settings, trace)
    assert owned_count(stack.settings) == before


def test_name_required_on_shared_url(stack: Stack, planning_item: dict[str, Any]) -> None:
    trace = new_trace()
    with stack.client() as client:
        response = client.post(
            "/agent-rft/tools", json=function_call(trace, planning_item, None, {"command": "ls"})
        )
        assert response.status_code == 422
        assert "name" in response.json()["error"]["message"]
        assert_no_rollout(client, stack.settings, trace)


def test_ids_of_bad_shape_are_422(stack: Stack, planning_item: dict[str, Any]) -> None:
    with stack.client() as client:
        for field, value in (("trace_id", "has space"), ("trace_id", "x" * 300), ("call_id", "")):
            body = function_call(new_trace(), planning_item, "shell", {"command": "ls"})
            body[field] = value
            assert client.post("/agent-rft/tools", json=body).status_code == 422
        bad = client.post("/v1/rollouts", json={"item": planning_item, "id": "-leading-dash"})
        assert bad.status_code == 422
        assert client.get("/v1/rollouts/-leading-dash").status_code == 422


def _oversized(stack: Stack, trace: str) -> bytes:
    padding = "x" * (stack.settings.max_request_bytes + 10)
    body = function_call(
        trace, {"codebase": stack.codebase, "pad": padding}, "shell", {"command": "ls"}
    )
    return json.dumps(body).encode()


def test_body_over_limit_with_content_length_is_413(stack: Stack) -> None:
    trace = new_trace()
    with stack.client() as client:
        for path in ("/agent-rft/tools", "/agent-rft/grade", "/v1/rollouts"):
            response = client.post(path, content=_oversized(stack, trace))
            assert response.status_code == 413, response.text
            assert error_code(response) == "too_large"
        assert_no_rollout(client, stack.settings, trace)


def test_chunked_body_over_limit_is_413(stack: Stack) -> None:
    trace = new_trace()
    payload = _oversized(stack, trace)

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(payload), 64 * 1024):
            yield payload[start : start + 64 * 1024]

    with stack.client() as client:
        response = client.post(
            "/agent-rft/tools", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert_no_rollout(client, stack.settings, trace)
        assert response.status_code == 413, response.text


def test_chunked_body_under_limit_is_fine(stack: Stack, planning_item: dict[str, Any]) -> None:
    trace = new_trace()
    payload = json.dumps(function_call(trace, planning_item, "nope", {})).encode()

    def chunks() -> Iterator[bytes]:
        yield payload[:10]
        yield payload[10:]

    with stack.client() as client:
        response = client.post("/agent-rft/tools", content=chunks())
        assert response.status_code == 200, response.text
        assert "unknown tool" in response.json()["output"]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_auth_required(stack: Stack, planning_item: dict[str, Any], method: str, path: str) -> None:
    trace = new_trace()
    body = function_call(trace, planning_item, "shell", {"command": "ls"})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic xyz"}):
        response = httpx.request(
            method, stack.base_url + path, json=body if method == "POST" else None, headers=headers
        )
        assert response.status_code == 401, (headers, response.text)
        assert error_code(response) == "unauthorized"
        assert response.headers["WWW-Authenticate"] == "Bearer"
    with stack.client() as client:
        assert_no_rollout(client, stack.settings, trace)


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/openapi.json", "/docs"])
def test_open_endpoints_need_no_token(stack: Stack, path: str) -> None:
    assert httpx.get(stack.base_url + path, verify=tls()).status_code == 200


@pytest.mark.parametrize("path", ["/metrics", "/v1/readiness"])
def test_the_operators_endpoints_need_a_token(stack: Stack, path: str) -> None:
    """The metrics and readiness's reasons are not for the internet (docs/tenancy.md)."""
    assert httpx.get(stack.base_url + path, verify=tls()).status_code == 401
    with stack.client() as client:
        assert client.get(path).status_code == 200


def test_unknown_environment_or_codebase_is_422(stack: Stack) -> None:
    trace = new_trace()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"environment": "no-such-env", "codebase": stack.codebase}, "no-such-env"),
        ({"codebase": "no-such-codebase"}, "no-such-codebase"),
        ({"environment": 7}, "environment"),
        ({}, "codebase"),
    ]
    before = owned_count(stack.settings)
    with stack.client() as client:
        for item, named in cases:
            for path in ("/agent-rft/tools", "/agent-rft/grade"):
                body = function_call(trace, item, "shell", {"command": "ls"})
                body["sample"] = {"output_text": "a.py"}
                response = client.post(path, json=body)
                assert response.status_code == 422, response.text
                assert named in response.json()["error"]["message"]
            created = client.post("/v1/rollouts", json={"item": item, "id": trace})
            assert created.status_code == 422
            assert named in created.json()["error"]["message"]
        by_field = client.post(
            "/v1/rollouts", json={"environment": "nope-env", "id": trace, "item": {}}
        )
        assert by_field.status_code == 422 and "nope-env" in by_field.text
        assert_no_rollout(client, stack.settings, trace)
    assert owned_count(stack.settings) == before


@pytest.mark.parametrize(
    ("method", "suffix", "body"),
    [
        ("GET", "", None),
        ("GET", "/trajectory", None),
        ("DELETE", "", None),
        ("POST", "/tools/shell", {"arguments": {"command": "ls"}}),
        ("POST", "/grade", {"answer": "a.py"}),
    ],
)
def test_unknown_rollout_is_404(
    stack: Stack, method: str, suffix: str, body: dict[str, Any] | None
) -> None:
    rollout_id = f"ro_{uuid.uuid4().hex}"
    with stack.client() as client:
        response = client.request(method, f"/v1/rollouts/{rollout_id}{suffix}", json=body)
        assert response.status_code == 404, response.text
        assert error_code(response) == "unknown_rollout"
        assert_no_rollout(client, stack.settings, rollout_id)


def test_rollout_grade_needs_exactly_one_of_answer_or_sample(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    with stack.client() as client:
        rollout_id = client.post("/v1/rollouts", json={"item": planning_item}).json()["rollout_id"]
        for body in ({}, {"answer": "a.py", "sample": {"output_text": "b.py"}}):
            response = client.post(f"/v1/rollouts/{rollout_id}/grade", json=body)
            assert response.status_code == 422, response.text
        assert client.get(f"/v1/rollouts/{rollout_id}").json()["state"] == "active"
        client.delete(f"/v1/rollouts/{rollout_id}")


def test_rejected_grade_of_unseen_trace_changes_nothing(stack: Stack) -> None:
    trace = new_trace()
    item = {"codebase": stack.codebase}  # resolvable, but no gold_files: 422
    with stack.client() as client:
        graded = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": "a.py"}, "item": item, "trace_id": trace},
        )
        assert graded.status_code == 422
        assert error_code(graded) == "invalid_item"
        # Nothing was stored: the trace is still unknown ...
        assert client.get(f"/v1/rollouts/{trace}").status_code == 404
        # ... so its first tool call starts the rollout as usual.
        later = client.post(
            "/agent-rft/tools",
            json=function_call(trace, {**item, "gold_files": ["a.py"]}, "shell", {"command": "ls"}),
        )
        assert later.status_code == 200, later.text
        client.delete(f"/v1/rollouts/{trace}")


def test_rollout_ids_cannot_collide_with_store_keys(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    trace = new_trace()
    with stack.client() as client:
        first = client.post(
            "/agent-rft/tools",
            json=function_call(trace, planning_item, "shell", {"command": "true"}, call_id="c1"),
        )
        assert first.status_code == 200
    # Fresh connections: after a 503 internal_error the server drops the keep-alive one.
    statuses = []
    for path in (f"/v1/rollouts/{trace}:seq", f"/v1/rollouts/{trace}:traj/trajectory"):
        with stack.client() as client:
            statuses.append(client.get(path).status_code)
    with stack.client() as client:
        created = client.post(
            "/v1/rollouts", json={"id": f"{trace}:call:c1", "item": planning_item}
        )
    with stack.client() as client:
        if created.status_code == 201:
            client.delete(f"/v1/rollouts/{trace}:call:c1")
        client.delete(f"/v1/rollouts/{trace}")
        assert sandboxes_of(stack.settings, f"{trace}:call:c1") == []
    # Ids with the store's key separator are not rollout ids at all.
    assert statuses == [422, 422]
    assert created.status_code in (201, 422), created.text
