"""Recycling on a real stack (API, worker, beat, Redis, sandboxes): a sandbox whose rollout
ended cleanly is reset, audited and returned to its pool; the next rollout takes the same
sandbox, says so (reuses, reset digest), and finds nothing the last one left. A rollout
that failed for an infrastructure reason, or whose sandbox hit a limit, never hands its
sandbox on. The rest of the suite runs with recycling off (tests/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import docker
import httpx
import pytest
import redis
import yaml

from orchestrator.state.keys import Keys
from orchestrator.state.pool_sizing import pool_name
from tests.e2e.conftest import side_stack
from tests.e2e.helpers import function_call, new_trace, orchestrator, wait_for
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")

PLANT = (
    "echo planted > /tmp/planted; echo 'echo hijacked' >> ~/.bashrc; "
    "echo planted > /workspace/planted; rm -f /workspace/README.md; "
    "setsid sleep 1000 > /dev/null 2>&1 < /dev/null & "
    "(trap '' TERM; exec sleep 1001) > /dev/null 2>&1 < /dev/null & echo planted"
)
LOOK = "ls -A /tmp ~ /workspace; ps -eo uid=,comm= | grep -v -e ps -e bash -e grep || true"

HANDED_OUT: set[str] = set()
"""The sandboxes this module's rollouts took: one not among them is new (when make
flake-hunt repeats a test, the pool's sandbox may be one recycled before)."""


