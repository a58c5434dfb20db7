"""verl 0.9.1's own agent loop, tool loader and reward loop on the orchestrator's tool and
reward function, against a real stack; asserted from the orchestrator's side (its
rollouts, their tool calls and scores, the sandboxes left), not only from verl's report.

The scripts run in the trainers' venv (tests/e2e/trainers.py): examples/verl_agent_loop.py
(the example, as a user runs it) and tests/trainers/verl_checks.py (the loader, the
explicit lifecycle, a sandbox killed mid-trajectory). Each runs once per module.
"""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.client import RolloutClient
from tests.e2e.helpers import file_f1, sandboxes_of
from tests.e2e.trainers import run_in_trainers
from tests.stacks import TOKEN, Stack

pytestmark = [pytest.mark.xdist_group("trainers")]

GOLD = '["src/requests/sessions.py", "src/requests/adapters.py"]'


def stack_args(stack: Stack) -> list[str]:
    return ["--base-url", stack.base_url, "--token", TOKEN, "--codebase", stack.codebase]


@pytest.fixture(scope="module")
def example(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    report = tmp_path_factory.mktemp("verl") / "example.json"
    args = ["-m", "examples.verl_agent_loop", *stack_args(stack), "--rows", "2"]
    return run_in_trainers(stack, [*args, "--report", str(report)], report)


@pytest.fixture(scope="module")
def checks(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    report = tmp_path_factory.mktemp("verl") / "checks.json"
    args = ["-m", "tests.trainers.verl_checks", str(report), *stack_args(stack)]
    return run_in_trainers(stack, args, report)


def views(stack: Stack, samples: list[dict[str, Any]]) -> dict[str, Any]:
    with RolloutClient(stack.base_url, TOKEN) as client:
        return {s["rollout_id"]: client.get(s["rollout_id"]) for s in samples if s["rollout_id"]}


def outputs(stack: Stack, rollout_id: str) -> list[str]:
    with RolloutClient(stack.base_url, TOKEN) as client:
        return [step.output for step in client.trajectory(rollout_id).steps]


def test_example_scores_every_trajectory_in_its_own_sandbox(
    stack: Stack, example: dict[str, Any]
) -> None:
    samples = example["samples"]
    assert len(samples) == 4, "2 rows x 2 trajectories"
    assert example["tools"] == ["shell", "read_file"]
    assert len({s["request_id"] for s in samples}) == 4
    # Every sample has its own rollout, tool calls or not (compute_score starts one then).
    assert all(s["rollout_id"] for s in samples)
    assert len({s["rollout_id"] for s in samples}) == 4
    calling = [s for s in samples if s["tool_calls"]]
    assert calling, "the steered policy calls a tool in some trajectory"
    served = views(stack, samples)
    for sample in samples:
        view = served[sample["rollout_id"]]
        assert not sample["infra_failed"]
        assert view.state == "closed"
        assert view.score == pytest.approx(sample["score"]), "verl's score is the orchestrator's"
        assert view.tool_calls == sample["tool_calls"]
        assert sandboxes_of(stack.settings, sample["rollout_id"]) == []
    # The policy's `ls src/requests` ran in the real codebase's sandbox.
    listed = [out for s in calling for out in outputs(stack, s["rollout_id"])]
    assert any("sessions.py" in out for out in listed)
    # verl's GRPO advantage over all of them (none dropped): zero-sum per 2-sample group.
    assert len(example["advantages"]) == 4
    assert sum(example["advantages"]) == pytest.approx(0.0, abs=1e-4)


def test_verl_loads_the_tool_from_the_yaml(checks: dict[str, Any]) -> None:
    tools = checks["loader"]["tools"]
    assert [t["name"] for t in tools] == ["shell", "read_file"]
    for tool in tools:
        assert tool["class"] == "orchestrator.adapters.verl.OrchestratorTool"
        assert tool["is_base_tool"], "a verl BaseTool subclass once verl is installed"
        assert tool["schema"]["function"]["parameters"]["required"]


def test_explicit_lifecycle(stack: Stack, checks: dict[str, Any]) -> None:
    done = checks["explicit"]
    assert done["rollout_before_first_call"] is None, "created lazily, at the first call"
    assert done["shared"], "both tools of one instance share its rollout"
    assert "sessions.py" in done["listing"]
    assert done["read"]
    expected = file_f1(
        GOLD, {"gold_files": ["src/requests/sessions.py", "src/requests/adapters.py"]}
    )
    assert done["score"] == done["score_again"] == pytest.approx(expected)
    assert done["open_after_first_release"] and not done["open_after_last_release"]
    with RolloutClient(stack.base_url, TOKEN) as client:
        view = client.get(done["rollout_id"])
    assert view.state == "closed" and view.score == pytest.approx(expected)
    assert sandboxes_of(stack.settings, done["rollout_id"]) == []


def test_killed_sandbox_is_flagged_dropped_and_never_scored(
    stack: Stack, checks: dict[str, Any]
) -> None:
    run = checks["sabotage"]
    killed = run["killed"]["rollout_id"]
    flagged = [s for s in run["samples"] if s["infra_failed"]]
    assert [s["rollout_id"] for s in flagged] == [killed]
    assert flagged[0]["request_id"] == run["killed"]["request_id"]
    assert flagged[0]["score"] == 0.0 and flagged[0]["infra_error"]
    with RolloutClient(stack.base_url, TOKEN) as client:
        view = client.get(killed)
    assert view.state == "infra_failed"
    assert view.score is None, "the orchestrator never scored it"
    # Dropped before verl's advantage; the rest scored by the orchestrator, as usual.
    assert (run["kept_count"], run["total"]) == (3, 4)
    assert flagged[0]["request_id"] not in run["kept"]
    assert len(run["advantages"]) == 3
    healthy = [s for s in run["samples"] if not s["infra_failed"]]
    for sample in healthy:
        assert views(stack, [sample])[sample["rollout_id"]].score == pytest.approx(sample["score"])
    # compute_score's default mode refuses to score it at all.
    assert run["raise_mode"]["raised"] == "InfraFailure"
    assert run["sessions_left"] == 0


def test_no_sandbox_left(stack: Stack, example: dict[str, Any], checks: dict[str, Any]) -> None:
    samples = [*example["samples"], *checks["sabotage"]["samples"]]
    ids = [s["rollout_id"] for s in samples] + [checks["explicit"]["rollout_id"]]
    assert all(sandboxes_of(stack.settings, r) == [] for r in ids)
    assert example["_left"] == [] and checks["_left"] == [], "a script left a sandbox"
