"""``sandbox_tests``: the task's tests, run in the rollout's sandbox against the agent's
edits after its last call, SWE-bench style.

The row carries what decides: ``test_patch`` (a unified diff with git's ``a/``/``b/``
prefixes adding or changing tests, applied at grade time, never visible to the agent
before), ``FAIL_TO_PASS`` (tests that fail before the fix and must pass after it) and
``PASS_TO_PASS`` (tests that must keep passing): pytest node ids, as a list or as the JSON
text of one (SWE-bench's datasets store them so). The field names are options.

The score is the fraction of the listed tests that pass (``score: fraction``, partial
credit), or 1 only when all pass (``score: resolved``); ``details`` has every test's
outcome. How the run is kept out of the agent's reach (its processes ended, the runner's
configuration restored from the image, the system's own pytest) is in
:mod:`orchestrator.sandbox.testrun`.

Whose is what:

* the agent's code failing, not importing, hanging past ``timeout_s``, or the agent having
  filled its workspace so the tests could not be set up: a score (tests that did not pass
  count as failed);
* the row: no tests listed, a field of the wrong shape, a test patch that does not apply to
  the repository at the row's commit: :class:`ItemError` (422);
* the sandbox dying, or our machinery failing (no pytest in the image, a report cut short):
  :class:`SandboxUnusable` or another error, a 503, never a 0.

A regrade cannot run these tests again (the sandbox is gone): the stored verdict stands.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field

from orchestrator.grading.base import (
    GradeContext,
    Grader,
    GradeResult,
    GraderOptions,
    ItemError,
)
from orchestrator.sandbox.testrun import TestOutcome, TestRun
from orchestrator.state.models import TrajectoryStep


class SandboxTestsOptions(GraderOptions):
    """Options of :class:`SandboxTestsGrader`."""

    timeout_s: float = Field(300.0, gt=0, le=3600, description="The test run's budget.")
    score: Literal["fraction", "resolved"] = Field(
        "fraction", description="fraction: partial credit; resolved: 1 only when all pass."
    )
    patch_field: str = Field("test_patch", min_length=1)
    fail_to_pass_field: str = Field("FAIL_TO_PASS", min_length=1)
    pass_to_pass_field: str = Field("PASS_TO_PASS", min_length=1)


class SandboxTestsGrader(Grader):
    """The row's tests in the rollout's sandbox; see the module docstring."""

    name: ClassVar[str] = "sandbox_tests"
    options_model: ClassVar[type[GraderOptions]] = SandboxTestsOptions
    needs_sandbox: ClassVar[bool] = True
    options: SandboxTestsOptions

    def sandbox_time_s(self) -> float:
        """The test run's budget, and a minute to set it up."""
        return self.options.timeout_s + 60.0

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        """Only through :meth:`evaluate`, which has the sandbox."""
        return self.evaluate(GradeContext(answer=answer, item=item, trajectory=trajectory))

    def evaluate(self, context: GradeContext) -> GradeResult:
        """Run the row's tests in the sandbox and score what passed."""
        options = self.options
        fail_to_pass = _tests(context.item, options.fail_to_pass_field)
        pass_to_pass = _tests(context.item, options.pass_to_pass_field)
        listed = list(dict.fromkeys([*fail_to_pass, *pass_to_pass]))
        if not listed:
            raise ItemError(
                options.fail_to_pass_field,
                f"no tests to run: {options.fail_to_pass_field} and "
                f"{options.pass_to_pass_field} are both empty or missing",
            )
        patch = context.item.get(options.patch_field, "")
        if not isinstance(patch, str):
            raise ItemError(options.patch_field, "must be a unified diff as text")
        if context.sandbox is None:
            raise RuntimeError("sandbox_tests needs the rollout's sandbox, and got none")
        result = context.sandbox.run_tests(
            TestRun(tests=listed, test_patch=patch, timeout_s=options.timeout_s)
        )
        if result.patch_error is not None:
            raise ItemError(options.patch_field, result.patch_error)
        if result.error is not None:
            raise RuntimeError(f"the test run failed on our side: {result.error}")
        details: dict[str, Any] = {
            "fail_to_pass": {t: result.outcomes.get(t, TestOutcome.MISSING) for t in fail_to_pass},
            "pass_to_pass": {t: result.outcomes.get(t, TestOutcome.MISSING) for t in pass_to_pass},
            "timed_out": result.timed_out,
            "exit_code": result.exit_code,
            "restored": result.restored,
            "removed": result.removed,
        }
        if result.no_space:
            details["reason"] = "the agent filled its workspace: the tests could not be set up"
            return GradeResult(score=0.0, details=details)
        if not result.ready and not result.timed_out:
            # The system's interpreter and pytest never got going: ours, not the agent's.
            raise RuntimeError(
                "the test runner did not start (is pytest in the sandbox image?): "
                f"{result.stderr_tail[-500:]}"
            )
        if not result.started:
            details["reason"] = "pytest did not start a session: the agent's code or the "
            details["reason"] += "tests' set-up failed (see stderr_tail)"
        if result.collect_errors:
            details["collect_errors"] = result.collect_errors[:50]
        if not result.started or result.collect_errors:
            details["stderr_tail"] = result.stderr_tail[-1500:]
        passed = sum(1 for t in listed if result.outcomes.get(t) == TestOutcome.PASSED)
        details.update(passed=passed, total=len(listed))
        if options.score == "resolved":
            score = 1.0 if passed == len(listed) else 0.0
        else:
            score = passed / len(listed)
        return GradeResult(score=score, details=details)


def _tests(item: Mapping[str, Any], field: str) -> list[str]:
    """A row's list of test ids: a list of strings, or the JSON text of one."""
    raw = item.get(field)
    if raw is None:
        return []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise ItemError(field, "must be a list of test ids, or the JSON text of one") from None
    if not isinstance(raw, list) or not all(isinstance(t, str) and t.strip() for t in raw):
        raise ItemError(field, "must be a list of test ids (non-empty strings)")
    return [t.strip() for t in raw]
