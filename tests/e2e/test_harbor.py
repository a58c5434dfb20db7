"""Stock Harbor (0.26.0, its own E2B environment, oracle agent and verifier) runs real trials
on a deployment of its own, pointed at it only by E2B_API_URL, E2B_SANDBOX_URL and
E2B_API_KEY (docs/e2b.md, "Harbor").

Harbor needs Python >= 3.12 and its own dependencies, so it runs in an interpreter of its
own: ``ORCH_HARBOR_PYTHON``, else ``<repo>/.venv-harbor/bin/python`` (skipped, with the
command that builds it, when that is missing). The harness (tests/harnesses/harbor_trial.py)
reports what Harbor saw; this checks the orchestrator's side: each trial was a rollout of
source e2b on the harbor environment, its commands (the oracle's solution, the verifier's
test) are its trajectory, and no sandbox is left once Harbor is done.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.helpers import orchestrator, sandboxes_of
from tests.stacks import TOKEN, Stack

pytestmark = pytest.mark.xdist_group("harbor")

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "harnesses" / "harbor_trial.py"
DEFAULT_PYTHON = REPO / ".venv-harbor" / "bin" / "python"
BUILD = "make harbor-venv (it needs a Python >= 3.12: scripts/harbor-venv.sh)"


@pytest.fixture(scope="module")
def harbor_python() -> Path:
    """Looked up before any stack starts, so a missing interpreter skips at once."""
    configured = os.environ.get("ORCH_HARBOR_PYTHON")
    if configured:
        path = Path(configured)
        assert path.exists(), f"ORCH_HARBOR_PYTHON={configured} does not exist"
        return path
    if not DEFAULT_PYTHON.exists():
        pytest.skip(f"no Harbor interpreter at {DEFAULT_PYTHON}; build it with: {BUILD}")
    return DEFAULT_PYTHON


@pytest.fixture(scope="module")
def harbor_stack(harbor_python: Path, side: Stack) -> Stack:
    """The shared side deployment (tests/e2e/conftest.py), on the default environments;
    asked for after the interpreter, so a missing one skips before any stack starts."""
    return side


@pytest.fixture(scope="module")
def report(
    harbor_python: Path, harbor_stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Both trials, one Harbor process: the right answer, then a wrong one."""
    work = tmp_path_factory.mktemp("harbor-trials")
    out = work / "report.json"
    env = {
        # Harbor's environment, and nothing of the orchestrator's but the SDK's settings.
        **{k: v for k, v in os.environ.items() if not k.startswith(("ORCH_", "E2B_"))},
        "E2B_API_URL": harbor_stack.base_url,
        "E2B_SANDBOX_URL": harbor_stack.base_url,
        "E2B_API_KEY": TOKEN,
        "NO_PROXY": "127.0.0.1,localhost",
    }
    done = subprocess.run(
        [
            *(str(harbor_python), str(HARNESS), "--template", "harbor", "--trace"),
            *("--solution", "correct", "wrong", "--work", str(work), "--out", str(out)),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found: dict[str, Any] = json.loads(out.read_text())
    return found


def trial(report: dict[str, Any], solution: str) -> dict[str, Any]:
    matching: list[dict[str, Any]] = [t for t in report["trials"] if t["solution"] == solution]
    (found,) = matching
    assert found["exception"] is None, found["exception"]
    assert found["sandbox_id"], found
    return found


def test_the_oracle_passes(harbor_stack: Stack, report: dict[str, Any]) -> None:
    correct = trial(report, "correct")
    assert correct["rewards"] == {"reward": 1}
    # Harbor named root for its transfers: every one was served, as the sandbox user.
    calls = correct["calls"]
    assert {c["user"] for c in calls if c["method"] != "Sandbox.create"} >= {"root"}
    failed = [c for c in calls if "error" in c]
    # Only Harbor's probe for an image-env file a prebuilt template never has.
    assert [c["what"] for c in failed] == ["/var/lib/harbor/image-env"], failed
    record = rollout(harbor_stack, correct["sandbox_id"])
    assert record["summary"]["source"] == "e2b"
    assert record["summary"]["environment"] == "harbor"
    commands = [json.dumps(s["arguments"]) for s in record["trajectory"]]
    assert all(s["tool"] == "sandbox.command" for s in record["trajectory"])
    assert any("/solution/solve.sh" in c for c in commands), commands
    assert any("/tests/test.sh" in c for c in commands), commands


def test_a_wrong_answer_is_scored_zero_not_an_error(
    harbor_stack: Stack, report: dict[str, Any]
) -> None:
    wrong = trial(report, "wrong")
    assert wrong["rewards"] == {"reward": 0}
    stdout = Path(wrong["trial_dir"]) / "verifier" / "test-stdout.txt"
    assert stdout.read_text().strip() == "expected=7 got=6"
    assert rollout(harbor_stack, wrong["sandbox_id"])["summary"]["outcome"] == "ok"


def test_no_sandbox_is_left(harbor_stack: Stack, report: dict[str, Any]) -> None:
    for found in report["trials"]:
        assert not sandboxes_of(harbor_stack.settings, found["sandbox_id"])
        assert rollout(harbor_stack, found["sandbox_id"])["summary"]["state"] == "closed"


def rollout(stack: Stack, rollout_id: str) -> dict[str, Any]:
    done = orchestrator(stack, "rollouts", "show", rollout_id, "--json")
    assert done.returncode == 0, done.stderr
    record: dict[str, Any] = json.loads(done.stdout)
    return record
