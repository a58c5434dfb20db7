"""Warm pools and admission control against a real stack (API, worker, beat, Redis,
Docker): a new rollout takes a ready sandbox, which is used once and replaced; past a
host's capacity new rollouts wait within a bound, then are refused with Retry-After (503
for Agent RFT, 429 for the rollout API); nothing is ever overcommitted or left behind."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import docker
import httpx
import pytest
import redis
import yaml

from orchestrator.state.keys import Keys
from orchestrator.tenants import digest
from tests.e2e.helpers import error_code, function_call, new_trace, wait_for
from tests.stacks import Stack, deployment, running

pytestmark = pytest.mark.xdist_group("e2e")

POOL = 3
CAPACITY = 5


def _environments(codebase: str) -> str:
    common = {
        "codebase": codebase,
        "tools": ["shell", "read_file"],
        "grader": {"name": "file_f1"},
        "idle_timeout_s": 300,
    }
    return yaml.safe_dump(
        {
            "environments": [
                {"name": "pooled", "pool_size": POOL, **common},
                {"name": "cold", **common},
            ]
        }
    )


SHARER = secrets.token_urlsafe(32)
"""The token of a tenant whose warm sandboxes quota is 1 (test_a_tenant_at_its_warm_share)."""


@pytest.fixture(scope="module")
def pool_stack(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("pool-stack")
    env_file = root / "environments.yaml"
    env_file.write_text(_environments(stack.codebase))
    tenants = {"sharer": {"tokens": [digest(SHARER)], "quotas": {"warm_sandboxes": 1}}}
    tenants_file = root / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump({"tenants": tenants}))
    pooled = deployment(
        stack.settings,
        "p",
        logs=root / "logs",
        codebase=stack.codebase,
        environments_file=env_file,
        default_environment="pooled",
        reaper_interval_s=1.0,
        host_max_sandboxes=CAPACITY,
        admission_wait_s=3.0,
        admission_retry_after_s=2.0,
        tenants_file=tenants_file,
    )
    with running(pooled) as started:
        yield started


def _ready(stack: Stack) -> int:
    client = redis.Redis.from_url(stack.settings.redis_url)
    try:
        key = f"{Keys.of(stack.settings.deployment).prefix}pool:pooled:{stack.codebase}:ready"
        return int(client.llen(key))
    finally:
        client.close()


def _containers(stack: Stack) -> list[dict[str, Any]]:
    client = docker.from_env()
    try:
        label = f"orchestrator.deployment={stack.settings.deployment}"
        return list(client.api.containers(filters={"label": label}))
    finally:
        client.close()


def _item(stack: Stack, environment: str) -> dict[str, Any]:
    return {"environment": environment, "codebase": stack.codebase, "gold_files": ["setup.py"]}


def _rollout(client: httpx.Client, stack: Stack, environment: str) -> httpx.Response:
    return client.post("/v1/rollouts", json={"item": _item(stack, environment)}, timeout=60)


def _delete_all(client: httpx.Client, ids: list[str]) -> None:
    for rollout_id in ids:
        client.delete(f"/v1/rollouts/{rollout_id}")


def test_a_new_rollout_takes_a_warm_sandbox_used_once_and_replaced(pool_stack: Stack) -> None:
    wait_for(lambda: _ready(pool_stack) == POOL, timeout_s=60, what="the pool to fill")
    trace = new_trace()
    item = _item(pool_stack, "pooled")
    with pool_stack.client() as client:
        first = client.post(
            "/agent-rft/tools",
            json=function_call(trace, item, "shell", {"command": "touch /workspace/mine; ls"}),
        )
        assert first.status_code == 200, first.text
        view = client.get(f"/v1/rollouts/{trace}").json()
        assert view["pool_hit"] is True, view
        used = view["sandbox_id"]
        wait_for(lambda: _ready(pool_stack) == POOL, timeout_s=30, what="the pool to refill")
        # The next rollout gets a fresh sandbox, not the one the first rollout wrote in.
        second = new_trace()
        seen = client.post(
            "/agent-rft/tools",
            json=function_call(second, item, "shell", {"command": "ls /workspace/mine"}),
        )
        assert seen.status_code == 200
        assert "No such file" in seen.json()["output"]
        other = client.get(f"/v1/rollouts/{second}").json()
        assert other["pool_hit"] is True
        assert other["sandbox_id"] != used
        _delete_all(client, [trace, second])
    ids = {c["Labels"]["orchestrator.sandbox"] for c in _containers(pool_stack)}
    assert used not in ids, "a pool sandbox is destroyed with its rollout, never reused"


def test_a_tenant_at_its_warm_share_gets_cold_sandboxes(pool_stack: Stack) -> None:
    """A tenant with a warm sandboxes quota of 1 takes one from the pool; its next rollout
    gets a cold sandbox though the pool has more (they are the others'); once its warm
    one is ended, it may take from the pool again."""
    wait_for(lambda: _ready(pool_stack) == POOL, timeout_s=60, what="the pool to fill")
    headers = {"Authorization": f"Bearer {SHARER}"}
    made: list[str] = []
    with pool_stack.client() as client:
        client.headers.update(headers)
        try:
            for _ in range(2):
                answer = _rollout(client, pool_stack, "pooled")
                assert answer.status_code == 201, answer.text
                made.append(answer.json()["rollout_id"])
            hits = [client.get(f"/v1/rollouts/{r}").json()["pool_hit"] for r in made]
            assert hits == [True, False], hits
            assert client.delete(f"/v1/rollouts/{made[0]}").status_code == 200
            wait_for(lambda: _ready(pool_stack) == POOL, timeout_s=30, what="the pool to refill")
            again = _rollout(client, pool_stack, "pooled")
            assert again.status_code == 201, again.text
            made.append(again.json()["rollout_id"])
            assert client.get(f"/v1/rollouts/{made[-1]}").json()["pool_hit"] is True
        finally:
            _delete_all(client, made)


def test_a_dead_pool_sandbox_is_never_handed_out(pool_stack: Stack) -> None:
    wait_for(lambda: _ready(pool_stack) == POOL, timeout_s=60, what="the pool to fill")
    client = redis.Redis.from_url(pool_stack.settings.redis_url)
    key = f"{Keys.of(pool_stack.settings.deployment).prefix}pool:pooled:{pool_stack.codebase}:ready"
    head = client.lindex(key, 0)
    client.close()
    assert head is not None
    victim = json.loads(head)
    docker_client = docker.from_env()
    docker_client.api.kill(victim["native_id"])
    docker_client.close()
    trace = new_trace()
    with pool_stack.client() as api:
        reply = api.post(
            "/agent-rft/tools",
            json=function_call(trace, _item(pool_stack, "pooled"), "shell", {"command": "true"}),
        )
        assert reply.status_code == 200, reply.text
        view = api.get(f"/v1/rollouts/{trace}").json()
        assert view["sandbox_id"] != victim["sandbox_id"]
        _delete_all(api, [trace])


def test_past_capacity_new_rollouts_wait_then_are_refused_with_retry_after(
    pool_stack: Stack,
) -> None:
    wait_for(lambda: _ready(pool_stack) == POOL, timeout_s=60, what="the pool to fill")
    created: list[str] = []
    with pool_stack.client() as client:
        try:
            # The pool holds POOL slots; cold rollouts take the rest.
            for _ in range(CAPACITY - POOL):
                response = _rollout(client, pool_stack, "cold")
                assert response.status_code == 201, response.text
                created.append(response.json()["rollout_id"])
            started = time.monotonic()
            refused = _rollout(client, pool_stack, "cold")
            waited = time.monotonic() - started
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] == "2"
            assert error_code(refused) == "at_capacity"
            assert 2.5 < waited < 15, f"waited {waited:.1f} s for a 3 s admission bound"
            trace = new_trace()
            body = function_call(trace, _item(pool_stack, "cold"), "shell", {"command": "true"})
            rft = client.post("/agent-rft/tools", json=body)
            assert rft.status_code == 503, rft.text
            assert rft.headers["Retry-After"] == "2"
            assert error_code(rft) == "at_capacity"
            # Refused: nothing recorded, so the trainer's retry starts afresh.
            assert client.get(f"/v1/rollouts/{trace}").status_code == 404
            assert len(_containers(pool_stack)) <= CAPACITY, "never overcommitted"

            # A slot freed while a new rollout waits: it gets it.
            results: list[httpx.Response] = []
            waiter = threading.Thread(
                target=lambda: results.append(_rollout(client, pool_stack, "cold"))
            )
            waiter.start()
            time.sleep(0.8)
            client.delete(f"/v1/rollouts/{created.pop()}")
            waiter.join(timeout=30)
            assert results and results[0].status_code == 201, results[0].text if results else None
            created.append(results[0].json()["rollout_id"])
            assert len(_containers(pool_stack)) <= CAPACITY
        finally:
            _delete_all(client, created)


def _ready_ids(stack: Stack) -> set[str]:
    client = redis.Redis.from_url(stack.settings.redis_url)
    try:
        key = f"{Keys.of(stack.settings.deployment).prefix}pool:pooled:{stack.codebase}:ready"
        return {json.loads(raw)["sandbox_id"] for raw in client.lrange(key, 0, -1)}
    finally:
        client.close()


def test_parallel_first_calls_take_one_warm_sandbox(pool_stack: Stack) -> None:
    wait_for(lambda: _ready(pool_stack) == POOL, timeout_s=60, what="the pool to fill")
    before = _ready_ids(pool_stack)
    trace = new_trace()
    item = _item(pool_stack, "pooled")

    async def first_calls() -> list[httpx.Response]:
        async with pool_stack.async_client() as client:
            bodies = [
                function_call(trace, item, "shell", {"command": f"echo {i}"}) for i in range(4)
            ]
            return list(
                await asyncio.gather(*(client.post("/agent-rft/tools", json=b) for b in bodies))
            )

    responses = asyncio.run(first_calls())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    with pool_stack.client() as client:
        mine = client.get(f"/v1/rollouts/{trace}").json()["sandbox_id"]
        # Every warm sandbox but the one this rollout took is still in the pool.
        assert before - _ready_ids(pool_stack) == {mine}
        _delete_all(client, [trace])
