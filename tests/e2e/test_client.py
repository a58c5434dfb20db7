"""orchestrator.client against a real stack (API, Celery worker, Redis, sandboxes): the
whole lifecycle sync and async, typed errors, a retried 503 that runs its call once, and
an infra-failed rollout that raises InfraFailure instead of being scored."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from orchestrator.client import (
    AsyncRolloutClient,
    Conflict,
    InfraFailure,
    InvalidRequest,
    RetryPolicy,
    RolloutClient,
    RolloutNotFound,
)
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.tls import tls
from tests.e2e.helpers import file_f1, sandboxes_of, wait_for
from tests.stacks import TOKEN, Stack

pytestmark = pytest.mark.xdist_group("e2e")

GOLD = '["src/requests/sessions.py", "src/requests/adapters.py"]'


@pytest.fixture()
def client(stack: Stack) -> Iterator[RolloutClient]:
    with RolloutClient(stack.base_url, TOKEN) as client:
        yield client


def test_full_rollout_sync(
    stack: Stack, client: RolloutClient, planning_item: dict[str, Any]
) -> None:
    with client.rollout(
        environment="codebase-planning", codebase=stack.codebase, item=planning_item
    ) as rollout:
        assert rollout.created.state == "active"
        assert {t["name"] for t in rollout.tools} == {"shell", "read_file"}
        assert sandboxes_of(stack.settings, rollout.id) == [rollout.created.sandbox_id]

        found = rollout.call("shell", {"command": "grep -rln 'class Session' src"}, call_id="c-1")
        assert (found.call_id, found.seq, found.outcome, found.exit_code) == ("c-1", 1, "ok", 0)
        assert "src/requests/sessions.py" in found.output.splitlines()
        # The same call_id again: the stored reply, not a second run.
        assert rollout.call("shell", {"command": "echo other"}, call_id="c-1") == found

        read = rollout.call("read_file", {"path": "src/requests/sessions.py", "end_line": 3})
        assert read.outcome == "ok" and read.seq == 2
        mistake = rollout.call("shell", {"commmand": "ls"})
        assert mistake.outcome == "agent_error"
        assert mistake.error_kind == "invalid_arguments"

        score = rollout.grade(answer=GOLD)
        assert score.score == pytest.approx(file_f1(GOLD, planning_item))
        assert rollout.grade(answer="[]").score == score.score, "the first score stands"
        steps = rollout.trajectory().steps
        assert [s.call_id for s in steps[:1]] == ["c-1"]
        # The default grace_after_grade_s (0): the grade closed it, and its sandbox goes.
        assert rollout.view().state == "closed"
    assert rollout.closed
    assert client.get(rollout.id).state == "closed"
    wait_for(lambda: sandboxes_of(stack.settings, rollout.id) == [], timeout_s=30, what="destroyed")


def test_full_rollout_async(stack: Stack, planning_item: dict[str, Any]) -> None:
    async def run() -> tuple[str, float, str]:
        async with AsyncRolloutClient(stack.base_url, TOKEN) as aclient:
            rollout = await aclient.rollout(
                environment="codebase-planning", codebase=stack.codebase, item=planning_item
            )
            async with rollout:
                # Parallel calls of one rollout, as a model's parallel tool calls.
                replies = await asyncio.gather(
                    rollout.call("shell", {"command": "ls src/requests | head -3"}),
                    rollout.call("read_file", {"path": "src/requests/__init__.py"}),
                )
                assert all(r.outcome == "ok" for r in replies)
                assert sorted(r.seq for r in replies) == [1, 2]
                score = await rollout.grade(sample={"output_text": GOLD})
            view = await aclient.get(rollout.id)
            return rollout.id, score.score, view.state

    rollout_id, score, state = asyncio.run(run())
    assert score == pytest.approx(file_f1(GOLD, planning_item))
    assert state == "closed"
    assert sandboxes_of(stack.settings, rollout_id) == []


def test_typed_errors(stack: Stack, client: RolloutClient, planning_item: dict[str, Any]) -> None:
    with pytest.raises(RolloutNotFound) as missing:
        client.get(f"ro_missing_{uuid.uuid4().hex}")
    assert (missing.value.status, missing.value.code) == (404, "unknown_rollout")

    with pytest.raises(InvalidRequest) as invalid:
        client.create(environment="codebase-planning", codebase="no-such-codebase", item={})
    assert invalid.value.status == 422

    rollout_id = f"ro-client-{uuid.uuid4().hex}"
    client.create(codebase=stack.codebase, item=planning_item, rollout_id=rollout_id)
    try:
        with pytest.raises(Conflict) as exists:
            client.create(codebase=stack.codebase, item=planning_item, rollout_id=rollout_id)
        assert (exists.value.status, exists.value.code) == (409, "exists")
    finally:
        client.close(rollout_id)
    with pytest.raises(Conflict) as ended:
        client.call(rollout_id, "shell", {"command": "true"})
    assert ended.value.code == "ended"


@pytest.fixture()
def worker_restored(stack: Stack) -> Iterator[None]:
    yield
    if stack.procs.get("worker") is None or stack.procs["worker"].poll() is not None:
        stack.procs.pop("worker", None)
        stack.restart_worker()


def test_a_503_is_retried_with_the_same_call_id_and_runs_once(
    stack: Stack, planning_item: dict[str, Any], worker_restored: None
) -> None:
    """The host's worker stops (SIGTERM): the call is answered 503 as never run; the
    client retries it with the same call_id until a new worker runs it, once."""
    refused = threading.Event()
    posted: list[str] = []

    def watch(response: httpx.Response) -> None:
        if response.request.method == "POST" and "/tools/" in response.request.url.path:
            posted.append(json.loads(response.request.content)["call_id"])
            if response.status_code == 503:
                refused.set()

    retry = RetryPolicy(attempts=200, backoff_s=0.2, max_backoff_s=0.5, max_elapsed_s=120)
    http = httpx.Client(timeout=120, event_hooks={"response": [watch]}, verify=tls())
    with RolloutClient(stack.base_url, TOKEN, retry=retry, http=http) as client:
        rollout = client.rollout(codebase=stack.codebase, item=planning_item)
        with rollout:
            stack.procs["worker"].send_signal(signal.SIGTERM)
            stack.procs["worker"].wait(timeout=30)
            stack.procs.pop("worker")
            results: list[Any] = []
            ledger = {"command": "echo ran >> /tmp/ledger; cat /tmp/ledger"}
            caller = threading.Thread(
                target=lambda: results.append(rollout.call("shell", ledger, call_id="c-once"))
            )
            caller.start()
            assert refused.wait(timeout=60), "the call was never refused while no worker ran"
            stack.restart_worker()
            caller.join(timeout=120)
            assert results, "the retried call did not finish"
            assert results[0].output.count("ran") == 1
            assert set(posted) == {"c-once"} and len(posted) >= 2
            again = rollout.call("shell", ledger, call_id="c-once")
            assert again.output == results[0].output, "stored, not run again"
            assert rollout.view().state == "active"
    http.close()


def test_an_infra_failed_rollout_raises_infra_failure(
    stack: Stack, client: RolloutClient, planning_item: dict[str, Any]
) -> None:
    with client.rollout(codebase=stack.codebase, item=planning_item) as rollout:
        assert rollout.call("shell", {"command": "true"}).outcome == "ok"
        backend = DockerBackend(stack.settings)
        try:
            (handle,) = [h for h in backend.list_owned() if h.rollout_id == rollout.id]
            backend.client.api.kill(handle.native_id)
        finally:
            backend.client.close()
        with pytest.raises(InfraFailure) as failed:
            rollout.call("shell", {"command": "echo after"})
        assert rollout.infra_failed
        assert failed.value.rollout_id == rollout.id
        assert failed.value.infra_failure["cause"] == "tool_call_failed"
        assert not failed.value.retryable
        with pytest.raises(InfraFailure):
            rollout.grade(answer=GOLD)
        assert rollout.view().score is None, "never scored"
    assert client.get(rollout.id).state == "infra_failed"
    wait_for(
        lambda: not sandboxes_of(stack.settings, rollout.id),
        timeout_s=30,
        what="the failed rollout's sandbox to go",
    )
