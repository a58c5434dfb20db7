"""``numeric_match``: a FinQA-style numeric answer against ``item["answer"]``.

Reading a number (answer and string gold alike):

* thousands separators ``1,234,567.5`` (a comma followed by other than three digits
  separates numbers instead; European ``1.234,5`` is not supported), a leading ``.5``, and
  scientific ``1.2e6``;
* currency symbols and codes are ignored: ``$``, ``US$``, ``€``, ``£``, ``¥``, ``USD``,
  ``EUR``, ``GBP``, ... before or after the number, and ``dollars``/``euros`` after it;
* negatives as ``-5``, ``−5``, ``-$5``, ``$-5`` or accounting style ``(5)`` / ``($5.2m)``;
  a ``-`` right after a digit is a range (``10-12`` reads 10 and 12), and a sign must touch
  its number (``8 - 3`` is 8 and 3);
* a percent: ``12.5%``, ``12.5 percent``, ``12.5 per cent``;
* a scale: ``k``/``thousand``, ``m``/``mn``/``million``, ``b``/``bn``/``billion``,
  ``tn``/``trillion`` (so ``5m`` is five million; ``5 months`` has no scale).
* digits inside words are not numbers (``Q3``, ``FY2019``), and a scale letter must end its
  word (``5k`` is 5000, ``5 km`` is 5).

Which number is the answer: the first number in the last ``\\boxed{...}``; else the first
number after the last ``answer:`` / ``answer is`` / ``answer =`` / ``final answer``; else the
last number in the text. No number: score 0 with ``details["reason"]``.

Readings: a side with a ``%`` sign is read both as written (12.5) and as a fraction
(0.125); a side with a scale word both scaled (5.2e6) and as written (5.2), because FinQA
golds are in the table's units while prose answers spell the unit out. The answer scores
the best over all pairs of an answer reading and a gold reading. So ``12.5%`` matches a gold
of 0.125 or 12.5, and ``0.125`` matches a gold of ``"12.5%"``; a bare ``12.5`` does not
match a bare 0.125 (no ``%`` anywhere says a percent is meant).

Credit:

* 1.0 when ``math.isclose(answer, gold, rel_tol, abs_tol)``, or when the gold is a string
  written with decimals and the answer rounds to it (|answer - gold| is at most half a unit
  of the gold's last written place: gold ``"14.1%"`` accepts 14.12%), since such a gold is
  itself rounded.
* ``partial_credit`` (0.5) for a rounding-level miss: relative error at most
  ``partial_rel_tol`` (1%), or the answer is the gold rounded to the answer's own last
  written place and the answer has at least two significant digits (gold 12.3456 and
  answer 12.35 or 12.3; but a bare ``0`` or ``1`` earns nothing that way).
* 0 otherwise.

A gold that is missing, not a number or a numeric string, or not finite is an
:class:`~orchestrator.grading.base.ItemError`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar, Self

from pydantic import Field, model_validator

from orchestrator.grading.base import Grader, GradeResult, GraderOptions, ItemError
from orchestrator.state.models import TrajectoryStep

_CODES = r"USD|EUR|GBP|JPY|CNY|RMB|INR|CAD|AUD|CHF|HKD|SGD"
_SCALES: dict[str, int] = {
    "k": 3,
    "thousand": 3,
    "thousands": 3,
    "m": 6,
    "mn": 6,
    "mm": 6,
    "million": 6,
    "millions": 6,
    "b": 9,
    "bn": 9,
    "billion": 9,
    "billions": 9,
    "tn": 12,
    "trillion": 12,
    "trillions": 12,
}
_SCALE_WORDS = "|".join(sorted(_SCALES, key=len, reverse=True))

_NUMBER_RE = re.compile(
    rf"""
    (?<![\w.])                                  # not inside a word or a number: Q3, FY2019
    (?P<open>\(\s*)?
    (?P<sign>[-−+])?
    (?P<currency>(?:US\$|[$€£¥]|(?:{_CODES})\s?))?
    (?P<sign2>[-−])?
    (?P<mantissa>(?:\d{{1,3}}(?:,\d{{3}})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)
    (?!\.\d)                                    # 1.2.3 is a version, not a number
    (?:[eE](?P<exponent>[-+]?\d+))?
    (?P<percent>\s*(?:%|percent\b|per\s?cent\b))?
    (?:\s*(?P<scale>{_SCALE_WORDS})\b)?
    (?:\s*(?:[$€£¥]|(?:{_CODES}|dollars?|euros?)\b))?
    (?P<close>\s*\))?
    """,
    re.VERBOSE | re.IGNORECASE,
)
_MARKER_RE = re.compile(
    r"\bfinal[*_\s]+answer\b[*_\s]*(?:is\b|:|=)?|\banswer[*_\s]*(?:is\b|:|=)", re.IGNORECASE
)
_BOXED_RE = re.compile(r"\\boxed\{([^{}]{0,500})\}")


@dataclass(frozen=True)
class ParsedNumber:
    """A number as written. ``value`` has sign and nothing else applied: ``-$5.2m`` is -5.2."""

    text: str
    value: float
    decimals: int  # digits after the point as written, minus the exponent: 1.25e3 → -1
    significant_digits: int  # 0.0463 → 3, 1,200 → 4, 0 → 0
    fraction_digits: int = 0  # digits written after the point: 12.50 → 2
    percent: bool = False
    scale_exponent: int = 0  # 6 for "million"
    exact: bool = False  # a JSON number gold: no written precision to honour

    def readings(self) -> list[tuple[float, int]]:
        """Every (value, decimals) this number may mean; see the module docstring."""
        bases = [(self.value, self.decimals)]
        if self.scale_exponent:
            bases.append(
                (self.value * 10.0**self.scale_exponent, self.decimals - self.scale_exponent)
            )
        readings: list[tuple[float, int]] = []
        for value, decimals in bases:
            readings.append((value, decimals))
            if self.percent:
                readings.append((value / 100.0, decimals + 2))
        return readings


def parse_number(match: re.Match[str]) -> ParsedNumber | None:
    """The :class:`ParsedNumber` of one match of the number pattern."""
    mantissa = match.group("mantissa").replace(",", "")
    exponent = int(match.group("exponent") or 0)
    try:
        magnitude = Decimal(mantissa).scaleb(exponent)
    except InvalidOperation:
        return None
    if not magnitude.is_finite():
        return None
    _, fraction = mantissa.split(".", 1) if "." in mantissa else (mantissa, "")
    negative = (
        match.group("sign") in ("-", "−")
        or match.group("sign2") is not None
        or (match.group("open") is not None and match.group("close") is not None)
    )
    value = float(-magnitude if negative else magnitude)
    if not math.isfinite(value):
        return None
    scale = match.group("scale")
    return ParsedNumber(
        text=match.group(0).strip(),
        value=value,
        decimals=len(fraction) - exponent,
        significant_digits=len(mantissa.replace(".", "").lstrip("0")),
        fraction_digits=len(fraction),
        percent=match.group("percent") is not None,
        scale_exponent=_SCALES[scale.lower()] if scale else 0,
    )


def find_final_number(text: str) -> ParsedNumber | None:
    """The number ``text`` gives as its answer (rules in the module docstring), or None."""
    text = text.replace("\\%", "%").replace("\\$", "$")
    boxed = _BOXED_RE.findall(text)
    if boxed and (number := _first_number(boxed[-1])) is not None:
        return number
    markers = list(_MARKER_RE.finditer(text))
    if markers and (number := _first_number(text[markers[-1].end() :])) is not None:
        return number
    # Only the chosen match is parsed: a long answer full of numbers stays cheap.
    for match in reversed(list(_NUMBER_RE.finditer(text))):
        if (number := parse_number(match)) is not None:
            return number
    return None


def _first_number(text: str) -> ParsedNumber | None:
    for match in _NUMBER_RE.finditer(text):
        if (number := parse_number(match)) is not None:
            return number
    return None


class NumericMatchOptions(GraderOptions):
    """Options of :class:`NumericMatchGrader`."""

    rel_tol: float = Field(1e-4, ge=0, le=1, description="Relative tolerance for full credit.")
    abs_tol: float = Field(1e-6, ge=0, description="Absolute tolerance (matters near 0).")
    partial_rel_tol: float = Field(1e-2, ge=0, le=1, description="Relative error for partial.")
    partial_credit: float = Field(0.5, ge=0, le=1, description="Score of a rounding-level miss.")
    answer_field: str = Field("answer", min_length=1, description="Item field: the gold.")

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.partial_rel_tol < self.rel_tol:
            raise ValueError("partial_rel_tol must be at least rel_tol")
        return self


class NumericMatchGrader(Grader):
    """Numeric answer within tolerance of ``item["answer"]``; see the module docstring."""

    name: ClassVar[str] = "numeric_match"
    options_model: ClassVar[type[GraderOptions]] = NumericMatchOptions
    options: NumericMatchOptions

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        """Score ``answer``; the trajectory is not needed."""
        gold = _gold_number(item, self.options.answer_field)
        details: dict[str, Any] = {"gold": gold.text, "gold_value": gold.value}
        parsed = find_final_number(answer)
        if parsed is None:
            details["reason"] = "no number found in the answer"
            return GradeResult(score=0.0, details=details)
        details.update(answer=parsed.text, answer_value=parsed.value)

        best: tuple[float, str | None, float, float, float] | None = None
        for a_value, a_decimals in parsed.readings():
            for g_value, g_decimals in gold.readings():
                score, rule = self._credit(a_value, a_decimals, parsed, g_value, g_decimals, gold)
                error = _relative_error(a_value, g_value)
                candidate = (score, rule, error, a_value, g_value)
                # Highest score wins, then the smallest error; ties keep reading order.
                if best is None or (score, -error) > (best[0], -best[2]):
                    best = candidate
        if best is None:  # unreachable: readings() always has the number as written
            raise RuntimeError("no readings to compare")
        score, rule, error, a_value, g_value = best
        details.update(
            rule=rule,
            relative_error=error if math.isfinite(error) else None,
            answer_reading=a_value,
            gold_reading=g_value,
        )
        return GradeResult(score=score, details=details)

    def _credit(
        self,
        answer: float,
        answer_decimals: int,
        parsed: ParsedNumber,
        gold: float,
        gold_decimals: int,
        gold_number: ParsedNumber,
    ) -> tuple[float, str | None]:
        options = self.options
        if math.isclose(answer, gold, rel_tol=options.rel_tol, abs_tol=options.abs_tol):
            return 1.0, "within_tolerance"
        # A gold written with decimals is itself rounded; an answer that rounds to it is right.
        if (
            not gold_number.exact
            and gold_number.fraction_digits > 0
            and _within_half_unit(answer, gold, gold_decimals)
        ):
            return 1.0, "rounds_to_gold"
        if options.partial_credit > 0:
            if abs(answer - gold) <= options.partial_rel_tol * abs(gold):
                return options.partial_credit, "partial_relative_error"
            if parsed.significant_digits >= 2 and _within_half_unit(answer, gold, answer_decimals):
                return options.partial_credit, "partial_rounded_answer"
        return 0.0, None


def _within_half_unit(value: float, reference: float, decimals: int) -> bool:
    """|value - reference| is at most half a unit in the ``decimals``-th place."""
    half_unit = 0.5 * 10.0**-decimals
    # The slack absorbs binary floating point: 0.125 rounds to 0.13 as well as to 0.12.
    return abs(value - reference) <= half_unit * (1 + 1e-9) + 1e-12


def _relative_error(answer: float, gold: float) -> float:
    if gold == 0:
        return 0.0 if answer == 0 else math.inf
    return abs(answer - gold) / abs(gold)


def _gold_number(item: Mapping[str, Any], field: str) -> ParsedNumber:
    if field not in item or item[field] is None:
        raise ItemError(field, "missing: the dataset row must give the expected number")
    raw = item[field]
    if isinstance(raw, bool):
        raise ItemError(field, "must be a number or a numeric string, not a boolean")
    if isinstance(raw, (int, float)):
        if not math.isfinite(raw):
            raise ItemError(field, f"must be a finite number, got {raw!r}")
        return ParsedNumber(
            text=repr(raw), value=float(raw), decimals=0, significant_digits=0, exact=True
        )
    if isinstance(raw, str):
        parsed = find_final_number(raw)
        if parsed is None:
            raise ItemError(field, f"no number in {raw!r}")
        return parsed
    raise ItemError(field, f"must be a number or a numeric string, got {type(raw).__name__}")
