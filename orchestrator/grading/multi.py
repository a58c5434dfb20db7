"""``multi``: named sub-graders combined by a formula, with penalties from the rollout.

An environment's grader::

    grader:
      name: multi
      options:
        graders:
          files: {name: file_f1}
          number: {name: numeric_match, options: {partial_credit: 0.25}}
        formula: "0.7 * files + 0.3 * number - 0.02 * max(0, tool_calls - 10)"
        clamp: [0, 1]

The formula is an arithmetic expression over:

* each sub-grader's score, by its name;
* the rollout's measures (:class:`Measures`): ``tool_calls``, ``tool_errors`` (calls whose
  outcome was not ``ok``), ``wall_time_s`` (from the first call's start to the last call's
  end), ``answer_chars``, and ``output_tokens`` (the sample's ``usage``: ``output_tokens``,
  else ``completion_tokens``; a formula that uses it makes a sample without it a 422);
* numbers, ``+ - * / **``, parentheses, and ``min``, ``max``, ``abs``, ``floor``, ``ceil``,
  ``sqrt``, ``log``, ``exp``, ``clamp(x, low, high)``.

It is parsed and checked when the environment loads (an unknown name, a function not in
the list or any other construct is a :class:`GraderConfigError` naming it). The result,
clamped to ``clamp`` when given, is the one score; ``details`` holds every sub-grader's score
and details, the measures, and the formula's value before the clamp.

Errors keep the contract of :mod:`orchestrator.grading.base`: a sub-grader's
:class:`ItemError` is the row's fault (422, naming the sub-grader); any other failure of a
sub-grader, or a formula that cannot be computed (a division by zero, a result not finite),
is ours: a 503, never a score.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.grading.base import (
    GradeContext,
    Grader,
    GraderConfigError,
    GradeResult,
    GraderOptions,
    GraderUnavailable,
    ItemError,
    SandboxUnusable,
    grade_context,
)
from orchestrator.outcomes import Outcome
from orchestrator.state.models import TrajectoryStep


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


FUNCTIONS: Mapping[str, Callable[..., float]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "floor": math.floor,
    "ceil": math.ceil,
    "sqrt": math.sqrt,
    "log": math.log,
    "exp": math.exp,
    "clamp": _clamp,
}

_OPERATORS: Mapping[type[ast.AST], Callable[..., float]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: lambda a, b: a**b,
    ast.USub: lambda a: -a,
    ast.UAdd: lambda a: +a,
}


class Measures(BaseModel):
    """What the formula may read about the rollout besides its sub-graders' scores."""

    tool_calls: int
    tool_errors: int
    wall_time_s: float
    answer_chars: int
    output_tokens: int | None = Field(None, description="None: the sample carries no usage.")

    @classmethod
    def of(cls, context: GradeContext) -> Measures:
        """The measures of the rollout ``context`` describes (no clock: a retried grade
        sees the same)."""
        steps = context.trajectory
        wall = 0.0
        if steps:
            start = min(step.started_at.timestamp() for step in steps)
            end = max(step.started_at.timestamp() + step.duration_ms / 1000 for step in steps)
            wall = max(0.0, end - start)
        return cls(
            tool_calls=len(steps),
            tool_errors=sum(1 for step in steps if step.outcome != Outcome.OK),
            wall_time_s=round(wall, 3),
            answer_chars=len(context.answer),
            output_tokens=_output_tokens(context.sample),
        )


def _output_tokens(sample: Mapping[str, Any]) -> int | None:
    usage = sample.get("usage")
    if not isinstance(usage, Mapping):
        return None
    for key in ("output_tokens", "completion_tokens"):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


MEASURES = tuple(Measures.model_fields)


