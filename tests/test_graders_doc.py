"""docs/graders.md's examples run as written: each environment loads through the real
environments parser, and each row, graded with its sample by that environment's grader,
gets the score the page says; the custom grader's code works as shown."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import Settings
from orchestrator.environments.loader import parse_environments
from orchestrator.grading import GradeContext, Grader, ItemError, get_grader, grade_sample
from orchestrator.sandbox.testrun import TestOutcome, TestRun, TestRunResult, patched_files
from tests import swe_project

DOC = Path(__file__).resolve().parents[1] / "docs" / "graders.md"
EXAMPLE = re.compile(
    r"<!-- example: (?P<name>[\w-]+) -->\s*```yaml\n(?P<yaml>.*?)```\s*```json\n(?P<json>.*?)```",
    re.DOTALL,
)


def examples() -> list[tuple[str, str, dict[str, Any]]]:
    found = [
        (m["name"], m["yaml"], json.loads(m["json"])) for m in EXAMPLE.finditer(DOC.read_text())
    ]
    assert len(found) >= 4, "docs/graders.md lost its examples"
    return found


@pytest.mark.parametrize(("name", "environments", "case"), examples(), ids=lambda v: str(v)[:20])
def test_each_example_scores_as_the_page_says(
    name: str, environments: str, case: dict[str, Any], settings: Settings
) -> None:
    registry = parse_environments(environments, settings, source=f"docs/graders.md:{name}")
    (environment,) = [registry.get(n) for n in registry.names()]
    grader = get_grader(environment.grader.name, environment.grader.options)
    result = grade_sample(grader, case["sample"], case["row"], [])
    assert result.score == pytest.approx(case["score"]), (name, result)


def test_the_custom_grader_works_as_shown() -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert code is not None
    namespace: dict[str, Any] = {}
    exec(compile(code[1], "docs/graders.md", "exec"), namespace)  # our own page's code
    exact = namespace["Exact"]()
    assert isinstance(exact, Grader)
    assert exact.grade(" 42 ", {"expected": "42"}, []).score == 1.0
    with pytest.raises(ItemError) as missing:
        exact.grade("42", {}, [])
    assert missing.value.field == "expected"


SANDBOX_EXAMPLE = re.compile(
    r"<!-- example \(sandbox\): (?P<name>[\w-]+) -->\s*```yaml\n(?P<yaml>.*?)```\s*"
    r"```json\n(?P<json>.*?)```",
    re.DOTALL,
)


class AllPass:
    """A sandbox whose every listed test passes (the end-to-end tests run the real one)."""

    def __init__(self) -> None:
        self.runs: list[TestRun] = []

    def run_tests(self, run: TestRun) -> TestRunResult:
        self.runs.append(run)
        passed = {test: TestOutcome.PASSED for test in run.tests}
        return TestRunResult(ready=True, started=True, exit_code=0, outcomes=passed)


def test_the_sandbox_example_loads_and_its_patch_applies_to_the_real_project(
    settings: Settings, tmp_path: Path
) -> None:
    (match,) = SANDBOX_EXAMPLE.finditer(DOC.read_text())
    registry = parse_environments(match["yaml"], settings, source="docs/graders.md:sandbox")
    (environment,) = [registry.get(n) for n in registry.names()]
    grader = get_grader(environment.grader.name, environment.grader.options)
    assert grader.uses_sandbox()
    case = json.loads(match["json"])
    sandbox = AllPass()
    context = GradeContext(
        answer="", item=case["row"], trajectory=[], sample=case["sample"], sandbox=sandbox
    )
    assert grader.evaluate(context).score == 1.0
    (run,) = sandbox.runs
    assert run.tests[0] == "tests/test_calc.py::test_mul_negative" and len(run.tests) == 3
    # The page's patch is a real one for the project it names.
    project = swe_project.build(tmp_path / "swe")
    tree = tmp_path / "tree"
    swe_project._git(
        project.repo, "worktree", "add", "-q", "--detach", str(tree), project.base_commit
    )
    files, _ = patched_files(tree, run.test_patch)
    assert b"def test_mul_negative(two):" in files["tests/test_calc.py"]
