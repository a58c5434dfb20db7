"""The host's half of a test run in a sandbox (orchestrator/sandbox/testrun.py), without a
sandbox: a row's test patch applied to the pristine tree by the host's own ``patch`` (a real
git history's diff), the pristine configuration found, the runner's report read only under
its nonce; and the grader's rules (orchestrator/grading/sandbox_tests.py) against runs it
is handed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.grading import GradeContext, ItemError, SandboxTestsGrader, get_grader
from orchestrator.sandbox.testrun import (
    TestOutcome,
    TestPatchError,
    TestRun,
    TestRunResult,
    parse_report,
    patch_paths,
    patched_files,
    pristine_config,
)
from tests import swe_project


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> swe_project.Project:
    return swe_project.build(tmp_path_factory.mktemp("swe"))


@pytest.fixture()
def pristine(project: swe_project.Project, tmp_path: Path) -> Path:
    """The project's tree at its buggy commit, as an image's /workspace holds it."""
    tree = tmp_path / "workspace"
    swe_project._git(
        project.repo, "worktree", "add", "-q", "--detach", str(tree), project.base_commit
    )
    return tree


def test_a_real_test_patch_applies_to_the_pristine_tree(
    project: swe_project.Project, pristine: Path
) -> None:
    files, deleted = patched_files(pristine, project.test_patch)
    assert deleted == set()
    assert files == {"tests/test_calc.py": (swe_project.TESTS + swe_project.NEW_TESTS).encode()}
    assert pristine_config(pristine) == {
        "conftest.py": swe_project.CONFTEST.encode(),
        "pytest.ini": swe_project.PYTEST_INI.encode(),
    }


def test_a_patch_that_does_not_apply_or_leaves_the_tree_is_the_rows_fault(
    project: swe_project.Project, pristine: Path
) -> None:
    stale = project.test_patch.replace("def test_mul_positive", "def test_mul_elsewhere")
    with pytest.raises(TestPatchError, match="does not apply"):
        patched_files(pristine, stale)
    with pytest.raises(TestPatchError, match="changes no file"):
        patched_files(pristine, "just some text\n")
    escaping = "--- a/../etc/passwd\n+++ b/../etc/passwd\n@@ -1 +1 @@\n-a\n+b\n"
    with pytest.raises(TestPatchError, match="not a file of the repository"):
        patched_files(pristine, escaping)
    with pytest.raises(TestPatchError, match="prefix"):
        patch_paths("--- tests/x.py\n+++ tests/x.py\n")


def test_patch_paths_see_new_and_deleted_files() -> None:
    patch = (
        "diff --git a/tests/new.py b/tests/new.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/tests/new.py\n@@ -0,0 +1 @@\n+x = 1\n"
        "diff --git a/tests/old.py b/tests/old.py\ndeleted file mode 100644\n--- a/tests/old.py\n"
        "+++ /dev/null\n@@ -1 +0,0 @@\n-x = 1\n"
    )
    assert patch_paths(patch) == ({"tests/new.py", "tests/old.py"}, {"tests/old.py"})


def _line(nonce: str, **event: Any) -> str:
    return f"{nonce} {json.dumps(event)}"


def test_the_report_is_read_only_under_its_nonce() -> None:
    nonce = "n0"
    lines = [
        _line(nonce, kind="ready"),
        _line(nonce, kind="start"),
        _line(nonce, kind="test", nodeid="t::a", when="setup", outcome="passed"),
        _line(nonce, kind="test", nodeid="t::a", when="call", outcome="passed"),
        _line(nonce, kind="test", nodeid="t::b", when="call", outcome="passed"),
        _line(nonce, kind="test", nodeid="t::b", when="teardown", outcome="failed"),
        _line(nonce, kind="test", nodeid="t::c", when="setup", outcome="skipped"),
        # Forged by anyone without the nonce: ignored.
        _line("guess", kind="test", nodeid="t::d", when="call", outcome="passed"),
        "t::d PASSED",
        _line(nonce, kind="finish", exit=1),
    ]
    result = parse_report("\n".join(lines), nonce, ["t::a", "t::b", "t::c", "t::d"])
    assert result.ready and result.started and result.exit_code == 1
    assert result.outcomes == {
        "t::a": TestOutcome.PASSED,
        "t::b": TestOutcome.FAILED,
        "t::c": TestOutcome.SKIPPED,
        "t::d": TestOutcome.MISSING,
    }


class Handed:
    """A sandbox that hands the grader a run's result (what the worker would send back)."""

    def __init__(self, result: TestRunResult) -> None:
        self.result = result
        self.runs: list[TestRun] = []

    def run_tests(self, run: TestRun) -> TestRunResult:
        self.runs.append(run)
        return self.result


