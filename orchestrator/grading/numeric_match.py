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

Units: a side with a ``%`` sign may be read as written (12.5 "points") or as a ratio
(0.125); a side with a scale word scaled (5.2e6) or as written (5.2, in a table's units,
as FinQA golds are while prose answers spell the unit out). The answer scores the best
over the pairs of an answer reading and a gold reading that agree about units:

* a unit written on both sides is read alike on both: ``12.5%`` against ``"12.5%"`` compares
  12.5 with 12.5, never 1197% as 11.97 with ``"11.97%"`` as 11.97; ``457.6 thousand`` against
  ``"457.6 million"`` compares 457,600 with 457,600,000 (and ``0.4576 billion`` matches it);
* a percent against a plain number: as written (``12.5%`` matches 12.5), or as a ratio only
  when the plain number is at most 1 in size (``12.5%`` matches 0.125, ``1197%`` does not
  match 11.97); ``0.125`` matches a gold of ``"12.5%"`` the same way;
* a bare ``12.5`` never matches 0.125 (no ``%`` anywhere says a percent is meant);
* a scale word against a plain number: either reading (``$5.2 million`` matches 5.2 and
  5,200,000).

A row can declare its gold's unit in ``answer_unit`` (option ``unit_field``): ``percent``
(the gold is in points, as if written with ``%``), ``ratio`` (a percent answer is read as a
ratio whatever its size: ``150%`` matches 1.5, and ``12.5%`` no longer matches 12.5), or a
scale word (``million``: the gold is in millions, so ``457.6 thousand`` does not match 457.6
and ``457.6 million`` does). A gold that writes its own unit and declares one, or an
unknown unit, is an :class:`~orchestrator.grading.base.ItemError`.

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
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from enum import StrEnum
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

    ratio: bool = False  # declared a ratio by the row: a percent answer is read as one

    def readings(self) -> list[Reading]:
        """Every way this number may be meant; see the module docstring."""
        scales: list[tuple[float, int, Scale | None]] = [(self.value, self.decimals, None)]
        if self.scale_exponent:
            scales = [
                (
                    self.value * 10.0**self.scale_exponent,
                    self.decimals - self.scale_exponent,
                    Scale.SCALED,
                ),
                (self.value, self.decimals, Scale.UNSCALED),
            ]
        readings: list[Reading] = []
        for value, decimals, scale in scales:
            if self.percent:
                readings.append(Reading(value, decimals, Percent.POINTS, scale))
                readings.append(Reading(value / 100.0, decimals + 2, Percent.RATIO, scale))
            else:
                readings.append(Reading(value, decimals, None, scale))
        return readings


class Percent(StrEnum):
    """How a number written with ``%`` is read: as written (12.5) or as a ratio (0.125)."""

    POINTS = "points"
    RATIO = "ratio"


class Scale(StrEnum):
    """How a number written with a scale word is read: scaled (5.2e6) or as written (5.2,
    in a table's units)."""

    SCALED = "scaled"
    UNSCALED = "unscaled"


@dataclass(frozen=True)
class Reading:
    """One meaning of a written number: its value, its written precision, and which
    readings of its percent sign and scale word it takes (None: it has none)."""

    value: float
    decimals: int
    percent: Percent | None
    scale: Scale | None


def comparable(answer: Reading, gold: Reading, gold_is_ratio: bool) -> bool:
    """Whether an answer reading may be compared with a gold reading: a unit written on
    both sides must be read the same way on both; read away on one side only, it must be
    a reading the other side's plain number can mean (module docstring, "Units")."""
    return _percents_agree(answer, gold, gold_is_ratio) and _scales_agree(answer.scale, gold.scale)


def _percents_agree(answer: Reading, gold: Reading, gold_is_ratio: bool) -> bool:
    if answer.percent is None and gold.percent is None:
        return True
    if answer.percent is not None and gold.percent is not None:
        # 1197% is not 11.97%: the two are read alike or not at all.
        return answer.percent == gold.percent == Percent.POINTS
    if gold_is_ratio:
        return answer.percent == Percent.RATIO
    percent, plain = (answer, gold) if answer.percent is not None else (gold, answer)
    if percent.percent == Percent.POINTS:
        return True
    # A plain number read as a ratio of a percent: only a ratio up to 1 (100%) reads so,
    # else 1197% would match 11.97 written for 11.97%.
    return abs(plain.value) <= 1.0 + 1e-12


def _scales_agree(answer: Scale | None, gold: Scale | None) -> bool:
    if answer is None or gold is None:
        return True
    # Both sides name a scale: 457.6 thousand is not 457.6 million.
    return answer == gold == Scale.SCALED


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
    unit_field: str = Field(
        "answer_unit",
        min_length=1,
        description="Item field declaring the gold's unit, when the row has it: percent, "
        "ratio, or a scale word (thousand, million, billion, ...).",
    )

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
        gold = _declared_unit(
            _gold_number(item, self.options.answer_field), item, self.options.unit_field
        )
        details: dict[str, Any] = {"gold": gold.text, "gold_value": gold.value}
        parsed = find_final_number(answer)
        if parsed is None:
            details["reason"] = "no number found in the answer"
            return GradeResult(score=0.0, details=details)
        details.update(answer=parsed.text, answer_value=parsed.value)

        best: tuple[float, str | None, float, float, float] | None = None
        for a in parsed.readings():
            for g in gold.readings():
                if not comparable(a, g, gold.ratio):
                    continue
                score, rule = self._credit(a.value, a.decimals, parsed, g.value, g.decimals, gold)
                error = _relative_error(a.value, g.value)
                candidate = (score, rule, error, a.value, g.value)
                # Highest score wins, then the smallest error; ties keep reading order.
                if best is None or (score, -error) > (best[0], -best[2]):
                    best = candidate
        if best is None:  # unreachable: the readings as written always agree
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


def _declared_unit(gold: ParsedNumber, item: Mapping[str, Any], field: str) -> ParsedNumber:
    """``gold`` with the unit the row declares in ``field`` (absent: as written)."""
    unit = item.get(field)
    if unit is None:
        return gold
    known = "percent, ratio, " + ", ".join(sorted(_SCALES))
    if not isinstance(unit, str):
        raise ItemError(field, f"must be a unit ({known}), got {type(unit).__name__}")
    word = unit.strip().lower()
    if gold.percent or gold.scale_exponent:
        raise ItemError(field, f"declares {unit!r}, and the gold {gold.text!r} writes its own")
    if word in ("percent", "%"):
        return replace(gold, percent=True)
    if word == "ratio":
        return replace(gold, ratio=True)
    if word in _SCALES:
        return replace(gold, scale_exponent=_SCALES[word])
    raise ItemError(field, f"unknown unit {unit!r} (known: {known})")


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
