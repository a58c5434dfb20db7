"""The metrics an alert uses move when their event happens, on the real stack: a tool
call, an infrastructure failure, a reap (on the worker's own endpoint), HTTP errors; the
state gauges read from Redis are sane; and several API processes add up."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest
import redis
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.local import free_port
from orchestrator.observability.api_process import multiproc_dir
from orchestrator.sandbox.backend import SandboxSpec
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.state.keys import Keys
from orchestrator.tls import tls
from tests.e2e.conftest import REAPED
from tests.e2e.helpers import function_call, new_trace, wait_for
from tests.stacks import TOKEN, Stack, another_api

pytestmark = pytest.mark.xdist_group("e2e")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metrics_text(url: str) -> str:
    """The API's /metrics, with the operator's token (docs/tenancy.md)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    response = httpx.get(f"{url}/metrics", timeout=30, verify=tls(), headers=headers)
    assert response.status_code == 200, response.text
    return response.text


def scrape(url: str) -> Samples:
    return parse(metrics_text(url))


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and wanted <= have)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def worker_url(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.settings.worker_metrics_port}"


def reaper_url(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.settings.reaper_metrics_port}"


# --- the API's counters ---------------------------------------------------------------------


def test_a_tool_call_and_its_rollouts_close_move_their_metrics(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    before = scrape(stack.base_url)
    trace = new_trace()
    with stack.client() as client:
        reply = client.post(
            "/agent-rft/tools",
            json=function_call(trace, planning_item, "shell", {"command": "true"}),
        )
        assert reply.status_code == 200, reply.text
        middle = scrape(stack.base_url)
        assert client.delete(f"/v1/rollouts/{trace}").status_code == 200
    after = scrape(stack.base_url)

    assert delta(before, middle, "orchestrator_tool_calls_total", tool="shell", outcome="ok") == 1
    for phase in ("queue", "exec", "total"):
        assert delta(before, middle, "orchestrator_tool_call_seconds_count", phase=phase) == 1
    assert delta(before, middle, "orchestrator_rollouts_started_total", source="agent_rft") == 1
    assert delta(before, middle, "orchestrator_sandbox_create_seconds_count", source="cold") == 1
    assert value(middle, "orchestrator_sandbox_create_seconds_sum", source="cold") > 0

    assert delta(middle, after, "orchestrator_rollouts_finished_total", outcome="ok") == 1
    assert delta(middle, after, "orchestrator_tool_calls_per_rollout_count") == 1
    assert delta(middle, after, "orchestrator_tool_calls_per_rollout_sum") == 1


def test_an_infra_failure_moves_infra_errors_and_the_rollouts_outcome(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    before = scrape(stack.base_url)
    with stack.client() as client:
        created = client.post("/v1/rollouts", json={"item": planning_item})
        assert created.status_code == 201, created.text
        rollout_id = created.json()["rollout_id"]
        try:
            backend = DockerBackend(stack.settings)
            try:
                (handle,) = [h for h in backend.list_owned() if h.rollout_id == rollout_id]
            finally:
                backend.client.close()
            docker_client = docker.from_env()
            try:
                docker_client.api.kill(handle.native_id)
            finally:
                docker_client.close()
            call = client.post(
                f"/v1/rollouts/{rollout_id}/tools/shell", json={"arguments": {"command": "true"}}
            )
            assert call.status_code == 503, call.text
            middle = scrape(stack.base_url)
        finally:
            assert client.delete(f"/v1/rollouts/{rollout_id}").status_code == 200
    after = scrape(stack.base_url)

    assert delta(before, middle, "orchestrator_infra_errors_total", cause="tool_call_failed") == 1
    assert (
        delta(before, middle, "orchestrator_tool_calls_total", tool="shell", outcome="infra_error")
        == 1
    )
    assert delta(middle, after, "orchestrator_rollouts_finished_total", outcome="infra_error") == 1
    assert delta(middle, after, "orchestrator_rollouts_finished_total", outcome="ok") == 0


def test_http_errors_are_counted_by_route_template(stack: Stack) -> None:
    ghost = f"ghost-{uuid.uuid4().hex}"
    before = scrape(stack.base_url)
    with stack.client() as client:
        assert client.get(f"/v1/rollouts/{ghost}").status_code == 404
        assert client.post(f"/v1/rollouts/{ghost}/tools/shell", json=[1]).status_code == 422
        assert client.get(f"/no-such-path/{ghost}").status_code == 404
    with httpx.Client(base_url=stack.base_url, verify=tls()) as anonymous:
        assert anonymous.get(f"/v1/rollouts/{ghost}").status_code == 401
    text = metrics_text(stack.base_url)
    after = parse(text)

    name = "orchestrator_http_requests_total"
    one = "/v1/rollouts/{rollout_id}"
    assert delta(before, after, name, route=one, method="GET", status="404") == 1
    assert delta(before, after, name, route="unrouted", method="GET", status="401") == 1
    tools = "/v1/rollouts/{rollout_id}/tools/{name}"
    assert delta(before, after, name, route=tools, method="POST", status="422") == 1
    assert delta(before, after, name, route="unmatched", method="GET", status="404") == 1
    assert delta(before, after, "orchestrator_http_request_seconds_count", route=one) == 1
    assert ghost not in text  # raw paths never become label values


# --- state gauges, read from Redis ----------------------------------------------------------


def test_state_gauges_follow_the_deployment(stack: Stack, planning_item: dict[str, Any]) -> None:
    host = stack.settings.host_id
    environment = "codebase-planning"
    before = scrape(stack.base_url)
    assert value(before, "orchestrator_redis_up") == 1
    assert value(before, "orchestrator_workers_up") == 1
    assert value(before, "orchestrator_host_schedulable", host=host) == 1
    assert value(before, "orchestrator_host_healthy", host=host) == 1
    assert value(before, "orchestrator_capacity_slots", state="total") == (
        stack.settings.host_max_sandboxes
    )
    queue = Keys.of(stack.settings.deployment).host_queue(stack.settings.host_id)
    assert ("orchestrator_queue_depth", frozenset({("queue", queue)})) in before
    assert value(before, "orchestrator_queue_depth") >= 0
    assert value(before, "orchestrator_admission_waiting") == 0

    with stack.client() as client:
        created = client.post("/v1/rollouts", json={"item": planning_item})
        assert created.status_code == 201, created.text
        rollout_id = created.json()["rollout_id"]
        try:
            during = scrape(stack.base_url)
        finally:
            assert client.delete(f"/v1/rollouts/{rollout_id}").status_code == 200
    after = scrape(stack.base_url)

    active = "orchestrator_sandboxes_active"
    assert delta(before, during, active, host=host, environment=environment) == 1
    assert delta(before, during, "orchestrator_rollouts_live") == 1
    assert delta(before, during, "orchestrator_capacity_slots", state="used") == 1
    assert delta(during, after, active, host=host, environment=environment) == -1
    assert delta(during, after, "orchestrator_rollouts_live") == -1


# --- the worker's and the reaper's own endpoints -------------------------------------------


def test_reaps_and_orphans_move_the_reapers_and_the_workers_counters(
    reaper_stack: Stack, base_image: str, planning_item: dict[str, Any]
) -> None:
    """The reaper (a process of its own) counts the idle rollout it ended on its endpoint;
    the worker, the orphan its host's sweep destroyed on its own."""
    before = scrape(worker_url(reaper_stack))
    reaper_before = scrape(reaper_url(reaper_stack))
    item = {**planning_item, "environment": REAPED, "codebase": reaper_stack.codebase}
    trace = new_trace()
    backend = DockerBackend(reaper_stack.settings)
    # A sandbox of this host's deployment that no rollout owns: the sweep's to find. Its
    # rollout has a record while the sandbox is made (as a real one does: the sweep must
    # not take a sandbox being created), and loses it afterwards (as when Redis lost it).
    owner = f"orphan-{uuid.uuid4().hex[:8]}"
    record = f"{Keys.of(reaper_stack.settings.deployment).prefix}rollout:{owner}"
    with redis.Redis.from_url(reaper_stack.settings.redis_url) as state:
        state.hset(record, mapping={"state": "creating"})
        try:
            orphan = backend.create(SandboxSpec(image=base_image, rollout_id=owner))
        finally:
            state.delete(record)
    try:
        with reaper_stack.client() as client:
            reply = client.post(
                "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "true"})
            )
            assert reply.status_code == 200, reply.text

            def reaped() -> bool:
                state = client.get(f"/v1/rollouts/{trace}").json()["state"]
                owned = {h.sandbox_id for h in backend.list_owned()}
                return state == "closed" and orphan.sandbox_id not in owned

            wait_for(reaped, timeout_s=30, what="the idle rollout and the orphan to be reaped")
        after = scrape(worker_url(reaper_stack))
        reaper_after = scrape(reaper_url(reaper_stack))
    finally:
        if orphan.sandbox_id in {h.sandbox_id for h in backend.list_owned()}:
            backend.destroy(orphan)
        backend.client.close()

    reaped_total = "orchestrator_sandboxes_reaped_total"
    assert delta(reaper_before, reaper_after, reaped_total, reason="idle") >= 1
    assert delta(before, after, reaped_total, reason="orphan") >= 1
    assert delta(before, after, "orchestrator_orphans_found_total") >= 1
    # Each endpoint has its own counters, never the API's state gauges.
    assert not any(name == "orchestrator_redis_up" for name, _ in after)
    assert not any(name == "orchestrator_redis_up" for name, _ in reaper_after)


# --- several API processes ------------------------------------------------------------------


@pytest.fixture()
def two_process_api(stack: Stack, tmp_path: Path) -> Iterator[Stack]:
    """A second API of the stack's deployment with two uvicorn worker processes."""
    settings = stack.settings.model_copy(update={"api_port": free_port(), "api_workers": 2})
    directory = multiproc_dir(settings)
    directory.mkdir(parents=True, exist_ok=True)
    # What a previous run left (unreadable, as it happens): the start must wipe it.
    (directory / "counter_1.db").write_bytes(b"not a metrics file")
    with another_api(stack, tmp_path, api_port=settings.api_port, api_workers=2) as api:
        yield api


def _healthz_by_pid(directory: Path) -> dict[int, float]:
    """Requests to /healthz each API process counted, from its own metric files."""
    counts = {}
    for path in directory.glob("counter_*.db"):
        pid = int(path.stem.split("_")[1])
        merge = MultiProcessCollector.merge
        merged = merge([str(path)], accumulate=False)  # type: ignore[no-untyped-call]
        counts[pid] = sum(
            s.value
            for metric in merged
            for s in metric.samples
            if s.name == "orchestrator_http_requests_total" and s.labels["route"] == "/healthz"
        )
    return counts


def test_counts_of_several_api_processes_add_up(two_process_api: Stack) -> None:
    url = two_process_api.base_url
    directory = multiproc_dir(two_process_api.settings)
    assert not (directory / "counter_1.db").exists()

    def hit(_: int) -> int:
        # A new connection each: the kernel hands each to either process.
        return httpx.get(f"{url}/healthz", timeout=30, verify=tls()).status_code

    # Until both processes answered some: readiness is one process's answer, and on a
    # loaded machine the other may still be starting (its imports are 1.5 s of CPU) after
    # a thousand requests (seen under make flake-hunt: all 1,000 to one process). Bounded
    # by time, not by a count of requests.
    made = 0
    deadline = time.monotonic() + 120
    with ThreadPoolExecutor(8) as pool:
        while time.monotonic() < deadline:
            assert set(pool.map(hit, range(20))) == {200}
            made += 20
            if sum(1 for n in _healthz_by_pid(directory).values() if n > 0) >= 2:
                break
    served = {pid: n for pid, n in _healthz_by_pid(directory).items() if n > 0}
    assert len(served) == 2, served  # both processes answered some
    name = "orchestrator_http_requests_total"
    labels = {"route": "/healthz", "method": "GET", "status": "200"}
    assert value(scrape(url), name, **labels) == made

    # A process killed outright: the parent replaces it, its counts stay.
    victim = next(iter(served))
    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: len(list(directory.glob("counter_*.db"))) >= 3,
        timeout_s=60,
        what="the killed API process to be replaced",
    )
    wait_for(lambda: _answers(url), timeout_s=60, what="the API to answer again")
    later = value(scrape(url), name, **labels)
    assert later >= made + 1  # every request counted so far, the killed process's included
    assert later == sum(_healthz_by_pid(directory).values())


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=5, verify=tls()).status_code == 200
    except httpx.HTTPError:
        return False
