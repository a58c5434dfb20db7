"""The client's error mapping and retry decisions, against httpx.MockTransport fakes.

The same client against a real stack: tests/e2e/test_client.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from orchestrator.api.models import RolloutView, ToolCallResponse
from orchestrator.client import (
    AsyncRolloutClient,
    AtCapacity,
    Conflict,
    InfraFailure,
    InvalidRequest,
    OrchestratorError,
    RetryPolicy,
    RolloutClient,
    RolloutNotFound,
    Unauthorized,
    Unavailable,
)
from orchestrator.outcomes import Outcome

FAST = RetryPolicy(attempts=4, backoff_s=0, max_backoff_s=0)
Handler = Callable[[httpx.Request], httpx.Response]


def error(status: int, code: str, *, retry_after: str | None = None) -> httpx.Response:
    kind = "infra_error" if status >= 500 else "rejected"
    headers = {"Retry-After": retry_after} if retry_after else {}
    body = {"error": {"type": kind, "code": code, "message": f"{code} happened"}}
    return httpx.Response(status, json=body, headers=headers)


def view(rollout_id: str, state: str = "active", failure: dict[str, Any] | None = None) -> str:
    return RolloutView(
        rollout_id=rollout_id,
        source="api",
        state=state,
        environment="codebase-planning",
        codebase="requests",
        host="h1",
        sandbox_id="sb",
        runtime="runc",
        tool_calls=0,
        outcome=None,
        score=None,
        timings={},
        infra_failure=failure,
    ).model_dump_json()


def reply(call_id: str) -> dict[str, Any]:
    return ToolCallResponse(
        call_id=call_id,
        seq=1,
        output="hello\n",
        outcome=Outcome.OK,
        exit_code=0,
        duration_ms=1.0,
        truncated=False,
    ).model_dump(mode="json")


def client(handler: Handler, retry: RetryPolicy = FAST) -> RolloutClient:
    http = httpx.Client(transport=httpx.MockTransport(handler))
    return RolloutClient("http://orch", "tok", retry=retry, http=http)


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (400, "malformed_json", InvalidRequest),
        (401, "unauthorized", Unauthorized),
        (404, "unknown_rollout", RolloutNotFound),
        (404, "not_found", OrchestratorError),
        (409, "exists", Conflict),
        (409, "ended", Conflict),
        (413, "too_large", InvalidRequest),
        (422, "unknown_environment_or_codebase", InvalidRequest),
        (429, "at_capacity", AtCapacity),
    ],
)
def test_error_answers_become_typed_errors(
    status: int, code: str, kind: type[OrchestratorError]
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return error(status, code, retry_after="3")

    with pytest.raises(kind) as raised:
        client(handler, RetryPolicy.off()).get("ro_1")
    assert type(raised.value) is kind
    assert (raised.value.status, raised.value.code) == (status, code)
    assert raised.value.rollout_id == "ro_1"
    assert raised.value.retry_after == 3.0
    assert len(seen) == 1
    assert seen[0].headers["Authorization"] == "Bearer tok"


def test_an_answer_that_is_not_ours_is_still_typed() -> None:
    with pytest.raises(Unavailable) as raised:
        client(
            lambda _: httpx.Response(502, text="<html>bad gateway</html>"), RetryPolicy.off()
        ).get("ro_1")
    assert (raised.value.status, raised.value.code) == (502, "http_error")
    assert "bad gateway" in raised.value.message


def test_a_503_with_the_rollout_intact_is_retried_with_the_same_call_id() -> None:
    posted: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, content=view("ro_1"))
        body = json.loads(request.content)
        posted.append(body)
        if len(posted) < 3:
            return error(503, "infra_error", retry_after="1")
        return httpx.Response(200, json=reply(body["call_id"]))

    answer = client(handler).call("ro_1", "shell", {"command": "echo hello"})
    assert answer.output == "hello\n"
    assert len(posted) == 3
    assert len({p["call_id"] for p in posted}) == 1, posted
    assert answer.call_id == posted[0]["call_id"]


def test_a_503_of_an_infra_failed_rollout_is_an_infra_failure_and_not_retried() -> None:
    posted: list[httpx.Request] = []
    failure = {"cause": "worker_lost", "message": "the worker died", "evidence": {}}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, content=view("ro_1", "infra_failed", failure))
        posted.append(request)
        return error(503, "infra_error")

    with pytest.raises(InfraFailure) as raised:
        client(handler).grade("ro_1", answer="x")
    assert len(posted) == 1
    assert raised.value.code == "worker_lost"
    assert raised.value.infra_failure == failure
    assert not raised.value.retryable


def test_retries_off_raises_the_first_503() -> None:
    posted: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, content=view("ro_1"))
        posted.append(request)
        return error(503, "state_store_unavailable")

    with pytest.raises(Unavailable) as raised:
        client(handler, RetryPolicy.off()).call("ro_1", "shell", {"command": "true"})
    assert raised.value.retryable
    assert len(posted) == 1


def test_retries_stop_after_the_policy_s_attempts() -> None:
    posted: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, content=view("ro_1"))
        posted.append(request)
        return error(503, "grader_failed")

    with pytest.raises(Unavailable):
        client(handler).grade("ro_1", answer="x")
    assert len(posted) == FAST.attempts


def test_at_capacity_create_is_retried_with_the_same_rollout_id() -> None:
    posted: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        posted.append(body)
        if len(posted) == 1:
            return error(429, "at_capacity", retry_after="2")
        created = {
            "rollout_id": body["id"],
            "environment": "codebase-planning",
            "codebase": "requests",
            "state": "active",
            "host": "h1",
            "sandbox_id": "sb",
            "tools": [{"type": "function", "name": "shell"}],
        }
        return httpx.Response(201, json=created)

    created = client(handler).create(environment="codebase-planning", item={"codebase": "x"})
    assert [p["id"] for p in posted] == [created.rollout_id] * 2
    assert created.rollout_id.startswith("ro_")


def test_a_create_whose_rollout_exists_after_a_503_is_not_retried() -> None:
    posted: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, content=view(request.url.path.rsplit("/", 1)[-1]))
        posted.append(request)
        return error(503, "infra_error")

    with pytest.raises(Unavailable) as raised:
        client(handler).create(item={"codebase": "x"}, rollout_id="ro_2")
    assert not raised.value.retryable
    assert len(posted) == 1


def test_no_answer_is_retried_except_a_create_that_may_have_arrived() -> None:
    attempts: list[str] = []

    def timeout(request: httpx.Request) -> httpx.Response:
        attempts.append(request.method)
        raise httpx.ReadTimeout("slow", request=request)

    with pytest.raises(Unavailable) as raised:
        client(timeout).create(item={})
    assert (attempts, raised.value.code) == (["POST"], "no_answer")
    attempts.clear()
    with pytest.raises(Unavailable):
        client(timeout).call("ro_1", "shell", {"command": "true"})
    assert attempts == ["POST"] * FAST.attempts


def test_invalid_arguments_are_refused_before_sending() -> None:
    def never(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"sent {request.url}")

    with pytest.raises(InvalidRequest):
        client(never).grade("ro_1", answer="a", sample={"output_text": "b"})


def test_the_rollout_context_closes_even_when_the_body_raises() -> None:
    deleted: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            deleted.append(request.url.path)
            return httpx.Response(200, content=view("ro_3", "closed"))
        created: dict[str, Any] = {
            "rollout_id": "ro_3",
            "environment": "e",
            "codebase": None,
            "state": "active",
            "host": None,
            "sandbox_id": None,
            "tools": [],
        }
        return httpx.Response(201, json=created)

    with pytest.raises(RuntimeError), client(handler).rollout(item={}, rollout_id="ro_3"):
        raise RuntimeError("the trainer's own bug")
    assert deleted == ["/v1/rollouts/ro_3"]


def test_wait_honours_retry_after_within_the_cap() -> None:
    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=5)
    busy = AtCapacity("full", status=429, retry_after=3)
    assert policy.wait_s(1, busy) == 3
    assert policy.wait_s(1, AtCapacity("full", retry_after=60)) == 5
    assert policy.wait_s(3, None) == 2
    assert RetryPolicy(honour_retry_after=False).wait_s(1, busy) == 0.5


def test_async_client_retries_with_the_same_call_id() -> None:
    posted: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, content=view("ro_1"))
        body = json.loads(request.content)
        posted.append(body)
        if len(posted) == 1:
            return error(503, "infra_error")
        return httpx.Response(200, json=reply(body["call_id"]))

    async def run() -> ToolCallResponse:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with AsyncRolloutClient("http://orch", "tok", retry=FAST, http=http) as aclient:
            answer = await aclient.call("ro_1", "shell", {"command": "echo"}, call_id="c-9")
        await http.aclose()
        return answer

    answer = asyncio.run(run())
    assert answer.call_id == "c-9"
    assert [p["call_id"] for p in posted] == ["c-9", "c-9"]