ROW = {
    "test_patch": "",
    "FAIL_TO_PASS": json.dumps(["t::f1", "t::f2"]),  # as SWE-bench stores it: JSON text
    "PASS_TO_PASS": ["t::p1", "t::p2"],
}


def _grade(result: TestRunResult, row: dict[str, Any] = ROW, **options: Any) -> Any:
    grader = get_grader("sandbox_tests", options)
    sandbox = Handed(result)
    context = GradeContext(answer="", item=row, trajectory=[], sample={}, sandbox=sandbox)
    return grader.evaluate(context), sandbox


def _ran(**outcomes: TestOutcome) -> TestRunResult:
    named = {name.replace("_", "::", 1): outcome for name, outcome in outcomes.items()}
    return TestRunResult(ready=True, started=True, exit_code=1, outcomes=named)


def test_the_score_is_the_fraction_that_passes_or_all_or_nothing() -> None:
    ran = _ran(
        t_f1=TestOutcome.PASSED,
        t_f2=TestOutcome.FAILED,
        t_p1=TestOutcome.PASSED,
        t_p2=TestOutcome.MISSING,
    )
    graded, sandbox = _grade(ran, timeout_s=42)
    assert graded.score == 0.5
    assert graded.details["fail_to_pass"] == {"t::f1": "passed", "t::f2": "failed"}
    assert sandbox.runs == [TestRun(tests=["t::f1", "t::f2", "t::p1", "t::p2"], timeout_s=42)]
    assert _grade(ran, score="resolved")[0].score == 0.0
    everything = _ran(**{k: TestOutcome.PASSED for k in ("t_f1", "t_f2", "t_p1", "t_p2")})
    assert _grade(everything, score="resolved")[0].score == 1.0


def test_what_the_agent_did_is_scored_and_what_failed_on_our_side_is_not() -> None:
    # The agent filled its workspace: a score, with the reason.
    full, _ = _grade(TestRunResult(no_space=True))
    assert full.score == 0.0 and "filled its workspace" in full.details["reason"]
    # Its code broke pytest's start (a pristine conftest importing its package): a score.
    broken = TestRunResult(ready=True, started=False, exit_code=4, stderr_tail="ImportError")
    graded, _ = _grade(broken)
    assert graded.score == 0.0 and graded.details["stderr_tail"] == "ImportError"
    # Hung past the budget: what did not pass failed.
    hung = TestRunResult(ready=True, started=True, timed_out=True, outcomes={"t::p1": "passed"})
    assert _grade(hung)[0].score == 0.25
    # The system's pytest never started, or the run failed on our side: no score.
    with pytest.raises(RuntimeError, match="did not start"):
        _grade(TestRunResult(ready=False, stderr_tail="No module named pytest"))
    with pytest.raises(RuntimeError, match="on our side"):
        _grade(TestRunResult(error="the runner's report was cut"))


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({}, "FAIL_TO_PASS"),
        ({"FAIL_TO_PASS": "[1, 2]"}, "FAIL_TO_PASS"),
        ({"FAIL_TO_PASS": ["t"], "PASS_TO_PASS": "{"}, "PASS_TO_PASS"),
        ({"FAIL_TO_PASS": ["t"], "test_patch": ["x"]}, "test_patch"),
    ],
)
def test_a_row_without_usable_tests_is_the_rows_fault(row: dict[str, Any], field: str) -> None:
    with pytest.raises(ItemError) as raised:
        _grade(_ran(), row)
    assert raised.value.field == field


def test_a_patch_that_does_not_apply_is_the_rows_fault() -> None:
    with pytest.raises(ItemError) as raised:
        _grade(TestRunResult(patch_error="it does not apply"))
    assert raised.value.field == "test_patch"


def test_it_needs_the_sandbox_and_says_for_how_long() -> None:
    grader = SandboxTestsGrader(timeout_s=100)
    assert grader.uses_sandbox() and grader.sandbox_time_s() == 160
    with pytest.raises(RuntimeError, match="needs the rollout's sandbox"):
        grader.grade("", ROW, [])
