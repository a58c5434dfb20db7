"""Warm pools that size themselves (the product's default, which the rest of the suite turns
off): an environment's declared ``expected_concurrency`` is ready before any rollout
comes; a pool no one configured grows to the peak of its live rollouts, serves the next
rollout warm, and shrinks once that demand has passed its window. Real stack: API,
worker, reaper (it records demand every second), Redis, sandboxes."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from orchestrator.state.keys import Keys
from orchestrator.state.pool_sizing import parse_demand, pool_name
from tests import repo_history
from tests.e2e.conftest import side_stack
from tests.e2e.helpers import cli, wait_for
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")

WINDOW_S = 10
PEAK = 3


@pytest.fixture(scope="module")
def auto_stack(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("autosize")
    common = {
        "codebase": stack.codebase,
        "tools": ["shell", "read_file"],
        "grader": {"name": "file_f1"},
        "idle_timeout_s": 300,
    }
    environments = root / "environments.yaml"
    environments.write_text(
        yaml.safe_dump(
            {
                "environments": [
                    {"name": "demand", **common},
                    {"name": "expected", "expected_concurrency": 2, **common},
                    {"name": "fixed", "pool_autosize": False, **common},
                    {"name": "rows", **{k: v for k, v in common.items() if k != "codebase"}},
                ]
            }
        )
    )
    with side_stack(
        stack,
        root,
        name="as",
        environments_file=environments,
        pool_autosize=True,
        pool_demand_window_s=WINDOW_S,
        pool_headroom=0,
    ) as side:
        yield side


def _ready(stack: Stack, environment: str, codebase: str | None = None) -> int:
    client = redis.Redis.from_url(stack.settings.redis_url)
    try:
        name = pool_name(environment, codebase or stack.codebase)
        return int(client.llen(Keys.of(stack.settings.deployment).pool(name, "ready")))
    finally:
        client.close()


def _start(client: httpx.Client, stack: Stack, environment: str) -> dict[str, object]:
    item = {"codebase": stack.codebase, "prompt": "p", "gold_files": ["README.md"]}
    created = client.post("/v1/rollouts", json={"environment": environment, "item": item})
    assert created.status_code == 201, created.text
    view: dict[str, object] = created.json()
    return view


def _pool_hit(client: httpx.Client, rollout_id: object) -> bool:
    view = client.get(f"/v1/rollouts/{rollout_id}").json()
    return bool(view.get("pool_hit", (view.get("timings") or {}).get("pool_hit")))


def test_expected_concurrency_is_ready_before_any_rollout(auto_stack: Stack) -> None:
    wait_for(lambda: _ready(auto_stack, "expected") == 2, timeout_s=60, what="2 ready")
    assert _ready(auto_stack, "demand") == 0, "no demand seen, none declared: no pool"
    assert _ready(auto_stack, "fixed") == 0


def test_a_pool_follows_its_peak_then_shrinks_when_demand_falls(auto_stack: Stack) -> None:
    with auto_stack.client() as client:
        first = [_start(client, auto_stack, "demand") for _ in range(PEAK)]
        # (The pool may already serve the later ones: the reaper passes every second.)
        assert not _pool_hit(client, first[0]["rollout_id"]), "no demand seen yet: no pool"
        # The reaper saw 3 live: the pool grows to 3 while they run.
        wait_for(lambda: _ready(auto_stack, "demand") == PEAK, timeout_s=60, what="3 ready")
        for rollout in first:
            assert client.delete(f"/v1/rollouts/{rollout['rollout_id']}").status_code == 200
        # The next step's rollouts find it warm.
        again = [_start(client, auto_stack, "demand") for _ in range(PEAK)]
        assert all(_pool_hit(client, r["rollout_id"]) for r in again), again
        for rollout in again:
            client.delete(f"/v1/rollouts/{rollout['rollout_id']}")
        # Nothing live for longer than the window: the pool is trimmed away.
        wait_for(
            lambda: _ready(auto_stack, "demand") == 0,
            timeout_s=WINDOW_S + 30,
            what="the pool trimmed once its demand passed",
        )
    assert _ready(auto_stack, "expected") == 2, "a declared concurrency stays"


def _demand(stack: Stack, environment: str) -> int:
    client = redis.Redis.from_url(stack.settings.redis_url)
    try:
        raw = client.hgetall(Keys.of(stack.settings.deployment).pool_demand)
    finally:
        client.close()
    seen = parse_demand(raw).get(pool_name(environment, stack.codebase))
    return seen.peak if seen else 0


def test_a_pool_that_does_not_autosize_stays_off(auto_stack: Stack) -> None:
    with auto_stack.client() as client:
        held = [_start(client, auto_stack, "fixed") for _ in range(2)]
        try:
            # The reaper saw the demand...
            wait_for(lambda: _demand(auto_stack, "fixed") == 2, timeout_s=30, what="demand")
            # ...and for five of its passes (one a second) no pool sandbox is made for it.
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                assert _ready(auto_stack, "fixed") == 0
                time.sleep(0.5)
        finally:
            for rollout in held:
                client.delete(f"/v1/rollouts/{rollout['rollout_id']}")


def test_a_commit_s_pool_follows_its_peak_as_a_codebase_s_does(
    auto_stack: Stack, tmp_path: Path
) -> None:
    """Rows at a repository's commit (docs/datasets.md) get a pool of that commit's
    sandboxes by demand too: the next step's rollouts of the commit start warm, each on
    its commit."""
    history = repo_history.build(tmp_path)
    repo = f"pooled-{uuid.uuid4().hex[:6]}"
    cli(auto_stack, "repo", "add", repo, str(history.repo))
    commit = history.commits[1]
    row = {"repo": repo, "commit": commit, "prompt": "p", "gold_files": ["README.md"]}
    at_commit = f"{repo}@{commit}"
    with auto_stack.client() as client:

        def start() -> str:
            created = client.post("/v1/rollouts", json={"environment": "rows", "item": row})
            assert created.status_code == 201, created.text
            rollout_id: str = created.json()["rollout_id"]
            return rollout_id

        first = [start() for _ in range(PEAK)]
        wait_for(
            lambda: _ready(auto_stack, "rows", at_commit) == PEAK, timeout_s=60, what="3 ready"
        )
        for rollout_id in first:
            assert client.delete(f"/v1/rollouts/{rollout_id}").status_code == 200
        again = [start() for _ in range(PEAK)]
        try:
            assert all(_pool_hit(client, r) for r in again), again
            for rollout_id in again:
                ran = client.post(
                    f"/v1/rollouts/{rollout_id}/tools/shell",
                    json={"arguments": {"command": "git rev-parse HEAD; cat src/app.py"}},
                )
                assert ran.json()["output"] == f"{commit}\nprint('v2')", ran.json()
        finally:
            for rollout_id in again:
                client.delete(f"/v1/rollouts/{rollout_id}")
