"""``orchestrator rft-config`` then ``orchestrator preflight`` against the real stack, as a
user does before paying for a job: the job body and rows are written for the stack's URL,
and the preflight calls each tool once and grades once, as the platform would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import make_job, orchestrator
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")


def test_preflight_of_a_job_against_the_deployment_passes(stack: Stack, tmp_path: Path) -> None:
    job, rows = make_job(stack, tmp_path)
    ran = orchestrator(stack, "preflight", "--job", str(job), "--dataset", str(rows))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    for check in (
        "tool shell: a call answers a function_call_output",
        "tool read_file: a call answers a function_call_output",
        "tool shell: refused without the job's headers",
        "grader: a grade answers a numeric score",
        "grader: refused without the job's headers",
    ):
        assert check in ran.stdout, ran.stdout
    assert "FAILED" not in ran.stdout


def test_preflight_with_a_wrong_token_fails(stack: Stack, tmp_path: Path) -> None:
    job, rows = make_job(stack, tmp_path)
    body = json.loads(job.read_text())
    reinforcement = body["method"]["reinforcement"]
    for tool in reinforcement["tools"]:
        tool["headers"] = {"Authorization": "Bearer wrong"}
    job.write_text(json.dumps(body))
    ran = orchestrator(stack, "preflight", "--job", str(job), "--dataset", str(rows))
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "FAILED" in ran.stdout and "HTTP 401" in ran.stdout
