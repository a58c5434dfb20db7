"""Teardown and infrastructure faults on the shared side stack, which runs the reaper (a pass
every second), in its environment ``codebase-planning-reaped`` (a 4 s idle timeout and 2 s
of grace after grading).

The worker-kill test stops and restarts that stack's worker: it stays the last test here.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import REAPED
from tests.e2e.helpers import error_code, function_call, new_trace, sandboxes_of, wait_for
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")


@pytest.fixture()
def item(reaper_stack: Stack) -> dict[str, Any]:
    return {
        "environment": REAPED,
        "codebase": reaper_stack.codebase,
        "gold_files": ["src/requests/api.py"],
    }


def _state(stack: Stack, rollout_id: str) -> str:
    with stack.client() as client:
        state: str = client.get(f"/v1/rollouts/{rollout_id}").json()["state"]
        return state


def test_sandbox_reaped_after_grace(reaper_stack: Stack, item: dict[str, Any]) -> None:
    trace = new_trace()
    with reaper_stack.client() as client:
        first = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "ls"})
        )
        assert first.status_code == 200, first.text
        graded = client.post(
            "/agent-rft/grade",
            json={
                "sample": {"output_text": "src/requests/api.py"},
                "item": item,
                "trace_id": trace,
            },
        )
        assert graded.json()["score"] == 1.0
        # Kept through the grace period (a retried grade still finds it)...
        assert len(sandboxes_of(reaper_stack.settings, trace)) == 1
        # ...then torn down by the reaper.
        wait_for(
            lambda: not sandboxes_of(reaper_stack.settings, trace),
            timeout_s=15,
            what="the graded rollout's sandbox to be reaped",
        )
        assert _state(reaper_stack, trace) == "closed"
        retry = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": "other.py"}, "item": item, "trace_id": trace},
        )
        assert retry.status_code == 200
        assert retry.json()["score"] == 1.0


def test_idle_rollout_reaped(reaper_stack: Stack, item: dict[str, Any]) -> None:
    """The reaper ends a rollout idle past its timeout and destroys its sandbox; the model
    was only thinking, so its next call is a 503 naming why (never a 409 the platform would
    show the model), the rollout is failed, and its grade is a 503: discarded, not scored."""
    trace = new_trace()
    with reaper_stack.client() as client:
        first = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "ls"})
        )
        assert first.status_code == 200
        assert len(sandboxes_of(reaper_stack.settings, trace)) == 1
        wait_for(
            lambda: (
                _state(reaper_stack, trace) == "closed"
                and not sandboxes_of(reaper_stack.settings, trace)
            ),
            timeout_s=15,
            what="the idle rollout to be reaped",
        )
        assert client.get(f"/v1/rollouts/{trace}").json()["ended_by"]["cause"] == "idle_reaped"
        late = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "ls"})
        )
        assert late.status_code == 503, late.text
        assert late.headers["Retry-After"]
        assert late.json()["error"]["type"] == "infra_error"
        assert error_code(late) == "idle_reaped"
        graded = client.post(
            "/agent-rft/grade",
            json={
                "sample": {"output_text": "src/requests/api.py"},
                "item": item,
                "trace_id": trace,
            },
        )
        assert graded.status_code == 503, graded.text
        assert error_code(graded) == "idle_reaped"
        view = client.get(f"/v1/rollouts/{trace}").json()
        assert (view["state"], view["outcome"], view["score"]) == (
            "infra_failed",
            "infra_error",
            None,
        )
        assert view["infra_failure"]["cause"] == "idle_reaped"


def test_running_call_is_not_idle(reaper_stack: Stack, item: dict[str, Any]) -> None:
    trace = new_trace()
    with reaper_stack.client() as client:
        first = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "true"})
        )
        assert first.status_code == 200
        slow = client.post(
            "/agent-rft/tools",
            json=function_call(
                trace, item, "shell", {"command": "sleep 7; echo done", "timeout_s": 20}
            ),
        )
    with reaper_stack.client() as client:
        client.delete(f"/v1/rollouts/{trace}")
    assert slow.status_code == 200, slow.text
    assert slow.json()["output"] == "done"


def test_worker_killed_mid_call_is_infra_error(reaper_stack: Stack, item: dict[str, Any]) -> None:
    trace = new_trace()
    with reaper_stack.client() as client:
        first = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "true"})
        )
        assert first.status_code == 200

    async def call_then_kill() -> tuple[httpx.Response, float]:
        async with reaper_stack.async_client() as aclient:
            pending = asyncio.create_task(
                aclient.post(
                    "/agent-rft/tools",
                    json=function_call(
                        trace, item, "shell", {"command": "sleep 30", "timeout_s": 40}
                    ),
                )
            )
            await asyncio.sleep(1.0)
            assert not pending.done()
            killed_at = time.monotonic()
            reaper_stack.stop("worker", signal.SIGKILL)
            response = await pending
            return response, time.monotonic() - killed_at

    try:
        response, waited = asyncio.run(call_then_kill())
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"]
        error = response.json()["error"]
        assert error["type"] == "infra_error"
        assert error["rollout_id"] == trace
        assert waited < 10, f"the API took {waited:.1f} s to notice the dead worker"

        with reaper_stack.client() as client:
            view = client.get(f"/v1/rollouts/{trace}").json()
            assert view["state"] == "infra_failed"
            assert view["outcome"] == "infra_error"
            assert view["infra_failure"]["cause"] == "worker_lost"
            graded = client.post(
                "/agent-rft/grade",
                json={
                    "sample": {"output_text": "src/requests/api.py"},
                    "item": item,
                    "trace_id": trace,
                },
            )
            assert graded.status_code == 503, graded.text
            assert graded.json()["error"]["type"] == "infra_error"
            # Sticky: later calls are 503 too, never a score or an agent error.
            again = client.post(
                "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "ls"})
            )
            assert again.status_code == 503
    finally:
        reaper_stack.restart_worker()
    # Back up, the reaper ends the failed rollout and its sandbox is destroyed.
    wait_for(
        lambda: not sandboxes_of(reaper_stack.settings, trace),
        timeout_s=20,
        what="the infra-failed rollout's sandbox to be destroyed",
    )
    assert _state(reaper_stack, trace) == "infra_failed"
