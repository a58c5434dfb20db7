"""Health, metrics and API docs of the real stack."""

from __future__ import annotations

import httpx
import pytest

from orchestrator.tls import tls
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")


def test_healthz(stack: Stack) -> None:
    response = httpx.get(f"{stack.base_url}/healthz", verify=tls())
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_sees_the_worker(stack: Stack) -> None:
    """Open, ``/readyz`` says only whether; the operator's ``/v1/readiness`` says why."""
    response = httpx.get(f"{stack.base_url}/readyz", verify=tls())
    assert response.status_code == 200
    assert response.json() == {"ready": True}
    with stack.client() as client:
        body = client.get("/v1/readiness").json()
    assert body["ready"] is True
    checks = body["checks"]
    assert checks["redis"] is True
    assert checks["docker"] is True
    assert checks["workers"] >= 1
    assert stack.settings.host_id in {h["host"] for h in checks["hosts"]}


def test_metrics_are_prometheus_text(stack: Stack) -> None:
    with stack.client() as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    lines = response.text.splitlines()
    assert any(line.startswith("# HELP ") for line in lines)
    assert any(line.startswith("# TYPE ") for line in lines)
    samples = [line for line in lines if line and not line.startswith("#")]
    assert samples
    for line in samples:
        name, _, value = line.rpartition(" ")
        assert name
        float(value)


def test_openapi_and_docs(stack: Stack) -> None:
    spec = httpx.get(f"{stack.base_url}/openapi.json", verify=tls())
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    for path in (
        "/agent-rft/tools",
        "/agent-rft/tools/{name}",
        "/agent-rft/grade",
        "/v1/rollouts",
        "/v1/rollouts/{rollout_id}",
        "/v1/rollouts/{rollout_id}/tools/{name}",
        "/v1/rollouts/{rollout_id}/grade",
        "/v1/rollouts/{rollout_id}/trajectory",
        "/healthz",
        "/readyz",
        "/v1/readiness",
        "/metrics",
    ):
        assert path in paths, path
    assert "503" in paths["/agent-rft/tools"]["post"]["responses"]
    docs = httpx.get(f"{stack.base_url}/docs", verify=tls())
    assert docs.status_code == 200
    assert "swagger" in docs.text.lower()


def _sample(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_move_when_calls_are_made(stack: Stack) -> None:
    from tests.e2e.helpers import function_call, new_trace

    item = {"codebase": stack.codebase, "gold_files": ["README.md"]}
    name = 'orchestrator_tool_calls_total{outcome="ok",tool="shell"}'
    with stack.client() as client:
        before = _sample(client.get("/metrics").text, name)
    trace = new_trace()
    with stack.client() as client:
        for n in range(3):
            body = function_call(trace, item, "shell", {"command": "true"}, call_id=f"m{n}")
            assert client.post("/agent-rft/tools", json=body).status_code == 200
        client.delete(f"/v1/rollouts/{trace}")
        text = client.get("/metrics").text
    assert _sample(text, name) == before + 3
    assert _sample(text, 'orchestrator_tool_call_seconds_count{phase="exec"}') >= 3
    assert _sample(text, "orchestrator_rollouts_started_total") >= 1
