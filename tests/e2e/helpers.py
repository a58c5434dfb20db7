"""Small helpers shared by the end-to-end tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from orchestrator.config import Settings
from orchestrator.grading import get_grader
from orchestrator.sandbox.docker.backend import DockerBackend
from tests.stacks import TOKEN, Stack

REPLY_KEYS = {"type", "call_id", "id", "output"}


def new_trace() -> str:
    """A fresh Agent RFT trace id, as the trainer makes them."""
    return f"trace_{uuid.uuid4().hex}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:16]}"


def function_call(
    trace_id: str,
    item: dict[str, Any],
    name: str | None,
    arguments: Any,
    *,
    call_id: str | None = None,
    fc_id: str | None = None,
    as_string: bool = True,
) -> dict[str, Any]:
    """A Responses-API function call body as Agent RFT posts it."""
    body: dict[str, Any] = {
        "type": "function_call",
        "id": fc_id or f"fc_{uuid.uuid4().hex[:12]}",
        "call_id": call_id or new_call_id(),
        "arguments": json.dumps(arguments)
        if as_string and isinstance(arguments, dict)
        else arguments,
        "trace_id": trace_id,
        "item": item,
    }
    if name is not None:
        body["name"] = name
    return body


def sandboxes_of(settings: Settings, rollout_id: str) -> list[str]:
    """The ids of the deployment's live sandboxes that belong to ``rollout_id`` (by label)."""
    backend = DockerBackend(settings)
    try:
        return [h.sandbox_id for h in backend.list_owned() if h.rollout_id == rollout_id]
    finally:
        backend.client.close()


def owned_count(settings: Settings) -> int:
    backend = DockerBackend(settings)
    try:
        return len(backend.list_owned())
    finally:
        backend.client.close()


def file_f1(answer: str, item: dict[str, Any]) -> float:
    """What the file_f1 grader gives ``answer`` on ``item``, computed locally."""
    return get_grader("file_f1", {}).grade(answer, item, []).score


def error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    code: str = body["error"]["code"]
    return code


def assert_no_rollout(client: httpx.Client, settings: Settings, rollout_id: str) -> None:
    """Nothing was created for ``rollout_id``: no record, no sandbox."""
    response = client.get(f"/v1/rollouts/{rollout_id}")
    assert response.status_code == 404, response.text
    assert error_code(response) == "unknown_rollout"
    assert sandboxes_of(settings, rollout_id) == []


def wait_for(
    predicate: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.2, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")


def orchestrator(stack: Stack, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``orchestrator ARGS`` as a user runs it beside ``stack`` (its settings)."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        env={**stack.env, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def make_job(stack: Stack, tmp_path: Path, *extra: str) -> tuple[Path, Path]:
    """``rft-config`` for ``stack``'s URL and token on a one-row dataset of its codebase:
    the job body's file and the rows' file."""
    source = tmp_path / "rows.jsonl"
    source.write_text(
        json.dumps(
            {
                "codebase": stack.codebase,
                "request": "Make Session.request honour a default timeout.",
                "gold_files": ["src/requests/sessions.py"],
            }
        )
        + "\n"
    )
    rows, job = tmp_path / "rft.jsonl", tmp_path / "job.json"
    made = orchestrator(
        stack,
        "rft-config",
        "--base-url",
        stack.base_url,
        "--token-env",
        "ORCH_TEST_TOKEN",
        "--dataset",
        str(source),
        "--out",
        str(rows),
        *extra,
        ORCH_TEST_TOKEN=TOKEN,
    )
    assert made.returncode == 0, made.stderr
    job.write_text(made.stdout)
    return job, rows


def cli(stack: Stack, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``orchestrator ARGS`` with the stack's settings, on a wide terminal."""
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        env={**stack.env, "COLUMNS": "300", "TERM": "dumb"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done
