"""Graders: turn a finished rollout (answer, dataset row, trajectory) into a score.

Built-ins: ``file_f1`` (:class:`FileF1Grader`, files to edit against the real change),
``numeric_match`` (:class:`NumericMatchGrader`, FinQA-style numbers), ``multi``
(:class:`MultiGrader`, sub-graders combined by a formula with penalties) and
``sandbox_tests`` (:class:`SandboxTestsGrader`, the task's tests run in the sandbox) and
``score_model`` (:class:`ScoreModelGrader`, a model as judge).
Custom graders are any :class:`Grader` subclass named by dotted path. The interface and the
error contract (:class:`GraderConfigError`, :class:`ItemError` -> 422, anything else -> 503,
never a 0) are documented in :mod:`orchestrator.grading.base`.
"""

from orchestrator.grading.answer import extract_answer
from orchestrator.grading.base import (
    GradeContext,
    Grader,
    GraderConfigError,
    GradeResult,
    GraderOptions,
    GraderUnavailable,
    GradeServices,
    GradingError,
    ItemError,
    SandboxAccess,
    SandboxUnusable,
    grade_context,
    grade_sample,
    parse_options,
)
from orchestrator.grading.file_f1 import (
    FileF1Grader,
    FileF1Options,
    extract_paths,
    normalise_path,
    paths_in_text,
)
from orchestrator.grading.judge import JudgeErrorKind, ScoreModelGrader, ScoreModelOptions
from orchestrator.grading.multi import Measures, MultiGrader, MultiOptions
from orchestrator.grading.numeric_match import (
    NumericMatchGrader,
    NumericMatchOptions,
    ParsedNumber,
    find_final_number,
)
from orchestrator.grading.registry import (
    BUILTIN_GRADERS,
    get_grader,
    grader_names,
    resolve_grader,
)
from orchestrator.grading.sandbox_tests import SandboxTestsGrader, SandboxTestsOptions

__all__ = [
    "BUILTIN_GRADERS",
    "FileF1Grader",
    "FileF1Options",
    "GradeContext",
    "GradeResult",
    "GradeServices",
    "Grader",
    "GraderConfigError",
    "GraderOptions",
    "GraderUnavailable",
    "GradingError",
    "ItemError",
    "JudgeErrorKind",
    "Measures",
    "MultiGrader",
    "MultiOptions",
    "NumericMatchGrader",
    "NumericMatchOptions",
    "ParsedNumber",
    "SandboxAccess",
    "SandboxTestsGrader",
    "SandboxTestsOptions",
    "SandboxUnusable",
    "ScoreModelGrader",
    "ScoreModelOptions",
    "extract_answer",
    "extract_paths",
    "find_final_number",
    "get_grader",
    "grade_context",
    "grade_sample",
    "grader_names",
    "normalise_path",
    "parse_options",
    "paths_in_text",
    "resolve_grader",
]
