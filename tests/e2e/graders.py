"""A grader that needs the sandbox alive when it grades (``needs_sandbox``), named by dotted
path in the overload test's environment: every grade of it probes the sandbox first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from orchestrator.grading import FileF1Grader
from orchestrator.grading.base import GradeResult
from orchestrator.state.models import TrajectoryStep


class LiveSandboxF1(FileF1Grader):
    """file_f1, but only sound while the sandbox lives: probed before every grade."""

    name = "live_sandbox_f1"
    needs_sandbox: ClassVar[bool] = True

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        return super().grade(answer, item, trajectory)
