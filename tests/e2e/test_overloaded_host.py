"""No false infrastructure failures on an overloaded host: with every core saturated by a
load generator, a batch of rollouts runs, hits its own limits (a command past its timeout,
after which the worker probes the sandbox) and grades with a grader that probes the sandbox
first: not one rollout is discarded.

Marked ``solo``: `make test` runs it after the rest of the suite, alone, so the load it
makes slows nothing else down.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from orchestrator.tls import tls
from tests.e2e.conftest import side_stack
from tests.e2e.helpers import function_call, new_trace
from tests.stacks import TOKEN, Stack

pytestmark = pytest.mark.solo

ROLLOUTS = 24
# The 1-minute load average lags: let it climb before the batch starts.
WARM_UP_S = 15
HOGS_PER_CORE = 8
GOLD = ["src/requests/api.py"]


@pytest.fixture(scope="module")
def loaded_stack(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("overload-stack")
    env_file = root / "environments.yaml"
    env_file.write_text(
        yaml.safe_dump(
            {
                "environments": [
                    {
                        "name": "overloaded",
                        "tools": ["shell", "read_file"],
                        # A small share of a core: the sandbox is starved too.
                        "limits": {"cpus": 0.25, "memory_mb": 256},
                        "grader": {"name": "tests.e2e.graders:LiveSandboxF1"},
                    }
                ]
            }
        )
    )
    with side_stack(stack, root, name="ol", environments_file=env_file) as started:
        yield started


@pytest.fixture()
def saturated_host() -> Iterator[list[float]]:
    """Busy loops at normal priority, HOGS_PER_CORE per core, for the test's length;
    yields the load averages seen (appended by the test)."""
    cores = os.cpu_count() or 1
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(HOGS_PER_CORE * cores)
    ]
    seen: list[float] = []
    time.sleep(WARM_UP_S)
    try:
        yield seen
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


async def _rollout(client: httpx.AsyncClient, item: dict[str, Any]) -> dict[str, Any]:
    trace = new_trace()
    statuses: list[int] = []
    outputs: list[str] = []
    for arguments in (
        {"command": "rg -l 'def request' src"},
        # Past its timeout: the worker probes the sandbox after the limit.
        {"command": "sleep 5", "timeout_s": 1},
        {"command": "wc -l < src/requests/api.py"},
    ):
        reply = await client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", arguments)
        )
        statuses.append(reply.status_code)
        outputs.append(reply.json().get("output", "") if reply.status_code == 200 else reply.text)
    graded = await client.post(
        "/agent-rft/grade",
        json={"sample": {"output_text": GOLD[0]}, "item": item, "trace_id": trace},
    )
    statuses.append(graded.status_code)
    record = (await client.get(f"/v1/rollouts/{trace}")).json()
    await client.delete(f"/v1/rollouts/{trace}")
    return {
        "trace": trace,
        "statuses": statuses,
        "outputs": outputs,
        "score": graded.json().get("score") if graded.status_code == 200 else None,
        "state": record.get("state"),
        "failure": record.get("infra_failure"),
    }


def test_an_overloaded_host_discards_nothing(
    loaded_stack: Stack, saturated_host: list[float]
) -> None:
    item = {"environment": "overloaded", "codebase": loaded_stack.codebase, "gold_files": GOLD}

    async def batch() -> list[dict[str, Any]]:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        base = loaded_stack.base_url
        async with httpx.AsyncClient(
            base_url=base, headers=headers, timeout=600, verify=tls()
        ) as client:
            sampler = asyncio.create_task(_sample_load(saturated_host))
            try:
                return await asyncio.gather(*(_rollout(client, item) for _ in range(ROLLOUTS)))
            finally:
                sampler.cancel()

    results = asyncio.run(batch())
    peak = max(saturated_host, default=os.getloadavg()[0])
    print(
        f"overloaded host: {ROLLOUTS} rollouts, peak 1-minute load average {peak:.1f} "
        f"on {os.cpu_count()} cores"
    )
    discarded = [r for r in results if any(s != 200 for s in r["statuses"]) or r["failure"]]
    assert not discarded, discarded
    assert all(r["score"] == 1.0 for r in results), results
    assert all("timed out" in r["outputs"][1] for r in results), results
    assert peak > 2 * (os.cpu_count() or 1), f"the host was not overloaded: {peak}"


async def _sample_load(seen: list[float]) -> None:
    while True:
        seen.append(os.getloadavg()[0])
        await asyncio.sleep(1)
