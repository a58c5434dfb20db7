"""Structured logs of the real stack (ORCH_LOG_FORMAT=json): every line of the API and
the worker is JSON, and every line about a rollout names its trace, sandbox and host."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.helpers import function_call, new_trace
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def _records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in _lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"{path.name}: a line that is not JSON: {line!r}") from None
        assert isinstance(record, dict), line
        records.append(record)
    return records


def test_lines_about_a_rollout_carry_its_ids_and_every_line_is_json(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    trace = new_trace()
    with stack.client() as client:
        for n in range(2):
            body = function_call(trace, planning_item, "shell", {"command": "ls"}, call_id=f"c{n}")
            assert client.post("/agent-rft/tools", json=body).status_code == 200
        graded = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": "README.md"}, "item": planning_item, "trace_id": trace},
        )
        assert graded.status_code == 200, graded.text
        view = client.get(f"/v1/rollouts/{trace}").json()
        assert client.delete(f"/v1/rollouts/{trace}").status_code == 200
    sandbox_id = view["sandbox_id"]
    assert sandbox_id

    assert stack.logs is not None
    about: dict[str, list[dict[str, Any]]] = {}
    for process in ("api", "worker"):
        records = _records(stack.logs / f"{process}.log")
        assert all("host" in r and "event" in r and "level" in r for r in records)
        about[process] = [r for r in records if trace in json.dumps(r)]

    assert {r["event"] for r in about["api"]} >= {
        "rollout.started",
        "rollout.graded",
        "rollout.closed",
    }
    assert "sandbox.destroyed" in {r["event"] for r in about["worker"]}
    for process, records in about.items():
        for record in records:
            assert record.get("trace_id") == trace, (process, record)
            assert record.get("rollout_id") == trace, (process, record)
            assert record.get("host") == stack.settings.host_id, (process, record)
            # Known from the moment the sandbox exists; only lines before it have none.
            assert "sandbox_id" in record, (process, record)
            assert record["sandbox_id"] in (None, sandbox_id), (process, record)
    after_start = [r for r in about["api"] if r["event"] != "rollout.started"]
    assert all(r["sandbox_id"] == sandbox_id for r in after_start)
    assert all(r["sandbox_id"] == sandbox_id for r in about["worker"])
