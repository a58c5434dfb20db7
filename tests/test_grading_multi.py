"""The ``multi`` grader (orchestrator/grading/multi.py): sub-graders combined by a checked
formula with penalties from the trajectory and the sample; its failures keep the grading
contract (the row's fault is an ItemError, ours anything else, never a score)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import pytest

from orchestrator.grading import (
    GradeContext,
    Grader,
    GraderConfigError,
    GradeResult,
    ItemError,
    Measures,
    MultiGrader,
    get_grader,
    grade_sample,
)
from orchestrator.outcomes import Outcome
from orchestrator.state.models import TrajectoryStep

START = datetime(2026, 1, 1, tzinfo=UTC)
THIS_MODULE = __name__


def _step(
    seq: int, *, at_s: float = 0.0, ms: float = 100.0, outcome: Outcome = Outcome.OK
) -> TrajectoryStep:
    return TrajectoryStep(
        seq=seq,
        call_id=f"call_{seq}",
        tool="shell",
        arguments={"command": "ls"},
        outcome=outcome,
        exit_code=0,
        output="",
        started_at=START + timedelta(seconds=at_s),
        duration_ms=ms,
    )


class Raises(Grader):
    name: ClassVar[str] = "raises"

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        raise KeyError("a bug in the grader")


class NeedsSandbox(Grader):
    name: ClassVar[str] = "needs_sandbox"
    needs_sandbox: ClassVar[bool] = True

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        return GradeResult(score=1.0)


FILES_AND_NUMBER = {
    "graders": {
        "files": {"name": "file_f1"},
        "number": {"name": "numeric_match", "options": {"answer_field": "total"}},
    },
    "formula": "0.5 * files + 0.5 * number - 0.1 * max(0, tool_calls - 2)",
}
ITEM = {"gold_files": ["a.py", "b.py"], "total": 12}


def test_the_formula_combines_the_sub_graders_and_penalises_calls_past_a_budget() -> None:
    grader = get_grader("multi", FILES_AND_NUMBER)
    sample = {"output_text": "a.py b.py; the answer is 12"}
    two = grade_sample(grader, sample, ITEM, [_step(1), _step(2)])
    assert two.score == pytest.approx(1.0)
    assert two.details["graders"]["files"]["score"] == 1.0
    assert two.details["graders"]["number"]["details"]["gold_value"] == 12
    assert two.details["measures"]["tool_calls"] == 2
    five = grade_sample(grader, sample, ITEM, [_step(i) for i in range(1, 6)])
    assert five.score == pytest.approx(0.7)  # three calls past the budget of two
    assert five.details["formula_value"] == pytest.approx(0.7)


def test_clamp_bounds_the_score_and_keeps_the_raw_value() -> None:
    grader = get_grader("multi", {**FILES_AND_NUMBER, "clamp": [0, 1]})
    many = [_step(i) for i in range(1, 30)]
    result = grade_sample(grader, {"output_text": "nothing"}, ITEM, many)
    assert result.score == 0.0
    assert result.details["formula_value"] == pytest.approx(-2.7)


def test_output_tokens_come_from_the_samples_usage() -> None:
    grader = get_grader(
        "multi",
        {
            "graders": {"files": {"name": "file_f1"}},
            "formula": "files - 0.001 * max(0, output_tokens - 1000)",
        },
    )
    item = {"gold_files": ["a.py"]}
    usage = {"output_text": "a.py", "usage": {"output_tokens": 1500, "input_tokens": 9}}
    assert grade_sample(grader, usage, item, []).score == pytest.approx(0.5)
    chat = {"output_text": "a.py", "usage": {"completion_tokens": 1200}}
    assert grade_sample(grader, chat, item, []).score == pytest.approx(0.8)
    # A formula that needs the usage the sample does not carry: the row's (the trainer's)
    # fault, a 422 naming it, never a guess.
    with pytest.raises(ItemError) as raised:
        grade_sample(grader, {"output_text": "a.py"}, item, [])
    assert raised.value.field == "sample.usage"


def test_measures_read_the_trajectory_not_the_clock() -> None:
    steps = [
        _step(1, at_s=0.0, ms=500),
        _step(2, at_s=2.0, ms=1500, outcome=Outcome.AGENT_ERROR),
        _step(3, at_s=1.0, ms=100),
    ]
    measures = Measures.of(GradeContext(answer="abc", item={}, trajectory=steps))
    assert measures.model_dump() == {
        "tool_calls": 3,
        "tool_errors": 1,
        "wall_time_s": 3.5,
        "answer_chars": 3,
        "output_tokens": None,
    }
    assert Measures.of(GradeContext(answer="", item={}, trajectory=[])).wall_time_s == 0.0


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"graders": {}, "formula": "1"}, "graders"),
        ({"graders": {"a": {"name": "file_f1"}}}, "formula"),
        ({"graders": {"a": {"name": "nope"}}, "formula": "a"}, "graders.a: unknown grader"),
        (
            {"graders": {"a": {"name": "file_f1", "options": {"bad": 1}}}, "formula": "a"},
            "graders.a: grader 'file_f1': unknown option 'bad'",
        ),
        ({"graders": {"a": {"name": "file_f1"}}, "formula": "a + b"}, "unknown name 'b'"),
        ({"graders": {"a": {"name": "file_f1"}}, "formula": "a +"}, "'a \\+': invalid syntax"),
        ({"graders": {"a": {"name": "file_f1"}}, "formula": "pow(a, 2)"}, "unknown function"),
        ({"graders": {"a": {"name": "file_f1"}}, "formula": "a ^ 2"}, "write '\\*\\*'"),
        ({"graders": {"a": {"name": "file_f1"}}, "formula": "a.real"}, "not allowed"),
        ({"graders": {"a": {"name": "file_f1"}}, "formula": "__import__('os')"}, "unknown"),
        ({"graders": {"a": {"name": "file_f1"}}, "formula": "'a'"}, "not a number"),
        ({"graders": {"a": {"name": "file_f1"}}, "formula": "a if a else 0"}, "not allowed"),
        ({"graders": {"tool_calls": {"name": "file_f1"}}, "formula": "1"}, "measures"),
        ({"graders": {"a-b": {"name": "file_f1"}}, "formula": "1"}, "identifier"),
        ({"graders": {"a": {"name": "multi"}}, "formula": "a"}, "does not nest"),
        ({"graders": {"a": {"name": "file_f1"}}, "formula": "a", "clamp": [1, 0]}, "clamp"),
        ({"graders": {"a": {"name": "file_f1"}}, "formula": "a", "extra": 1}, "unknown option"),
    ],
)
def test_a_bad_configuration_fails_when_built_naming_what(
    options: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(GraderConfigError, match=fragment):
        get_grader("multi", options)


def test_a_sub_graders_row_error_is_the_rows_fault_naming_the_sub_grader() -> None:
    grader = get_grader("multi", FILES_AND_NUMBER)
    with pytest.raises(ItemError) as raised:
        grade_sample(grader, {"output_text": "a.py"}, {"gold_files": ["a.py"]}, [])
    assert raised.value.field == "total" and "sub-grader 'number'" in str(raised.value)


def test_a_sub_grader_that_raises_is_our_failure_not_a_score() -> None:
    grader = get_grader(
        "multi",
        {
            "graders": {"ok": {"name": "file_f1"}, "bad": {"name": f"{THIS_MODULE}:Raises"}},
            "formula": "ok + bad",
        },
    )
    with pytest.raises(RuntimeError, match="sub-grader 'bad'"):
        grade_sample(grader, {"output_text": "a.py"}, {"gold_files": ["a.py"]}, [])


def test_a_formula_without_a_value_is_our_failure_not_a_score() -> None:
    grader = get_grader(
        "multi", {"graders": {"a": {"name": "file_f1"}}, "formula": "a / (tool_calls - 1)"}
    )
    with pytest.raises(RuntimeError, match="division by zero"):
        grade_sample(grader, {"output_text": "a.py"}, {"gold_files": ["a.py"]}, [_step(1)])
    huge = get_grader("multi", {"graders": {"a": {"name": "file_f1"}}, "formula": "exp(1000 * a)"})
    with pytest.raises(RuntimeError, match="failed"):
        grade_sample(huge, {"output_text": "a.py"}, {"gold_files": ["a.py"]}, [])


def test_it_needs_the_sandbox_when_a_sub_grader_does() -> None:
    plain = get_grader("multi", {"graders": {"a": {"name": "file_f1"}}, "formula": "a"})
    assert not plain.uses_sandbox()
    needing = get_grader(
        "multi",
        {"graders": {"a": {"name": f"{THIS_MODULE}:NeedsSandbox"}}, "formula": "a"},
    )
    assert isinstance(needing, MultiGrader) and needing.uses_sandbox()
