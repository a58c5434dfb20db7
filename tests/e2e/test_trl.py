"""TRL's real ``GRPOTrainer`` (pinned in the ``trainers`` extra) trains through the
orchestrator: ``examples/trl_grpo.py`` as a user runs it, and tests/trainers/trl_checks.py
for what the example does not show (the tools TRL makes of the environment class, and a
sandbox killed mid-rollout during training).

The policy is a tiny random Qwen2 with a tokenizer trained here (examples/tiny_model.py),
steered towards a tool call and the gold answers, so that TRL's own parser finds real tool
calls and some rollouts score above 0. Everything is read back from the orchestrator too:
the rollouts, their trajectories, their scores, and that no sandbox is left.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.e2e.helpers import sandboxes_of
from tests.e2e.trainers import run_in_trainers
from tests.stacks import Stack

pytestmark = [pytest.mark.xdist_group("trainers"), pytest.mark.slow]


def _stack_args(stack: Stack) -> list[str]:
    return ["--base-url", stack.base_url, "--token", stack.env["ORCH_API_TOKENS"]]


@pytest.fixture(scope="module")
def example_run(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    report = tmp_path_factory.mktemp("trl") / "example.json"
    return run_in_trainers(
        stack,
        [
            *("-m", "examples.trl_grpo", *_stack_args(stack)),
            *("--codebase", stack.codebase, "--steps", "2", "--report", str(report)),
        ],
        report,
    )


@pytest.fixture(scope="module")
def checks_run(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    report = tmp_path_factory.mktemp("trl") / "checks.json"
    return run_in_trainers(
        stack,
        [
            *("-m", "tests.trainers.trl_checks", str(report), *_stack_args(stack)),
            *("--codebase", stack.codebase),
        ],
        report,
    )


def _rollout(stack: Stack, rollout_id: str) -> dict[str, Any]:
    with stack.client() as client:
        response = client.get(f"/v1/rollouts/{rollout_id}")
        response.raise_for_status()
        record: dict[str, Any] = response.json()
        return record


def _trajectory(stack: Stack, rollout_id: str) -> list[dict[str, Any]]:
    with stack.client() as client:
        response = client.get(f"/v1/rollouts/{rollout_id}/trajectory")
        response.raise_for_status()
        steps: list[dict[str, Any]] = response.json()["steps"]
        return steps


def test_grpo_trains_two_steps_with_tool_calls_in_sandboxes(
    stack: Stack, example_run: dict[str, Any]
) -> None:
    assert example_run["global_step"] == 2
    assert len(example_run["steps"]) == 2, example_run["steps"]
    samples = example_run["samples"]
    # 2 steps × 4 samples (2 prompts × 2 generations): one rollout each, all distinct.
    assert len(samples) == 8
    assert len({s["rollout_id"] for s in samples}) == 8
    calling = [s for s in samples if s["tool_calls"] > 0]
    assert calling, "the steered policy made no tool call TRL could parse"
    for sample in samples:
        record = _rollout(stack, sample["rollout_id"])
        assert record["state"] in ("graded", "closed"), record
        steps = _trajectory(stack, sample["rollout_id"])
        calls = [s for s in steps if s.get("tool")]
        assert len(calls) == sample["tool_calls"], (sample, steps)
        for call in calls:
            # `ls src/requests` ran in the rollout's sandbox, on the requests codebase.
            assert call["tool"] == "shell"
            assert "sessions.py" in call["output"], call
        assert sample["infra_failed"] is False
        assert sample["reward"] == record["score"], (sample, record)


def test_trl_logs_the_orchestrators_scores(example_run: dict[str, Any]) -> None:
    for step in example_run["steps"]:
        rewards = [s["reward"] for s in example_run["samples"] if s["step"] == step["step"] - 1]
        assert len(rewards) == 4
        assert step["reward"] == pytest.approx(sum(rewards) / len(rewards)), step
    assert any(s["reward"] > 0 for s in example_run["samples"]), "no sample scored"


def test_no_sandbox_is_left_after_training(
    stack: Stack, example_run: dict[str, Any], checks_run: dict[str, Any]
) -> None:
    for run in (example_run, checks_run["sabotage"]):
        for sample in run["samples"]:
            assert sandboxes_of(stack.settings, sample["rollout_id"]) == [], sample
    assert example_run["_left"] == [] and checks_run["_left"] == [], "a run left a sandbox"


def test_trl_lists_the_environments_tools(checks_run: dict[str, Any]) -> None:
    tools = checks_run["surface"]["tools"]
    assert tools, "TRL listed no environment tools"
    for listed in tools.values():
        assert sorted(listed) == ["read_file", "shell"]


def test_an_undocumented_public_method_fails_training_at_its_start(
    stack: Stack, checks_run: dict[str, Any]
) -> None:
    """TRL makes every public method of the class a tool; one without a docstring stops
    training (the adapter keeps everything but ``reset`` and its tools private)."""
    failure = checks_run["surface"]["undocumented"]
    assert failure["raised"] is not None, failure
    assert "describe" in failure["message"] or "docstring" in failure["message"], failure
    for rollout_id in checks_run["surface"]["undocumented_rollouts"]:
        if rollout_id is not None:
            assert _rollout(stack, rollout_id)["state"] == "closed"


def test_a_sandbox_killed_mid_rollout_is_dropped_not_scored(
    stack: Stack, checks_run: dict[str, Any]
) -> None:
    run = checks_run["sabotage"]
    killed = run["killed"]
    assert killed is not None, "the sabotage never fired"
    (sample,) = [s for s in run["samples"] if s["rollout_id"] == killed]
    assert sample["infra_failed"] is True
    assert sample["reward"] is None
    record = _rollout(stack, killed)
    assert record.get("score") is None, record
    assert record["outcome"] == "infra_error", record
    # TRL 1.16: the sample is unscorable (NaN), its advantage 0, out of the logged mean.
    step = sample["step"]
    batch = [s for s in run["samples"] if s["step"] == step]
    index = batch.index(sample)
    assert run["advantages"][step][index] == 0.0
    others = [s["reward"] for s in batch if s["reward"] is not None]
    (logged,) = [e for e in run["steps"] if e["step"] == step + 1]
    assert not math.isnan(logged["reward"])
    assert logged["reward"] == pytest.approx(sum(others) / len(others))
    assert any("returned None" in w for w in run["warnings"]), run["warnings"]
    # The rest of the run trained on: two steps, every other sample scored.
    assert run["global_step"] == 2
    assert all(s["reward"] is not None for s in run["samples"] if s is not sample)
