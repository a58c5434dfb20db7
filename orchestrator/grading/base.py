"""The grader interface and its error contract.

A grader turns one finished rollout into a score::

    grader = SomeGrader(**options)            # options from the environment's YAML
    result = grader.grade(answer, item, trajectory)

* ``answer`` is the agent's final answer as text (see :func:`~orchestrator.grading.answer.
  extract_answer`); an empty answer is the agent's own and is scored like any other.
* ``item`` is the dataset row the trainer sent (``gold_files``, ``answer``, ...).
* ``trajectory`` is every tool call of the rollout, rebuilt from our own log.

A grader that needs more (the Agent RFT ``sample`` with its token usage, the rollout's
measures) overrides :meth:`Grader.evaluate`, which gets all of it as one
:class:`GradeContext`; ``multi`` (combined graders and penalties) is one.

``grade`` must be pure and deterministic: no I/O, no clock, no randomness. The trainer
retries a grade call after a 5xx, and a retried grade must return the same score.

Errors, and what the API makes of them:

* :class:`GraderConfigError` -- a deployment mistake: an unknown grader name, a dotted path
  that does not import, invalid or unknown options. Raised when the grader is built, so a
  bad environment config fails at start-up rather than on the first grade.
* :class:`ItemError` -- the dataset row lacks what the grader needs (no ``gold_files``, an
  unparseable gold ``answer``). The API answers 422 naming :attr:`ItemError.field`. It is
  the dataset's fault, so it must never become a reward.
* :class:`GraderUnavailable` -- something the grader depends on failed (a judge model's
  server down, slow, or answering nonsense): a 503 with its ``kind`` and ``evidence``, the
  rollout left intact so a retry may grade it once the service is back.
* Any other exception raised by ``grade`` is a grader failure: the API answers 503, so the
  trainer retries and finally discards the rollout. A crashing grader never yields a 0,
  because a zero reward for our bug would poison training exactly as an infra fault would.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from orchestrator.grading.answer import extract_answer
from orchestrator.sandbox.testrun import TestRun, TestRunResult
from orchestrator.state.models import TrajectoryStep


class GradeResult(BaseModel):
    """A score and the evidence behind it. ``details`` must be JSON-serialisable."""

    model_config = ConfigDict(frozen=True)

    score: float = Field(description="Usually 0..1; a job may use another scale.")
    details: dict[str, Any] = Field(default_factory=dict)

    @field_validator("score")
    @classmethod
    def _finite(cls, value: float) -> float:
        # NaN or inf cannot be sent as JSON and would corrupt a trainer's reward statistics.
        if not math.isfinite(value):
            raise ValueError("score must be a finite number")
        return value


@runtime_checkable
class SandboxAccess(Protocol):
    """What a grader that needs the rollout's sandbox may do in it (``needs_sandbox``),
    given by the grade as :attr:`GradeContext.sandbox`. Raises :class:`SandboxUnusable`
    when the sandbox or the machinery around it fails: no verdict, never a score."""

    def run_tests(self, run: TestRun) -> TestRunResult:
        """Run ``run``'s tests against the agent's work (sandbox/testrun.py)."""
        ...


@runtime_checkable
class GradeServices(Protocol):
    """What the deployment lends a grader that calls out (a judge model, say), given by
    the grade as :attr:`GradeContext.services`: a verdict cache shared by every API
    replica, so a retried grade neither pays for a second verdict nor gets another one,
    and slots that bound how many calls to one service the whole deployment makes at once.
    Raises :class:`GraderUnavailable` when the deployment's state store is unreachable."""

    def recall(self, key: str) -> dict[str, Any] | None:
        """The verdict kept under ``key``, or None."""
        ...

    def remember(self, key: str, verdict: dict[str, Any], ttl_s: float) -> None:
        """Keep ``verdict`` under ``key`` for ``ttl_s`` seconds."""
        ...

    def slot(
        self, name: str, limit: int, wait_s: float, hold_s: float
    ) -> AbstractContextManager[bool]:
        """One of ``limit`` slots named ``name`` across the deployment, for at most
        ``hold_s`` (it lapses after, should its holder die); the context's value is False
        when none came free within ``wait_s``."""
        ...