@pytest.fixture(scope="module")
def recycling_stack(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("recycling")
    environments = root / "environments.yaml"
    environments.write_text(
        yaml.safe_dump(
            {
                "environments": [
                    {
                        "name": "reused",
                        "codebase": stack.codebase,
                        "tools": ["shell", "read_file"],
                        "grader": {"name": "file_f1"},
                        "pool_size": 1,
                        # A pool of exactly one: sized by demand, a reaper pass that saw one
                        # live rollout made it two (headroom), and a rollout then took the
                        # refill's sandbox, not the recycled one this module follows.
                        "pool_autosize": False,
                        # Never retired here (make flake-hunt repeats these tests on one
                        # sandbox): retiring is not what this module tests.
                        "max_reuses": 10_000,
                        "limits": {"memory_mb": 256},
                    }
                ]
            }
        )
    )
    with side_stack(
        stack, root, name="rc", environments_file=environments, sandbox_reuse=True
    ) as side:
        yield side


def _ready(stack: Stack) -> list[str]:
    client = redis.Redis.from_url(stack.settings.redis_url, decode_responses=True)
    try:
        key = Keys.of(stack.settings.deployment).pool(pool_name("reused", stack.codebase), "ready")
        return [json.loads(raw)["sandbox_id"] for raw in client.lrange(key, 0, -1)]
    finally:
        client.close()


def _start(client: httpx.Client, stack: Stack) -> dict[str, Any]:
    item = {"codebase": stack.codebase, "prompt": "p", "gold_files": ["README.md"]}
    created = client.post("/v1/rollouts", json={"environment": "reused", "item": item})
    assert created.status_code == 201, created.text
    rollout: dict[str, Any] = client.get(f"/v1/rollouts/{created.json()['rollout_id']}").json()
    return rollout


def _shell(client: httpx.Client, rollout: dict[str, Any], command: str) -> dict[str, Any]:
    reply = client.post(
        f"/v1/rollouts/{rollout['rollout_id']}/tools/shell",
        json={"arguments": {"command": command}},
    )
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


@contextmanager
def _ended(client: httpx.Client) -> Iterator[Callable[[dict[str, Any]], dict[str, Any]]]:
    """Ends every rollout handed to the function it yields, however the test ends: one left
    open would hold the pool's only sandbox, and every test after it would wait for it."""
    rollouts: list[str] = []

    def started(rollout: dict[str, Any]) -> dict[str, Any]:
        rollouts.append(rollout["rollout_id"])
        HANDED_OUT.add(rollout["sandbox_id"])
        return rollout

    try:
        yield started
    finally:
        for rollout_id in rollouts:  # most have ended already: the answer does not matter
            client.delete(f"/v1/rollouts/{rollout_id}")


def _take_pooled(client: httpx.Client, stack: Stack, sandbox_id: str) -> dict[str, Any]:
    """A new rollout, once ``sandbox_id`` is the pool's only ready sandbox."""
    wait_for(lambda: _ready(stack) == [sandbox_id], timeout_s=60, what=f"{sandbox_id} pooled")
    rollout = _start(client, stack)
    assert rollout["pool_hit"] and rollout["sandbox_id"] == sandbox_id, rollout
    return rollout


def _wait_destroyed(sandbox_id: str, what: str) -> None:
    """Until no container of ``sandbox_id`` is left (by its label: a recycled sandbox keeps
    its first rollout's)."""
    client = docker.from_env()
    try:
        label = f"orchestrator.sandbox={sandbox_id}"
        # sparse: the listing alone (a full one inspects each container after listing it,
        # and one removed in between raised NotFound).
        wait_for(
            lambda: not client.containers.list(all=True, sparse=True, filters={"label": label}),
            timeout_s=60,
            what=what,
        )
    finally:
        client.close()


def _listed(stack: Stack, sandbox_id: str) -> dict[str, Any]:
    """``orchestrator sandbox ls --json``'s entry for ``sandbox_id``, as an operator sees it."""
    listed = orchestrator(stack, "sandbox", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    listing = json.loads(listed.stdout)
    assert listing["redis_error"] is None, listing
    (entry,) = [s for s in listing["sandboxes"] if s["sandbox_id"] == sandbox_id]
    assert entry["owner_known"], entry
    return dict(entry)


def test_a_clean_rollouts_sandbox_serves_the_next_one_with_nothing_left(
    recycling_stack: Stack,
) -> None:
    with recycling_stack.client() as client, _ended(client) as started:
        wait_for(lambda: len(_ready(recycling_stack)) == 1, timeout_s=60, what="a ready one")
        first = _start(client, recycling_stack)
        sandbox = first["sandbox_id"]
        assert first["pool_hit"], first
        if sandbox not in HANDED_OUT:
            assert first["sandbox_reuses"] == 0, first
        reuses = started(first)["sandbox_reuses"]
        # Made for the pool (its label says so, and always will); its owner is the rollout.
        listed = _listed(recycling_stack, sandbox)
        assert (listed["owner"], listed["first_rollout"]) == (first["rollout_id"], "pool")
        fresh_view = _shell(client, first, LOOK)["output"]
        assert "planted" in _shell(client, first, PLANT)["output"]
        assert client.delete(f"/v1/rollouts/{first['rollout_id']}").status_code == 200
        # While its rollout held it, no refill took its place: it comes back to its pool.
        wait_for(lambda: _ready(recycling_stack) == [sandbox], timeout_s=60, what="pooled")
        assert _listed(recycling_stack, sandbox)["owner"] == "pool"
        second = started(_take_pooled(client, recycling_stack, sandbox))
        assert second["sandbox_reuses"] == reuses + 1 and second["sandbox_reset_digest"], second
        # The listing follows the sandbox to its current rollout, not its first.
        listed = _listed(recycling_stack, sandbox)
        assert (listed["owner"], listed["first_rollout"]) == (second["rollout_id"], "pool")
        after = _shell(client, second, LOOK)["output"]
        assert after == fresh_view, (fresh_view, after)
        trajectory = client.get(f"/v1/rollouts/{second['rollout_id']}/trajectory").json()
        assert trajectory["sandbox_id"] == sandbox and trajectory["sandbox_reuses"] == reuses + 1


def test_a_grade_hands_the_sandbox_to_the_next_rollout_at_once(recycling_stack: Stack) -> None:
    """The default grace after grading is 0: the grade itself sends the sandbox for reset,
    and a rollout started the moment the grade returns takes that sandbox (waiting for its
    reset if it is still under way) instead of a cold one, as at a step boundary."""
    item = {
        "environment": "reused",
        "codebase": recycling_stack.codebase,
        "prompt": "p",
        "gold_files": ["README.md"],
    }
    with recycling_stack.client() as client:
        wait_for(lambda: len(_ready(recycling_stack)) == 1, timeout_s=60, what="a ready one")
        first, second = new_trace(), new_trace()
        plant = function_call(first, item, "shell", {"command": PLANT})
        try:
            assert client.post("/agent-rft/tools", json=plant).status_code == 200
            before = client.get(f"/v1/rollouts/{first}").json()
            HANDED_OUT.add(before["sandbox_id"])
            graded = client.post(
                "/agent-rft/grade",
                json={"sample": {"output_text": "README.md"}, "item": item, "trace_id": first},
            )
            assert graded.status_code == 200 and graded.json()["score"] == 1.0, graded.text
            look = client.post(
                "/agent-rft/tools", json=function_call(second, item, "shell", {"command": LOOK})
            )
            assert look.status_code == 200, look.text
            assert "planted" not in look.json()["output"]
            view = client.get(f"/v1/rollouts/{second}").json()
            assert view["sandbox_id"] == before["sandbox_id"] and view["pool_hit"], view
            assert view["sandbox_reuses"] == before["sandbox_reuses"] + 1, (before, view)
            # A retried grade of the first still gets its score, its sandbox gone on.
            again = client.post(
                "/agent-rft/grade",
                json={"sample": {"output_text": "x"}, "item": item, "trace_id": first},
            )
            assert again.status_code == 200 and again.json()["score"] == 1.0, again.text
        finally:
            for trace in (first, second):  # a rollout left open would hold the pool's one
                client.delete(f"/v1/rollouts/{trace}")


def test_a_sandbox_that_hit_its_memory_limit_is_destroyed_not_recycled(
    recycling_stack: Stack,
) -> None:
    with recycling_stack.client() as client, _ended(client) as started:
        wait_for(lambda: len(_ready(recycling_stack)) >= 1, timeout_s=60, what="a ready one")
        rollout = started(_start(client, recycling_stack))
        hog = _shell(client, rollout, "python3 -c 'b = b\"x\" * (1 << 30)'; echo exit=$?")
        assert "exit=137" in hog["output"] or hog.get("limits_hit"), hog
        sandbox = rollout["sandbox_id"]
        client.delete(f"/v1/rollouts/{rollout['rollout_id']}")
        _wait_destroyed(sandbox, "the sandbox destroyed")
        assert sandbox not in _ready(recycling_stack)
        assert recycling_stack.logs is not None
        said = (recycling_stack.logs / "worker.log").read_text()
        assert '"why": "it hit memory_limit"' in said, "refused for the limit it hit"


def test_a_failed_rollouts_sandbox_is_destroyed_not_recycled(recycling_stack: Stack) -> None:
    with recycling_stack.client() as client, _ended(client) as started:
        wait_for(lambda: len(_ready(recycling_stack)) >= 1, timeout_s=60, what="a ready one")
        rollout = started(_start(client, recycling_stack))
        sandbox = rollout["sandbox_id"]
        docker_client = docker.from_env()
        try:
            # The sandbox dies behind the orchestrator's back: an infrastructure failure.
            (container,) = docker_client.containers.list(
                filters={"label": f"orchestrator.sandbox={sandbox}"}
            )
            container.kill()
            reply = client.post(
                f"/v1/rollouts/{rollout['rollout_id']}/tools/shell",
                json={"arguments": {"command": "true"}},
            )
            assert reply.status_code == 503, reply.text
            client.delete(f"/v1/rollouts/{rollout['rollout_id']}")
        finally:
            docker_client.close()
        _wait_destroyed(sandbox, "the failed rollout's sandbox destroyed")
        assert sandbox not in _ready(recycling_stack)
