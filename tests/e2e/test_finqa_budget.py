"""The `finqa-demo` environment end to end: custom tools (search, list, cat) over the
`finqa-corpus` codebase, a tool-call budget of 10, and the numeric_match grader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.environments.examples import finqa_example_dir
from orchestrator.grading import get_grader
from tests.e2e.helpers import function_call, new_trace, sandboxes_of
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")


def dataset_rows() -> list[dict[str, Any]]:
    path: Path = finqa_example_dir() / "dataset.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_budget_of_ten_calls_then_grade(stack: Stack, finqa_codebase: str) -> None:
    row = dataset_rows()[0]
    assert row["environment"] == "finqa-demo"
    trace = new_trace()
    outputs: list[str] = []
    with stack.client() as client:

        def tool(name: str, arguments: dict[str, Any]) -> str:
            response = client.post(
                f"/agent-rft/tools/{name}", json=function_call(trace, row, None, arguments)
            )
            assert response.status_code == 200, response.text
            output: str = response.json()["output"]
            outputs.append(output)
            return output

        listing = tool("list", {})
        assert "halvard_fy2023.txt" in listing.splitlines()
        assert tool("list", {"filter": "HALVARD"}).splitlines() == [
            "halvard_fy2023.txt",
            "halvard_q1_2024.txt",
        ]
        assert "halvard_fy2023.txt:" in tool("search", {"query": "total revenue"})
        report = tool("cat", {"name": "halvard_fy2023.txt"})
        assert "Halvard" in report
        # Agent mistakes that never reach the sandbox do not spend the budget.
        bad = client.post(
            "/agent-rft/tools/cat",
            json=function_call(trace, row, None, {"name": "../etc/passwd"}),
        ).json()["output"]
        assert "name" in bad
        for i in range(6):
            tool("search", {"query": f"revenue {i}"})
        assert len(outputs) == 10
        over = tool("search", {"query": "net income"})
        assert "budget of 10 calls" in over and "spent" in over
        again = tool("list", {})
        assert "budget" in again

        view = client.get(f"/v1/rollouts/{trace}").json()
        assert view["environment"] == "finqa-demo"
        assert view["codebase"] == finqa_codebase
        steps = client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"]
        assert len(steps) == 12
        assert {s["error_kind"] for s in steps[10:]} == {"budget_exhausted"}
        assert {s["outcome"] for s in steps[10:]} == {"agent_error"}
        assert all(s["exec_ms"] is None for s in steps[10:])  # never sent to a worker

        answer = f"Revenue grew from the 2022 figure; the answer is {row['answer']}%."
        graded = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": answer}, "item": row, "trace_id": trace},
        )
        assert graded.status_code == 200, graded.text
        expected = get_grader(
            "numeric_match", {"rel_tol": 0.001, "partial_rel_tol": 0.01, "partial_credit": 0.5}
        ).grade(answer, row, [])
        assert graded.json()["score"] == expected.score == 1.0
        near = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": "12.05"}, "item": row, "trace_id": trace},
        )
        assert near.json()["score"] == 1.0  # idempotent: the first grade stands
        client.delete(f"/v1/rollouts/{trace}")
        assert sandboxes_of(stack.settings, trace) == []


@pytest.mark.parametrize(("answer", "credit"), [("12.05", 0.5), ("3", 0.0)])
def test_numeric_partial_and_zero_credit(
    stack: Stack, finqa_codebase: str, answer: str, credit: float
) -> None:
    row = dataset_rows()[0]
    trace = new_trace()
    with stack.client() as client:
        graded = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": answer}, "item": row, "trace_id": trace},
        )
        assert graded.status_code == 200, graded.text
        assert graded.json()["score"] == credit


def test_row_for_another_codebase_is_rejected(stack: Stack, finqa_codebase: str) -> None:
    row = {**dataset_rows()[0], "codebase": stack.codebase}
    trace = new_trace()
    with stack.client() as client:
        response = client.post("/agent-rft/tools/list", json=function_call(trace, row, None, {}))
        assert response.status_code == 422
        assert finqa_codebase in response.json()["error"]["message"]
        assert client.get(f"/v1/rollouts/{trace}").status_code == 404
