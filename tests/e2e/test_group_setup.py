"""An environment's set-up step (docs/snapshots.md), through the rollout API and Agent RFT on
the side stack: a group's rollouts (one dataset item) arriving at once are set up once, in a
sandbox of the set-up's own, and all start from its snapshot; another item gets a set-up of
its own; from there each rollout's sandbox is its own; a set-up that fails is a 422 naming
why, with nothing left behind."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
import redis

from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.state.keys import Keys
from tests.e2e.conftest import GROUPED, GROUPED_BROKEN, GROUPED_SLOW
from tests.e2e.helpers import wait_for
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2b")  # the side stack's worker (test_e2b_snapshots)

LOOK = "cat .setup-id /tmp/setup ~/.cache/c; ls; pgrep -x sleep || echo no process"


def _set_up_rollouts(side: Stack) -> list[str]:
    with redis.Redis.from_url(side.settings.redis_url, decode_responses=True) as client:
        listed = client.zrange(Keys.of(side.settings.deployment).index, 0, -1)
    return [str(i) for i in listed if str(i).startswith("setup-")]


def _sandboxes(side: Stack, rollout_ids: set[str]) -> list[str]:
    """The side stack's sandboxes of these rollouts, or of any group's set-up."""
    backend = DockerBackend(side.settings)
    try:
        return [
            h.sandbox_id
            for h in backend.list_owned()
            if h.rollout_id in rollout_ids or h.rollout_id.startswith("setup-")
        ]
    finally:
        backend.client.close()


async def _start(
    client: httpx.AsyncClient, item: dict[str, Any], environment: str
) -> httpx.Response:
    return await client.post("/v1/rollouts", json={"environment": environment, "item": item})


async def _shell(client: httpx.AsyncClient, rollout_id: str, command: str) -> str:
    response = await client.post(
        f"/v1/rollouts/{rollout_id}/tools/shell", json={"arguments": {"command": command}}
    )
    assert response.status_code == 200, response.text
    output: str = response.json()["output"]
    return output


async def _group(side: Stack) -> set[str]:
    codebase = side.codebase
    first = {"codebase": codebase, "task": f"t-{uuid.uuid4().hex[:6]}"}
    second = {"codebase": codebase, "task": f"t-{uuid.uuid4().hex[:6]}"}
    async with side.async_client() as client:
        started = await asyncio.gather(
            *(_start(client, first, GROUPED) for _ in range(4)),
            *(_start(client, second, GROUPED) for _ in range(2)),
        )
        assert all(r.status_code == 201 for r in started), [r.text for r in started]
        ids = [r.json()["rollout_id"] for r in started]
        hosts = {r.json()["host"] for r in started}
        try:
            looks = await asyncio.gather(*(_shell(client, i, LOOK) for i in ids))
            setup_ids = [look.split()[0] for look in looks]
            # One set-up per group: the first item's four share one, the second's two another.
            assert len(set(setup_ids[:4])) == 1 and len(set(setup_ids[4:])) == 1, setup_ids
            assert setup_ids[0] != setup_ids[4]
            for look in looks:
                assert "set\nwarm\n" in look and "README.md" not in look, look
                assert "no process" in look, look  # files are kept, processes are not
            # From here on, each is its own.
            await _shell(client, ids[0], "echo mine > mine && echo mine > /tmp/setup")
            for other in ids[1:4]:
                assert await _shell(client, other, "ls; cat /tmp/setup") == (
                    await _shell(client, ids[1], "ls; cat /tmp/setup")
                )
                assert "mine" not in await _shell(client, other, "ls; cat /tmp/setup")
            # A later rollout of the group (a retry, a late sample) finds its set-up done.
            late = await _start(client, first, GROUPED)
            assert late.status_code == 201, late.text
            ids.append(late.json()["rollout_id"])
            assert (await _shell(client, ids[-1], LOOK)).split()[0] == setup_ids[0]
            # The set-ups were rollouts of source setup, closed once snapshotted.
            setups = _set_up_rollouts(side)
            views = [(await client.get(f"/v1/rollouts/{i}")).json() for i in setups]
            assert len([v for v in views if v["state"] == "closed"]) >= 2, views
        finally:
            for rollout_id in ids:
                await client.delete(f"/v1/rollouts/{rollout_id}")
    assert len(hosts) == 1  # a snapshot's sandboxes are made on the host that keeps it
    return set(ids)


def test_a_group_is_set_up_once_and_its_rollouts_start_from_it(side: Stack) -> None:
    ids = asyncio.run(_group(side))
    wait_for(lambda: not _sandboxes(side, ids), timeout_s=60, what="the test's sandboxes gone")


def test_agent_rft_rollouts_of_one_item_share_its_set_up(side: Stack) -> None:
    item: dict[str, Any] = {"codebase": side.codebase, "gold_files": ["README.md"]}
    item["task"] = f"rft-{uuid.uuid4().hex[:6]}"
    item["environment"] = GROUPED
    outputs = []
    traces = {f"tr-{uuid.uuid4().hex[:8]}" for _ in range(2)}
    with side.client() as client:
        for trace in traces:
            body = {
                "type": "function_call",
                "call_id": "call_1",
                "name": "shell",
                "arguments": {"command": "cat .setup-id /tmp/setup"},
                "trace_id": trace,
                "item": item,
            }
            response = client.post("/agent-rft/tools", json=body)
            assert response.status_code == 200, response.text
            outputs.append(response.json()["output"])
            graded = client.post(
                "/agent-rft/grade", json={"trace_id": trace, "item": item, "sample": {}}
            )
            assert graded.status_code == 200, graded.text
    assert outputs[0] == outputs[1] and outputs[0].endswith("set"), outputs
    wait_for(lambda: not _sandboxes(side, traces), timeout_s=60, what="the test's sandboxes gone")


def test_a_failing_set_up_is_a_422_naming_why_and_leaves_nothing(side: Stack) -> None:
    item = {"codebase": side.codebase, "task": f"b-{uuid.uuid4().hex[:6]}"}
    rollout_id = f"ro_{uuid.uuid4().hex}"
    with side.client() as client:
        response = client.post(
            "/v1/rollouts", json={"environment": GROUPED_BROKEN, "item": item, "id": rollout_id}
        )
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "setup_failed"
        assert "exit status 3" in error["message"] and "broken" in error["message"]
        assert client.get(f"/v1/rollouts/{rollout_id}").status_code == 404
        # Its group's rollouts hear the same at once: the set-up is not run again for each.
        again = client.post("/v1/rollouts", json={"environment": GROUPED_BROKEN, "item": item})
        assert again.status_code == 422 and again.json()["error"]["code"] == "setup_failed"
        slow = client.post("/v1/rollouts", json={"environment": GROUPED_SLOW, "item": item})
        assert slow.status_code == 422, slow.text
        assert "timed out" in slow.json()["error"]["message"]
    wait_for(lambda: not _sandboxes(side, set()), timeout_s=60, what="the set-up's sandbox gone")
