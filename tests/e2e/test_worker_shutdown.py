"""A worker stopped with SIGTERM: running calls finish (or, past the grace period, are
settled as infrastructure errors); calls sent to the stopped host are answered at once as
never run, and their retry runs them exactly once on the worker that replaces it."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from orchestrator.state.keys import Keys
from tests.e2e.helpers import error_code, function_call, new_call_id, new_trace
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")


def _heartbeat(stack: Stack) -> Any:
    client = redis.Redis.from_url(stack.settings.redis_url)
    try:
        return client.get(Keys.of(stack.settings.deployment).heartbeat(stack.settings.host_id))
    finally:
        client.close()


@pytest.fixture()
def worker_restored(stack: Stack) -> Iterator[None]:
    yield
    stack.restart_worker()


def _post(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    return client.post("/agent-rft/tools", json=body, timeout=120)


def test_sigterm_lets_a_running_call_finish_and_refuses_new_ones_cleanly(
    stack: Stack, planning_item: dict[str, Any], worker_restored: None
) -> None:
    trace = new_trace()
    with stack.client() as client:
        first = _post(client, function_call(trace, planning_item, "shell", {"command": "true"}))
        assert first.status_code == 200, first.text
        results: list[httpx.Response] = []
        slow = function_call(trace, planning_item, "shell", {"command": "sleep 2; echo finished"})
        runner = threading.Thread(target=lambda: results.append(_post(client, slow)))
        runner.start()
        time.sleep(0.7)
        stopped = time.monotonic()
        stack.procs["worker"].send_signal(signal.SIGTERM)
        runner.join(timeout=60)
        assert results and results[0].status_code == 200, results[0].text if results else None
        assert "finished" in results[0].json()["output"]
        stack.procs["worker"].wait(timeout=30)
        assert time.monotonic() - stopped < 15, "the worker drained and exited promptly"
        assert _heartbeat(stack) is None, "a stopped worker retires its heartbeat at once"
        # The host has no worker now: the call never runs, the rollout is not failed.
        call_id = new_call_id()
        echo = {"command": "echo ran >> /tmp/ledger; cat /tmp/ledger"}
        body = function_call(trace, planning_item, "shell", echo, call_id=call_id)
        refused = _post(client, body)
        assert refused.status_code == 503, refused.text
        assert "not run" in refused.json()["error"]["message"]
        stack.procs.pop("worker")
        stack.restart_worker()
        retried = _post(client, body)
        assert retried.status_code == 200, retried.text
        assert retried.json()["output"].count("ran") == 1
        again = _post(client, body)
        assert again.json()["output"] == retried.json()["output"], "stored, not run again"


def test_a_call_past_the_shutdown_grace_is_an_infra_error(
    stack: Stack, planning_item: dict[str, Any], worker_restored: None
) -> None:
    stack.restart_worker(ORCH_WORKER_SHUTDOWN_GRACE_S="1")
    trace = new_trace()
    with stack.client() as client:
        assert _post(client, function_call(trace, planning_item, "shell", {"command": "true"}))
        results: list[httpx.Response] = []
        slow = function_call(trace, planning_item, "shell", {"command": "sleep 60"})
        runner = threading.Thread(target=lambda: results.append(_post(client, slow)))
        runner.start()
        time.sleep(0.7)
        stack.procs["worker"].send_signal(signal.SIGTERM)
        runner.join(timeout=30)
        assert results, "the call did not hang"
        assert results[0].status_code == 503, results[0].text
        assert error_code(results[0]) == "worker_stopped"
        rollout = client.get(f"/v1/rollouts/{trace}").json()
        assert rollout["state"] == "infra_failed", rollout
        stack.procs["worker"].wait(timeout=30)
        stack.procs.pop("worker")
