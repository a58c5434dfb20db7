"""A grader with a bug, named by dotted path in the fault suite's environments
(``tests.faults.graders:ExplodingGrader``): every grade raises."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.grading.base import Grader, GradeResult
from orchestrator.state.models import TrajectoryStep


class GraderBug(RuntimeError):
    """What the broken grader raises: a bug of ours, never the agent's fault."""


class ExplodingGrader(Grader):
    name = "exploding"

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        raise GraderBug(f"the grader crashed on purpose ({len(trajectory)} steps)")
