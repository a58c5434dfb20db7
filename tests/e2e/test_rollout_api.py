"""The explicit rollout API (`/v1/rollouts`) end to end: create, call, grade, read, delete."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from orchestrator.state.keys import Keys
from tests.e2e.helpers import error_code, file_f1, sandboxes_of
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")

CALL_KEYS = {"call_id", "seq", "output", "outcome", "exit_code", "duration_ms", "truncated"}


def test_full_lifecycle(stack: Stack, planning_item: dict[str, Any]) -> None:
    rollout_id = f"ro-e2e-{uuid.uuid4().hex}"
    with stack.client() as client:
        created = client.post(
            "/v1/rollouts",
            json={
                "environment": "codebase-planning",
                "codebase": stack.codebase,
                "item": planning_item,
                "id": rollout_id,
            },
        )
        assert created.status_code == 201, created.text
        body = created.json()
        assert body["rollout_id"] == rollout_id
        assert body["state"] == "active"
        assert body["codebase"] == stack.codebase
        tools = {t["name"]: t for t in body["tools"]}
        assert set(tools) == {"shell", "read_file"}
        assert tools["shell"]["type"] == "function"
        assert tools["shell"]["parameters"]["required"] == ["command"]
        assert "path" in tools["read_file"]["parameters"]["properties"]
        assert sandboxes_of(stack.settings, rollout_id) == [body["sandbox_id"]]

        again = client.post("/v1/rollouts", json={"item": planning_item, "id": rollout_id})
        assert again.status_code == 409
        assert error_code(again) == "exists"

        ran = client.post(
            f"/v1/rollouts/{rollout_id}/tools/shell",
            json={"arguments": {"command": "grep -rln 'class Session' src"}, "call_id": "c-1"},
        )
        assert ran.status_code == 200, ran.text
        reply = ran.json()
        assert set(reply) >= CALL_KEYS
        assert reply["call_id"] == "c-1"
        assert reply["seq"] == 1
        assert reply["outcome"] == "ok"
        assert reply["exit_code"] == 0
        assert reply["truncated"] is False
        assert reply["duration_ms"] > 0
        assert "src/requests/sessions.py" in reply["output"].splitlines()

        # A retry of c-1 gets the stored reply; a string of arguments works too.
        assert (
            client.post(
                f"/v1/rollouts/{rollout_id}/tools/shell",
                json={"arguments": '{"command": "echo other"}', "call_id": "c-1"},
            ).json()
            == reply
        )

        # Without a call_id: a fresh call each time.
        failing = client.post(
            f"/v1/rollouts/{rollout_id}/tools/shell", json={"arguments": {"command": "exit 7"}}
        ).json()
        assert (failing["outcome"], failing["exit_code"], failing["seq"]) == ("ok", 7, 2)
        big = client.post(
            f"/v1/rollouts/{rollout_id}/tools/shell", json={"arguments": {"command": "seq 200000"}}
        ).json()
        assert big["truncated"] is True
        assert len(big["output"].encode()) <= stack.settings.output_budget_bytes
        unknown = client.post(
            f"/v1/rollouts/{rollout_id}/tools/nope", json={"arguments": {}}
        ).json()
        assert (unknown["outcome"], unknown["error_kind"]) == ("agent_error", "unknown_tool")
        read = client.post(
            f"/v1/rollouts/{rollout_id}/tools/read_file",
            json={"arguments": {"path": "src/requests/__init__.py", "end_line": 3}},
        ).json()
        assert read["outcome"] == "ok" and read["output"].startswith("     1\t")

        view = client.get(f"/v1/rollouts/{rollout_id}").json()
        assert view["state"] == "active" and view["source"] == "api"
        assert view["tool_calls"] == 4
        steps = client.get(f"/v1/rollouts/{rollout_id}/trajectory").json()["steps"]
        assert [s["seq"] for s in steps] == [1, 2, 3, 4]
        assert steps[0]["output"] == reply["output"]

        answer = "src/requests/sessions.py"
        graded = client.post(f"/v1/rollouts/{rollout_id}/grade", json={"answer": answer})
        assert graded.status_code == 200, graded.text
        assert graded.json()["score"] == pytest.approx(file_f1(answer, planning_item))
        assert graded.json()["details"]["tool_calls"] == 4
        regrade = client.post(
            f"/v1/rollouts/{rollout_id}/grade", json={"sample": {"output_text": "x.py"}}
        )
        assert regrade.json()["score"] == graded.json()["score"]

        deleted = client.delete(f"/v1/rollouts/{rollout_id}")
        assert deleted.status_code == 200
        assert deleted.json()["state"] == "closed"
        assert deleted.json()["timings"]["closed_at"] is not None
        assert sandboxes_of(stack.settings, rollout_id) == []
        after = client.get(f"/v1/rollouts/{rollout_id}")
        assert after.status_code == 200
        assert after.json()["state"] == "closed"
        assert after.json()["score"] == graded.json()["score"]
        assert len(client.get(f"/v1/rollouts/{rollout_id}/trajectory").json()["steps"]) == 4


def test_calls_after_delete_are_409(stack: Stack, planning_item: dict[str, Any]) -> None:
    with stack.client() as client:
        created = client.post("/v1/rollouts", json={"item": planning_item})
        assert created.status_code == 201, created.text
        rollout_id = created.json()["rollout_id"]
        assert rollout_id.startswith("ro_")
        assert client.delete(f"/v1/rollouts/{rollout_id}").status_code == 200
        assert sandboxes_of(stack.settings, rollout_id) == []
        late = client.post(
            f"/v1/rollouts/{rollout_id}/tools/shell", json={"arguments": {"command": "ls"}}
        )
        assert late.status_code == 409
        assert error_code(late) == "ended"
        # Deleting again is harmless; the record stays readable and closed.
        assert client.delete(f"/v1/rollouts/{rollout_id}").json()["state"] == "closed"
        assert client.get(f"/v1/rollouts/{rollout_id}").json()["state"] == "closed"


def test_concurrent_closes_release_the_slot_once(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    """Closes of one rollout at once (its grade's and a reaper pass's, a trainer's retried
    DELETE) end it once: each would have given the sandbox's slot back (seen: a host at
    -10 slots used, which admits more than its capacity)."""
    host = stack.settings.host_id
    with stack.client() as client:
        created = client.post("/v1/rollouts", json={"item": planning_item})
        assert created.status_code == 201, created.text
        rollout_id = created.json()["rollout_id"]
        held = _slots(stack)[host]

        def close(_: int) -> int:
            with stack.client() as own:
                return own.delete(f"/v1/rollouts/{rollout_id}").status_code

        with ThreadPoolExecutor(max_workers=8) as pool:
            assert list(pool.map(close, range(8))) == [200] * 8
        assert client.get(f"/v1/rollouts/{rollout_id}").json()["state"] == "closed"
    assert sandboxes_of(stack.settings, rollout_id) == []
    # One slot given back (a reaper recount between would only set the true count).
    assert _slots(stack)[host] == held - 1


def _slots(stack: Stack) -> dict[str, int]:
    client = redis.Redis.from_url(stack.settings.redis_url, decode_responses=True)
    try:
        loads = client.hgetall(Keys.of(stack.settings.deployment).load)
        return {str(h): int(n) for h, n in loads.items()}
    finally:
        client.close()


def test_calls_after_grade_are_409(stack: Stack, planning_item: dict[str, Any]) -> None:
    with stack.client() as client:
        rollout_id = client.post("/v1/rollouts", json={"item": planning_item}).json()["rollout_id"]
        graded = client.post(f"/v1/rollouts/{rollout_id}/grade", json={"answer": ""})
        assert graded.status_code == 200
        assert graded.json()["score"] == 0.0
        assert graded.json()["details"]["format"] == "empty"
        late = client.post(
            f"/v1/rollouts/{rollout_id}/tools/shell", json={"arguments": {"command": "ls"}}
        )
        assert late.status_code == 409
        assert error_code(late) == "ended"
        client.delete(f"/v1/rollouts/{rollout_id}")


def test_create_in_finqa_environment_with_its_tools(stack: Stack, finqa_codebase: str) -> None:
    with stack.client() as client:
        created = client.post(
            "/v1/rollouts", json={"environment": "finqa-demo", "item": {"answer": 1}}
        )
        assert created.status_code == 201, created.text
        body = created.json()
        assert body["codebase"] == finqa_codebase
        assert [t["name"] for t in body["tools"]] == ["search", "list", "cat"]
        rollout_id = body["rollout_id"]
        out = client.post(f"/v1/rollouts/{rollout_id}/tools/list", json={}).json()
        assert "halvard_fy2023.txt" in out["output"]
        graded = client.post(f"/v1/rollouts/{rollout_id}/grade", json={"answer": "1.0"})
        assert graded.json()["score"] == 1.0
        client.delete(f"/v1/rollouts/{rollout_id}")