class SubGrader(BaseModel):
    """One named part of a ``multi`` grader: a grader by name or path, and its options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)


class MultiOptions(GraderOptions):
    """Options of :class:`MultiGrader`."""

    graders: dict[str, SubGrader] = Field(min_length=1, description="Sub-graders by name.")
    formula: str = Field(min_length=1, max_length=2000, description="The score's expression.")
    clamp: tuple[float, float] | None = Field(None, description="[low, high] of the score.")

    @model_validator(mode="after")
    def _names(self) -> Self:
        for name in self.graders:
            if not name.isidentifier() or name in FUNCTIONS or name in MEASURES:
                raise ValueError(
                    f"sub-grader name {name!r} must be an identifier and not one of the "
                    f"formula's functions or measures ({', '.join(MEASURES)})"
                )
        if self.clamp is not None and not self.clamp[0] <= self.clamp[1]:
            raise ValueError("clamp must be [low, high] with low <= high")
        return self


class Formula:
    """An arithmetic expression checked once and evaluated over named values."""

    def __init__(self, text: str, names: set[str]) -> None:
        try:
            self.tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as exc:
            raise GraderConfigError(f"grader 'multi': formula {text!r}: {exc.msg}") from None
        self.text = text
        self.names: set[str] = set()
        self._check(self.tree, names)

    def _check(self, node: ast.AST, names: set[str]) -> None:
        def refuse(what: str) -> GraderConfigError:
            return GraderConfigError(f"grader 'multi': formula {self.text!r}: {what}")

        match node:
            case ast.Constant(value=value):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise refuse(f"{value!r} is not a number")
            case ast.Name(id=name):
                if name not in names:
                    raise refuse(
                        f"unknown name {name!r} (sub-graders and measures: "
                        f"{', '.join(sorted(names))})"
                    )
                self.names.add(name)
            case ast.BinOp(left=left, op=op, right=right) if type(op) in _OPERATORS:
                self._check(left, names)
                self._check(right, names)
            case ast.UnaryOp(op=op, operand=operand) if type(op) in _OPERATORS:
                self._check(operand, names)
            case ast.Call(func=ast.Name(id=function), args=args, keywords=[]) if args:
                if function not in FUNCTIONS:
                    raise refuse(
                        f"unknown function {function!r} (known: {', '.join(sorted(FUNCTIONS))})"
                    )
                for arg in args:
                    self._check(arg, names)
            case ast.BinOp(op=ast.BitXor()):
                raise refuse("'^' is not a power here: write '**'")
            case _:
                raise refuse(f"{ast.unparse(node)!r} is not allowed (arithmetic only)")

    def __call__(self, values: Mapping[str, float]) -> float:
        """The formula's value; raises ``ArithmeticError`` or ``ValueError`` when it has none."""
        result = float(self._value(self.tree, values))
        if not math.isfinite(result):
            raise ArithmeticError(f"the formula's value is {result}")
        return result

    def _value(self, node: ast.AST, values: Mapping[str, float]) -> float:
        match node:
            case ast.Constant(value=int() | float() as value):
                return float(value)
            case ast.Name(id=name):
                return values[name]
            case ast.BinOp(left=left, op=op, right=right):
                return _OPERATORS[type(op)](self._value(left, values), self._value(right, values))
            case ast.UnaryOp(op=op, operand=operand):
                return _OPERATORS[type(op)](self._value(operand, values))
            case ast.Call(func=ast.Name(id=function), args=args):
                return float(FUNCTIONS[function](*(self._value(arg, values) for arg in args)))
        raise AssertionError(f"unchecked node {ast.dump(node)}")  # _check refused it


class MultiGrader(Grader):
    """Sub-graders combined by a formula; see the module docstring."""

    name: ClassVar[str] = "multi"
    options_model: ClassVar[type[GraderOptions]] = MultiOptions
    options: MultiOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        # Imported here: the registry lists this grader.
        from orchestrator.grading.registry import get_grader

        self.graders: dict[str, Grader] = {}
        for part, sub in self.options.graders.items():
            if sub.name == self.name:
                raise GraderConfigError(f"grader 'multi': graders.{part}: multi does not nest")
            try:
                self.graders[part] = get_grader(sub.name, sub.options)
            except GraderConfigError as exc:
                raise GraderConfigError(f"grader 'multi': graders.{part}: {exc}") from None
        self.formula = Formula(self.options.formula, set(self.graders) | set(MEASURES))

    def uses_sandbox(self) -> bool:
        """Any sub-grader's need."""
        return any(grader.uses_sandbox() for grader in self.graders.values())

    def sandbox_time_s(self) -> float:
        """The sub-graders', one after another."""
        return sum(grader.sandbox_time_s() for grader in self.graders.values())

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        """Scores a context with no sample (:meth:`evaluate` does the work)."""
        return self.evaluate(GradeContext(answer=answer, item=item, trajectory=trajectory))

    def evaluate(self, context: GradeContext) -> GradeResult:
        """Every sub-grader, then the formula over their scores and the measures."""
        measures = Measures.of(context)
        if "output_tokens" in self.formula.names and measures.output_tokens is None:
            raise ItemError(
                "sample.usage",
                "the formula uses output_tokens, and the sample carries no usage "
                "(output_tokens or completion_tokens)",
            )
        parts: dict[str, dict[str, Any]] = {}
        values: dict[str, float] = {
            k: float(v) for k, v in measures.model_dump().items() if v is not None
        }
        for part, grader in self.graders.items():
            try:
                result = grade_context(grader, context)
            except ItemError as exc:
                raise ItemError(exc.field, f"{exc.message} (sub-grader {part!r})") from exc
            except (SandboxUnusable, GraderUnavailable):
                # The sandbox's failure, or a service's (a judge's): as the sub-grader's
                # own kind, with its evidence, not as a bug of the sub-grader.
                raise
            except Exception as exc:
                raise RuntimeError(f"sub-grader {part!r} ({grader.name}) failed: {exc!r}") from exc
            parts[part] = {"score": result.score, "details": result.details}
            values[part] = result.score
        try:
            raw = self.formula(values)
        except (ArithmeticError, ValueError, TypeError) as exc:
            raise RuntimeError(f"formula {self.formula.text!r} failed: {exc}") from exc
        score = raw if self.options.clamp is None else _clamp(raw, *self.options.clamp)
        return GradeResult(
            score=score,
            details={
                "graders": parts,
                "measures": measures.model_dump(),
                "formula": self.formula.text,
                "formula_value": raw,
            },
        )