class GradeContext(BaseModel):
    """Everything a grade may read about one finished rollout."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    answer: str = Field(description="The final answer, read from the sample.")
    item: Mapping[str, Any] = Field(description="The dataset row.")
    trajectory: Sequence[TrajectoryStep] = Field(description="Every tool call, in order.")
    sample: Mapping[str, Any] = Field(
        default_factory=dict,
        description="What the trainer sent as its output (Agent RFT's ``sample``: "
        "``output_text``, ``choices``, ``usage``, ...); empty when it sent only an answer.",
    )
    sandbox: SandboxAccess | None = Field(
        None,
        exclude=True,
        description="The rollout's sandbox, for a grader that needs it (None otherwise).",
    )
    rollout_id: str = Field("", description="The rollout graded ('' offline).")
    environment: str = Field("", description="Its environment's name ('' offline).")
    services: GradeServices | None = Field(
        None,
        exclude=True,
        description="The deployment's verdict cache and slots (None offline).",
    )


class GradingError(Exception):
    """Base of the errors a grader raises on purpose (see the module docstring)."""


class GraderConfigError(GradingError):
    """Unknown grader, a dotted path that does not load, or invalid options."""


class SandboxUnusable(GradingError):
    """The rollout's sandbox, or our machinery around it, failed while a grader used it:
    the rollout is ``infra_failed`` with ``evidence`` (503), never scored."""

    def __init__(self, message: str, evidence: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.evidence = evidence or {}


class GraderUnavailable(GradingError):
    """A service the grader depends on failed (unreachable, too slow, answering what
    cannot be read): a 503 naming ``kind``, with ``evidence``, never a score. The rollout
    stays intact: a retry once the service is back grades it."""

    def __init__(self, kind: str, message: str, evidence: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.evidence = evidence or {}


class ItemError(GradingError):
    """The dataset row lacks a field the grader needs, or the field is unusable."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"item field {field!r}: {message}")
        self.field = field
        self.message = message


class GraderOptions(BaseModel):
    """Base of every grader's options model: frozen, and unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Grader(ABC):
    """One scoring rule.

    Subclasses set ``name`` (how environments refer to it) and, if they take options,
    ``options_model`` (a :class:`GraderOptions` subclass) and an ``options`` annotation
    narrowed to that model. ``__init__`` validates options and raises
    :class:`GraderConfigError` naming any unknown or invalid option.
    """

    name: ClassVar[str]
    options_model: ClassVar[type[GraderOptions]] = GraderOptions
    needs_sandbox: ClassVar[bool] = False
    """True for a grader whose score is only sound if the rollout's sandbox is still
    healthy when it grades (one that takes the trajectory's last outputs as the sandbox's
    final state, say): the sandbox is probed first, and a sandbox that died not by the
    agent's hand makes the rollout ``infra_failed`` instead of scored. A grader that
    scores the answer against the row and the trajectory (``file_f1``, ``numeric_match``)
    leaves it False: the trajectory it reads was recorded whatever became of the
    sandbox after, so grading never waits on the sandbox."""
    options: GraderOptions

    def __init__(self, **options: Any) -> None:
        self.options = parse_options(self.options_model, options, grader=_name_of(type(self)))

    @abstractmethod
    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        """Score ``answer`` for ``item``. Pure and deterministic; see the module docstring."""

    def uses_sandbox(self) -> bool:
        """Whether this grader's score needs the sandbox alive (:attr:`needs_sandbox`; a
        grader made of others answers for them)."""
        return self.needs_sandbox

    def sandbox_time_s(self) -> float:
        """The longest this grader may work in the sandbox (0: it never does); the rollout
        is not idle meanwhile."""
        return 0.0

    def evaluate(self, context: GradeContext) -> GradeResult:
        """Score the rollout ``context`` describes. By default :meth:`grade` on its
        answer, row and trajectory; a grader that reads the sample overrides this."""
        return self.grade(context.answer, context.item, context.trajectory)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"


OptionsT = TypeVar("OptionsT", bound=GraderOptions)


def _name_of(cls: type[Grader]) -> str:
    return str(getattr(cls, "name", cls.__qualname__))


def parse_options(model: type[OptionsT], options: Mapping[str, Any], *, grader: str) -> OptionsT:
    """Validate ``options`` against ``model``; every problem becomes a GraderConfigError."""
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        known = ", ".join(sorted(model.model_fields)) or "none"
        problems: list[str] = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "options"
            if error["type"] == "extra_forbidden":
                problems.append(f"unknown option {where!r}")
            else:
                problems.append(f"option {where!r}: {error['msg']}")
        raise GraderConfigError(
            f"grader {grader!r}: {'; '.join(problems)} (known options: {known})"
        ) from None


def grade_sample(
    grader: Grader,
    sample: Any,
    item: Mapping[str, Any],
    trajectory: Sequence[TrajectoryStep],
) -> GradeResult:
    """What the grade endpoint runs: read the answer from ``sample``, grade it, check it.

    Raises what ``grader.grade`` raises (see the module docstring), and ``TypeError`` -- a
    grader failure, hence a 503 -- if a custom grader returns something other than a
    :class:`GradeResult`.
    """
    context = GradeContext(
        answer=extract_answer(sample),
        item=item,
        trajectory=trajectory,
        sample=sample if isinstance(sample, Mapping) else {},
    )
    return grade_context(grader, context)


def grade_context(grader: Grader, context: GradeContext) -> GradeResult:
    """``grader.evaluate(context)``, checked: raises what the grader raises, and
    ``TypeError`` (a grader failure, hence a 503) for a result not a :class:`GradeResult`."""
    result = grader.evaluate(context)
    if not isinstance(result, GradeResult):
        raise TypeError(
            f"grader {_name_of(type(grader))!r} returned {type(result).__name__}, not a GradeResult"
        )
    return result
