"""Unit tests of the graders: answer extraction, file F1, numeric match and the registry.

No sandbox or network is involved: graders are pure functions of (answer, item, trajectory).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.grading import (
    BUILTIN_GRADERS,
    FileF1Grader,
    Grader,
    GraderConfigError,
    GradeResult,
    GraderOptions,
    ItemError,
    NumericMatchGrader,
    extract_answer,
    extract_paths,
    find_final_number,
    get_grader,
    grade_sample,
    grader_names,
    normalise_path,
    resolve_grader,
)
from orchestrator.outcomes import Outcome
from orchestrator.state.models import TrajectoryStep

NO_STEPS: list[TrajectoryStep] = []
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def f1(answer: str, gold: Sequence[str], **options: Any) -> float:
    return FileF1Grader(**options).grade(answer, {"gold_files": list(gold)}, NO_STEPS).score


def f1_details(answer: str, gold: Sequence[str], **options: Any) -> dict[str, Any]:
    return FileF1Grader(**options).grade(answer, {"gold_files": list(gold)}, NO_STEPS).details


def numeric(answer: str, gold: Any, **options: Any) -> GradeResult:
    return NumericMatchGrader(**options).grade(answer, {"answer": gold}, NO_STEPS)


# ---------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------


def test_grade_result_rejects_non_finite_scores() -> None:
    assert GradeResult(score=0.5).details == {}
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="finite"):
            GradeResult(score=bad)


def test_unknown_option_is_a_config_error_naming_it_and_the_known_ones() -> None:
    with pytest.raises(GraderConfigError) as caught:
        FileF1Grader(max_predicitons=10)
    message = str(caught.value)
    assert "'file_f1'" in message
    assert "unknown option 'max_predicitons'" in message
    assert "max_predictions" in message  # the known options are listed


@pytest.mark.parametrize(
    ("grader", "options", "fragment"),
    [
        (FileF1Grader, {"max_predictions": 0}, "max_predictions"),
        (FileF1Grader, {"max_predictions": "many"}, "max_predictions"),
        (FileF1Grader, {"gold_field": ""}, "gold_field"),
        (NumericMatchGrader, {"rel_tol": -1}, "rel_tol"),
        (NumericMatchGrader, {"partial_credit": 2}, "partial_credit"),
        (NumericMatchGrader, {"rel_tol": 0.1, "partial_rel_tol": 0.01}, "partial_rel_tol"),
    ],
)
def test_invalid_option_values_are_config_errors(
    grader: type[Grader], options: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(GraderConfigError, match=fragment):
        grader(**options)


def test_options_are_typed_and_defaulted() -> None:
    grader = FileF1Grader(max_predictions=None)
    assert grader.options.max_predictions is None
    assert FileF1Grader().options.max_predictions == 50
    assert NumericMatchGrader(rel_tol=1e-3).options.rel_tol == 1e-3
    assert "FileF1Grader" in repr(grader)


def test_grade_is_deterministic_for_retries() -> None:
    grader = FileF1Grader()
    item = {"gold_files": ["a/b.py", "c.md"]}
    answer = "I would change a/b.py, x/y.py and README.md"
    first = grader.grade(answer, item, NO_STEPS)
    assert all(grader.grade(answer, item, NO_STEPS) == first for _ in range(3))
    json.dumps(first.details)  # details are JSON-serialisable


# ---------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        ({"output_text": "a.py"}, "a.py"),
        ({"output_text": "a.py", "output_json": {"files": ["b.py"]}}, "a.py"),
        ({"output_text": None, "output_json": {"files": ["b.py"]}}, '{"files": ["b.py"]}'),
        ({"output_text": "  ", "output_json": ["b.py"]}, '["b.py"]'),
        ({"output_json": {"z": 1, "a": 2}}, '{"a": 2, "z": 1}'),  # sort_keys
        ({"output_json": "raw text"}, "raw text"),
        ({"output_json": 42}, "42"),
        ({"choices": [{"message": {"content": "from chat"}}]}, "from chat"),
        (
            {
                "choices": [
                    {
                        "message": {
                            "content": [
                                {"type": "text", "text": "one "},
                                {"type": "image_url", "image_url": {"url": "x"}},
                                {"type": "output_text", "text": "two"},
                                {"text": {"value": " three"}},
                                " four",
                            ]
                        }
                    }
                ]
            },
            "one two three four",
        ),
        ({"output_text": None, "choices": [{"message": {"content": "late"}}]}, "late"),
        ({}, ""),
        ({"output_text": None, "output_json": None, "choices": None}, ""),
        ({"choices": []}, ""),
        ({"choices": [None]}, ""),
        ({"choices": [{"message": None}]}, ""),
        ({"choices": [{"message": {"content": None}}]}, ""),
        ({"choices": [{"message": {"content": [1, None, {"type": "refusal"}]}}]}, ""),
        ({"choices": "nope"}, ""),
        ({"output_text": object()}, ""),
        ({"output_json": {1: "a", "b": 2}}, ""),  # mixed keys cannot be sorted: skipped
        (None, ""),
        ("just a string", ""),
        (["a.py"], ""),
        (42, ""),
    ],
)
def test_extract_answer(sample: Any, expected: str) -> None:
    assert extract_answer(sample) == expected


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=20,
)


@FAST
@given(
    st.dictionaries(
        st.sampled_from(["output_text", "output_json", "choices", "other"]), _json_values
    )
    | _json_values
)
def test_extract_answer_never_raises(sample: Any) -> None:
    assert isinstance(extract_answer(sample), str)


# ---------------------------------------------------------------------------------------
# file_f1: normalising and extracting paths
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("src/app.py", "src/app.py"),
        ("./src/app.py", "src/app.py"),
        ("././src//app.py", "src/app.py"),
        ("/workspace/src/app.py", "src/app.py"),
        ("/src/app.py", "src/app.py"),
        ("src\\utils\\helpers.py", "src/utils/helpers.py"),
        ("`src/app.py`", "src/app.py"),
        ("'src/app.py',", "src/app.py"),
        ('"src/app.py".', "src/app.py"),
        ("src/app.py:42", "src/app.py"),
        ("src/app.py:10-20", "src/app.py"),
        ("src/app.py#L3-L9", "src/app.py"),
        ("src/a/./b.py", "src/a/b.py"),
        ("src/utils/", "src/utils"),
        ("Makefile", "Makefile"),
        ("../etc/passwd", None),
        ("src/../../x.py", None),
        ("src/..", None),
        ("", None),
        ("./", None),
        ("/workspace", None),
        ("`", None),
    ],
)
def test_normalise_path(raw: str, expected: str | None) -> None:
    assert normalise_path(raw) == expected


@pytest.mark.parametrize(
    ("answer", "paths", "answer_format"),
    [
        ('["a.py", "src/b.py"]', {"a.py", "src/b.py"}, "json"),
        ('{"files": ["a.py"], "paths": ["b/c.ts"]}', {"a.py", "b/c.ts"}, "json"),
        ('{"files": "a.py and src/b.py"}', {"a.py", "src/b.py"}, "json"),
        ('[{"path": "a.py", "why": "x"}, {"file": "b.go"}, 3, null, ["c/d.rs"]]', None, "json"),
        ('"[\\"a.py\\"]"', {"a.py"}, "json"),  # JSON-encoded twice
        ('Here you go:\n```json\n["a.py"]\n```\nnot x/y.py', {"a.py"}, "fenced_json"),
        ("```\nsrc/a.py\nsrc/b.py\n```", {"src/a.py", "src/b.py"}, "text"),
        ("src/a.py\nsrc/b.py\n", {"src/a.py", "src/b.py"}, "text"),
        (
            "- `src/a.py`\n* **src/b.py**\n1. c/Makefile",
            {"src/a.py", "src/b.py", "c/Makefile"},
            None,
        ),
        (
            "I would edit `src/app.py` and src/utils/helpers.py.",
            {"src/app.py", "src/utils/helpers.py"},
            "text",
        ),
        (
            "Change setup.py, README.md and the Dockerfile.",
            {"setup.py", "README.md", "Dockerfile"},
            None,
        ),
        ("See [the app](src/app.py) and [docs](https://x.io/a.md).", {"src/app.py"}, None),
        ("Files: ['src/a.py', \"src/b.py\"]", {"src/a.py", "src/b.py"}, "text"),
        ("Edit src\\win\\path.cs please", {"src/win/path.cs"}, None),
        ("touch .gitignore and config/.env", {".gitignore", "config/.env"}, None),
        ('{"answer": "src/a.py"}', {"src/a.py"}, "text"),  # no files/paths key: read as text
        ("", set(), "empty"),
        # Not paths: URLs, prose abbreviations, versions, numbers, frameworks, directories.
        (
            "See https://github.com/o/r/blob/main/x.py, www.example.com/a.py, github.com/o/r.md, "
            "e.g. i.e. U.S. etc. and/or I/O v1.2.3 3.14 Python 3.x Node.js .NET src/utils/ "
            "mailto:a@b.py file:///workspace/q.py",
            set(),
            "text",
        ),
    ],
)
def test_extract_paths(answer: str, paths: set[str] | None, answer_format: str | None) -> None:
    found, how = extract_paths(answer)
    normalised = {p for raw in found if (p := normalise_path(raw)) is not None}
    if paths is None:
        paths = {"a.py", "b.go", "c/d.rs"}
    assert normalised == paths
    if answer_format is not None:
        assert how == answer_format


# ---------------------------------------------------------------------------------------
# file_f1: scoring
# ---------------------------------------------------------------------------------------


def test_f1_arithmetic_and_details() -> None:
    details = f1_details('["a.py", "b.py", "x.py"]', ["a.py", "b.py", "c.py", "d.py"])
    assert details["precision"] == pytest.approx(2 / 3)
    assert details["recall"] == pytest.approx(2 / 4)
    assert details["f1"] == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))
    assert details["true_positives"] == ["a.py", "b.py"]
    assert details["false_positives"] == ["x.py"]
    assert details["false_negatives"] == ["c.py", "d.py"]
    assert details["predicted"] == ["a.py", "b.py", "x.py"]
    assert details["gold"] == ["a.py", "b.py", "c.py", "d.py"]
    assert details["unknown"] is None  # no repository listing in the item


@pytest.mark.parametrize(
    ("answer", "gold", "score"),
    [
        ("[]", [], 1.0),
        ("", [], 1.0),
        ("No file needs to change.", [], 1.0),
        ('["a.py"]', [], 0.0),
        ("", ["a.py"], 0.0),
        ("I don't know.", ["a.py"], 0.0),
        ('["a.py"]', ["a.py"], 1.0),
        ('["./a.py", "a.py", "/workspace/a.py"]', ["a.py"], 1.0),  # one file, three spellings
        ('["b.py"]', ["a.py"], 0.0),
        ('["A.py"]', ["a.py"], 0.0),  # case-sensitive, like the file system
        ('["a.py", "../a.py"]', ["a.py"], 2 / 3),  # a rejected path still costs precision
    ],
)
def test_f1_edge_cases(answer: str, gold: list[str], score: float) -> None:
    assert f1(answer, gold) == pytest.approx(score)


def test_rejected_paths_are_reported() -> None:
    details = f1_details('["a.py", "../secrets.py"]', ["a.py"])
    assert details["rejected"] == ["../secrets.py"]
    assert details["predicted"] == ["a.py"]


def test_unknown_paths_use_the_items_repository_listing() -> None:
    item = {"gold_files": ["a.py"], "repo_files": ["./a.py", "b.py", "c.py"]}
    result = FileF1Grader().grade('["a.py", "b.py", "ghost.py"]', item, NO_STEPS)
    assert result.details["false_positives"] == ["b.py", "ghost.py"]
    assert result.details["unknown"] == ["ghost.py"]
    assert result.score == pytest.approx(f1('["a.py", "b.py", "x.py"]', ["a.py"]))


def test_max_predictions_scores_zero_and_says_why() -> None:
    answer = json.dumps([f"f{i}.py" for i in range(11)])
    result = FileF1Grader(max_predictions=10).grade(answer, {"gold_files": ["f0.py"]}, NO_STEPS)
    assert result.score == 0.0
    assert "max_predictions=10" in result.details["reason"]
    assert FileF1Grader(max_predictions=11).grade(answer, {"gold_files": ["f0.py"]}, []).score > 0


def test_gold_field_option() -> None:
    grader = FileF1Grader(gold_field="edited")
    assert grader.grade('["a.py"]', {"edited": ["a.py"]}, NO_STEPS).score == 1.0


@pytest.mark.parametrize(
    "item",
    [
        {},
        {"gold_files": None},
        {"gold_files": 3},
        {"gold_files": "not json"},
        {"gold_files": '{"a": 1}'},
        {"gold_files": ["a.py", 3]},
        {"gold_files": ["../a.py"]},
        {"gold_files": [""]},
    ],
)
def test_bad_gold_is_an_item_error(item: dict[str, Any]) -> None:
    with pytest.raises(ItemError) as caught:
        FileF1Grader().grade('["a.py"]', item, NO_STEPS)
    assert caught.value.field == "gold_files"


def test_gold_as_json_text_is_accepted() -> None:
    item = {"gold_files": '["a.py", "./b.py"]'}
    assert FileF1Grader().grade("a.py b.py", item, NO_STEPS).score == 1.0


# --- property tests --------------------------------------------------------------------

_component = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
_extension = st.sampled_from(["py", "js", "ts", "md", "go", "rs", "json", "yaml", "txt"])
_path = st.builds(
    lambda dirs, stem, ext: "/".join([*dirs, f"{stem}.{ext}"]),
    st.lists(_component, max_size=3),
    _component,
    _extension,
)
_path_sets = st.lists(_path, max_size=8, unique=True)


def _render(paths: list[str], style: str, prefixes: list[str]) -> str:
    """The same set of paths written in one of the ways agents write answers."""
    written = [prefixes[i % len(prefixes)] + p for i, p in enumerate(paths)]
    if style == "json_list":
        return json.dumps(written)
    if style == "json_files":
        return json.dumps({"files": written, "reason": "because"})
    if style == "json_paths":
        return json.dumps({"paths": written}, indent=2)
    if style == "lines":
        return "\n".join(written)
    if style == "markdown":
        return "Files to edit:\n" + "\n".join(f"- `{p}`" for p in written)
    if style == "numbered":
        return "\n".join(f"{i}. {p}" for i, p in enumerate(written, 1))
    if style == "fenced":
        return f"My answer:\n```json\n{json.dumps(written)}\n```\nThanks."
    if style == "prose":
        if not written:
            return "Nothing needs to change."
        if len(written) == 1:
            return f"I would edit `{written[0]}`."
        return f"I would edit {', '.join(written[:-1])} and {written[-1]}."
    raise AssertionError(style)


_STYLES = ["json_list", "json_files", "json_paths", "lines", "markdown", "numbered", "fenced"]


@FAST
@given(
    paths=_path_sets,
    gold=_path_sets,
    style=st.sampled_from([*_STYLES, "prose"]),
    prefixes=st.lists(st.sampled_from(["", "./", "/workspace/", "/"]), min_size=1, max_size=3),
    data=st.data(),
)
def test_same_files_score_the_same_however_written(
    paths: list[str], gold: list[str], style: str, prefixes: list[str], data: st.DataObject
) -> None:
    reference = f1(json.dumps(sorted(paths)), gold)
    shuffled = data.draw(st.permutations(paths))
    # Named twice or in another order, the same set scores the same.
    assert f1(_render(list(shuffled) + list(shuffled[:2]), style, prefixes), gold) == reference


def _repository(root: str, size: int = 200) -> list[str]:
    extensions = ["py", "md", "json", "ts", "go"]
    return [f"{root}/pkg{i % 7}/mod_{i}.{extensions[i % 5]}" for i in range(size)]


@FAST
@given(
    root=_component,
    gold_indices=st.lists(st.integers(0, 199), min_size=2, max_size=2, unique=True),
    style=st.sampled_from([*_STYLES, "prose"]),
    data=st.data(),
)
def test_naming_every_file_in_the_repository_scores_low(
    root: str, gold_indices: list[int], style: str, data: st.DataObject
) -> None:
    repository = _repository(root)
    gold = [repository[i] for i in gold_indices]
    answer = _render(list(data.draw(st.permutations(repository))), style, ["", "./"])
    assert f1(answer, gold, max_predictions=None) < 0.2
    assert f1(answer, gold) == 0.0  # beyond the default max_predictions
    # Half the repository is no better, and still recalls both gold files.
    half = [p for i, p in enumerate(repository) if i % 2 == 0 or i in gold_indices]
    details = f1_details(_render(half, style, [""]), gold, max_predictions=None)
    assert details["recall"] == 1.0
    assert details["f1"] < 0.2


@FAST
@given(
    paths=_path_sets,
    gold=_path_sets,
    ghost=_path,
    style=st.sampled_from([*_STYLES, "prose"]),
)
def test_adding_a_nonexistent_path_never_raises_the_score(
    paths: list[str], gold: list[str], ghost: str, style: str
) -> None:
    ghost = "nonexistent/" + ghost
    before = f1(_render(paths, style, [""]), gold)
    after = f1(_render([*paths, ghost], style, [""]), gold)
    assert after <= before


@FAST
@given(answer=st.text(max_size=300), gold=_path_sets)
def test_any_answer_scores_within_bounds(answer: str, gold: list[str]) -> None:
    score = f1(answer, gold)
    assert 0.0 <= score <= 1.0


@FAST
@given(gold=st.lists(_path, min_size=1, max_size=6, unique=True), data=st.data())
def test_exact_gold_in_any_format_scores_one(gold: list[str], data: st.DataObject) -> None:
    style = data.draw(st.sampled_from([*_STYLES, "prose"]))
    assert f1(_render(gold, style, ["./"]), gold) == 1.0


# ---------------------------------------------------------------------------------------
# numeric_match
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value", "percent", "scale"),
    [
        ("42", 42.0, False, 0),
        ("1,234.5", 1234.5, False, 0),
        ("1,234,567", 1234567.0, False, 0),
        ("-5", -5.0, False, 0),
        ("−5", -5.0, False, 0),
        ("(5)", -5.0, False, 0),
        ("(1,234.5)", -1234.5, False, 0),
        ("($5.2 million)", -5.2, False, 6),
        ("-$5", -5.0, False, 0),
        ("$-5", -5.0, False, 0),
        ("+3.5", 3.5, False, 0),
        (".5", 0.5, False, 0),
        ("12.5%", 12.5, True, 0),
        ("12.5 percent", 12.5, True, 0),
        ("12.5 per cent", 12.5, True, 0),
        ("$1,234", 1234.0, False, 0),
        ("US$ 7", 7.0, False, 0),
        ("€3.2bn", 3.2, False, 9),
        ("£10k", 10.0, False, 3),
        ("USD 12.5 million", 12.5, False, 6),
        ("12.5 million USD", 12.5, False, 6),
        ("12.5 mn", 12.5, False, 6),
        ("3 billion dollars", 3.0, False, 9),
        ("5M", 5.0, False, 6),
        ("2 thousand", 2.0, False, 3),
        ("1.5 trillion", 1.5, False, 12),
        ("1e6", 1e6, False, 0),
        ("2.5E-3", 2.5e-3, False, 0),
        ("5 months", 5.0, False, 0),
        ("5 km", 5.0, False, 0),
        ("The answer is 12.5%.", 12.5, True, 0),
        ("Answer: 7 (down from 9)", 7.0, False, 0),
        ("**Answer:** -3", -3.0, False, 0),
        ("Final answer 12", 12.0, False, 0),
        ("Revenue rose from 100 to 120, a 20% increase", 20.0, True, 0),
        ("In Q3 FY2019 it was 4.5", 4.5, False, 0),
        ("range 10-12", 12.0, False, 0),
        ("8 - 3", 3.0, False, 0),
        ("so \\boxed{12.5\\%} overall 99", 12.5, True, 0),
        ("values 1,2345", 2345.0, False, 0),
    ],
)
def test_find_final_number(text: str, value: float, percent: bool, scale: int) -> None:
    parsed = find_final_number(text)
    assert parsed is not None
    assert parsed.value == pytest.approx(value)
    assert parsed.percent is percent
    assert parsed.scale_exponent == scale


@pytest.mark.parametrize("text", ["", "no numbers here", "version 1.2.3", "Q3 FY2019", "n/a"])
def test_find_final_number_none(text: str) -> None:
    assert find_final_number(text) is None


@pytest.mark.parametrize(
    ("answer", "gold", "score"),
    [
        # Exact and within rel_tol.
        ("42", 42, 1.0),
        ("42.000001", 42, 1.0),
        ("1,234.5", "1234.5", 1.0),
        ("$1,234.50", 1234.5, 1.0),
        ("-5", -5, 1.0),
        ("(5)", -5.0, 1.0),
        ("0", 0, 1.0),
        ("0.0000001", 0, 1.0),  # abs_tol near zero
        # Percent: either reading when either side has a % sign.
        ("12.5%", 0.125, 1.0),
        ("12.5%", 12.5, 1.0),
        ("0.125", "12.5%", 1.0),
        ("12.5", "12.5%", 1.0),
        ("12.5", 0.125, 0.0),  # no % anywhere: 12.5 is not 0.125
        # Scale words: scaled or as written.
        ("$5.2 million", 5.2, 1.0),
        ("$5.2 million", 5_200_000, 1.0),
        ("5200000", "5.2 million", 1.0),
        ("3.2bn", 3200, 0.0),  # thousands of millions is not a reading we guess
        # Strict about units: a unit on both sides is read alike on both.
        ("1197%", 11.97, 0.0),  # a percent over 100 is not a ratio of a plain gold
        ("1197%", "11.97%", 0.0),
        ("11.97%", "11.97%", 1.0),
        ("100%", 1, 1.0),
        ("-5%", -0.05, 1.0),
        ("457.6 thousand", "457.6 million", 0.0),
        ("0.4576 billion", "457.6 million", 1.0),
        ("457.6 million", "457.6 million", 1.0),
        ("457,600 thousand", "$457.6m", 1.0),
        # A gold written rounded accepts an answer that rounds to it.
        ("14.12%", "14.1%", 1.0),
        ("0.1412", "14.1%", 1.0),
        ("14.2%", "14.1%", 0.5),  # 0.7% off: partial
        ("12.4", "12", 0.0),  # an integer gold is exact: no rounds_to_gold
        # Partial: rounding-level misses.
        ("12.35", 12.3456, 0.5),
        ("12.3", 12.3456, 0.5),
        ("12", 12.3456, 0.5),  # the gold rounded to the answer's precision, 2 digits
        ("100.5", 100, 0.5),  # 0.5% relative error
        ("1.5", 1.46, 0.5),
        # No credit.
        ("0", 0.4, 0.0),  # one significant digit cannot claim rounding
        ("1", 1.46, 0.0),
        ("13", 12.3456, 0.0),
        ("5", -5, 0.0),
        ("102", 100, 0.0),
        ("1", 0, 0.0),
    ],
)
def test_numeric_scores(answer: str, gold: Any, score: float) -> None:
    assert numeric(answer, gold).score == score


@pytest.mark.parametrize(
    ("answer", "gold", "unit", "score"),
    [
        ("457.6 thousand", 457.6, "million", 0.0),
        ("457.6 million", 457.6, "million", 1.0),
        ("457,600,000", 457.6, "million", 1.0),
        ("457.6", 457.6, "million", 1.0),  # a bare answer in the table's units
        ("150%", 1.5, "ratio", 1.0),
        ("12.5%", 12.5, "ratio", 0.0),  # declared a ratio: 12.5% is 0.125
        ("12.5%", 0.125, "ratio", 1.0),
        ("0.125", 0.125, "ratio", 1.0),
        ("1197%", 11.97, "percent", 0.0),
        ("11.97%", 11.97, "percent", 1.0),
        ("0.1197", 11.97, "percent", 1.0),
        ("11.97", 11.97, " Percent ", 1.0),
    ],
)
def test_numeric_declared_units(answer: str, gold: Any, unit: str, score: float) -> None:
    grader = NumericMatchGrader()
    assert grader.grade(answer, {"answer": gold, "answer_unit": unit}, NO_STEPS).score == score


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ({"answer": 5, "answer_unit": "furlongs"}, "unknown unit 'furlongs'"),
        ({"answer": 5, "answer_unit": 6}, "must be a unit"),
        ({"answer": "5%", "answer_unit": "ratio"}, "writes its own"),
    ],
)
def test_numeric_bad_declared_unit_is_an_item_error(item: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ItemError, match=fragment) as caught:
        NumericMatchGrader().grade("5", item, NO_STEPS)
    assert caught.value.field == "answer_unit"
    custom = NumericMatchGrader(unit_field="unit")
    assert custom.grade("5", {"answer": 5, "answer_unit": "furlongs"}, NO_STEPS).score == 1.0


def test_numeric_units_on_both_sides_are_compared_scaled() -> None:
    result = numeric("457.6 thousand", "457.6 million")
    assert result.score == 0.0
    assert (result.details["answer_reading"], result.details["gold_reading"]) == (457_600, 457.6e6)


def test_numeric_details() -> None:
    result = numeric("The answer is 12.5%.", 0.125)
    assert result.details["answer"] == "12.5%"
    assert result.details["answer_value"] == 12.5
    assert result.details["rule"] == "within_tolerance"
    assert result.details["answer_reading"] == pytest.approx(0.125)
    json.dumps(result.details)


def test_unparseable_answer_scores_zero_with_a_reason() -> None:
    result = numeric("I could not find it.", 5)
    assert result.score == 0.0
    assert result.details["reason"] == "no number found in the answer"


def test_numeric_options_change_the_credit() -> None:
    assert numeric("100.5", 100, partial_credit=0.25).score == 0.25
    assert numeric("100.5", 100, partial_credit=0).score == 0.0
    assert numeric("100.5", 100, rel_tol=0.01).score == 1.0
    assert numeric("103", 100, partial_rel_tol=0.05).score == 0.5
    grader = NumericMatchGrader(answer_field="exe_ans")
    assert grader.grade("3", {"exe_ans": 3}, NO_STEPS).score == 1.0


@pytest.mark.parametrize(
    "item",
    [
        {},
        {"answer": None},
        {"answer": "n/a"},
        {"answer": True},
        {"answer": [1]},
        {"answer": math.nan},
    ],
)
def test_bad_numeric_gold_is_an_item_error(item: dict[str, Any]) -> None:
    with pytest.raises(ItemError) as caught:
        NumericMatchGrader().grade("5", item, NO_STEPS)
    assert caught.value.field == "answer"


@FAST
@given(st.text(max_size=200))
def test_numeric_never_raises_on_any_answer(answer: str) -> None:
    assert numeric(answer, 5).score in (0.0, 0.5, 1.0)


@FAST
@given(
    st.decimals(
        min_value=-(10**12), max_value=10**12, allow_nan=False, allow_infinity=False, places=4
    )
)
def test_numeric_round_trips_formatted_numbers(value: Any) -> None:
    gold = float(value)
    for text in (f"{gold:,.4f}", f"{gold:.4f}", f"The answer is {gold:,.4f}."):
        assert numeric(text, gold).score == 1.0, text
    if gold < 0:
        assert numeric(f"({-gold:,.4f})", gold).score == 1.0


# ---------------------------------------------------------------------------------------
# Adversarial answers: an RL policy will try anything, and a slow grade is a timed-out one
# ---------------------------------------------------------------------------------------

_PATHOLOGICAL = [
    "[" * 200_000,
    "[a](" * 100_000,
    "```" * 100_000,
    '{"files":' * 50_000,
    "(" * 200_000 + "5",
    "1," * 200_000,
    ":1" * 200_000 + "x",
    "a.py:" + "1:" * 200_000,
    "\\boxed{" * 100_000,
    "answer: " * 100_000,
    "." * 400_000,
    "src/" + "." * 400_000,
    "a/" * 200_000,
]


@pytest.mark.parametrize("answer", _PATHOLOGICAL, ids=lambda a: repr(a[:12]))
@pytest.mark.timeout(30)
def test_pathological_answers_are_graded_in_linear_time(answer: str) -> None:
    # Each took minutes when a pattern could backtrack quadratically; now well under 1 s.
    started = time.perf_counter()
    assert 0.0 <= f1(answer, ["a.py"]) <= 1.0
    assert numeric(answer, 5).score in (0.0, 0.5, 1.0)
    assert time.perf_counter() - started < 10


# ---------------------------------------------------------------------------------------
# Registry and custom graders
# ---------------------------------------------------------------------------------------


class MyGrader(Grader):
    """A custom grader, as a deployment would write one: exact match with an option."""

    name: ClassVar[str] = "my_exact"

    class Options(GraderOptions):
        expected_field: str = "expected"

    options_model: ClassVar[type[GraderOptions]] = Options
    options: Options

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        field = self.options.expected_field
        if field not in item:
            raise ItemError(field, "missing")
        hit = answer.strip() == str(item[field])
        return GradeResult(score=1.0 if hit else 0.0, details={"steps": len(trajectory)})


class NotAGrader:
    name = "nope"


class AbstractGrader(Grader):
    name: ClassVar[str] = "abstract"


class NamelessGrader(Grader):
    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        return GradeResult(score=0.0)


class BadReturnGrader(Grader):
    name: ClassVar[str] = "bad_return"

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        return 1.0  # type: ignore[return-value]


THIS_MODULE = __name__  # importable under this name while the tests run


def test_builtin_names() -> None:
    assert grader_names() == ["file_f1", "multi", "numeric_match", "sandbox_tests", "score_model"]
    assert set(BUILTIN_GRADERS) == set(grader_names())
    assert isinstance(get_grader("file_f1"), FileF1Grader)
    assert isinstance(get_grader("numeric_match", {"rel_tol": 0.01}), NumericMatchGrader)
    assert (
        get_grader(" file_f1 ", {"max_predictions": 3}).options
        == FileF1Grader(max_predictions=3).options
    )


def test_unknown_builtin_lists_the_names() -> None:
    with pytest.raises(GraderConfigError, match="file_f1, multi, numeric_match"):
        get_grader("f1")


def test_builtin_with_bad_options() -> None:
    with pytest.raises(GraderConfigError, match="unknown option 'nope'"):
        get_grader("file_f1", {"nope": 1})
    with pytest.raises(GraderConfigError, match="mapping"):
        get_grader("file_f1", [("max_predictions", 1)])  # type: ignore[arg-type]


@pytest.mark.parametrize("separator", [":", "."])
def test_custom_grader_from_the_test_module(separator: str) -> None:
    grader = get_grader(f"{THIS_MODULE}{separator}MyGrader", {"expected_field": "want"})
    assert isinstance(grader, MyGrader)
    assert grader.grade("yes", {"want": "yes"}, NO_STEPS).score == 1.0


def test_custom_grader_from_a_module_on_sys_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    package = tmp_path / "site_graders"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "exact.py").write_text(
        "from orchestrator.grading import Grader, GradeResult\n"
        "class Exact(Grader):\n"
        "    name = 'exact'\n"
        "    def grade(self, answer, item, trajectory):\n"
        "        return GradeResult(score=float(answer == item['gold']))\n"
        "    class Inner(Grader):\n"
        "        name = 'inner'\n"
        "        def grade(self, answer, item, trajectory):\n"
        "            return GradeResult(score=0.25)\n"
    )
    (package / "broken.py").write_text("import a_module_that_does_not_exist_anywhere\n")
    (package / "crashes.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def forget_modules() -> None:
        for module in [m for m in sys.modules if m.split(".")[0] == "site_graders"]:
            del sys.modules[module]

    forget_modules()
    request.addfinalizer(forget_modules)

    assert get_grader("site_graders.exact:Exact").grade("a", {"gold": "a"}, []).score == 1.0
    assert get_grader("site_graders.exact.Exact").grade("a", {"gold": "b"}, []).score == 0.0
    assert get_grader("site_graders.exact:Exact.Inner").grade("", {}, []).score == 0.25
    with pytest.raises(GraderConfigError, match="unknown option 'x'"):
        get_grader("site_graders.exact:Exact", {"x": 1})
    with pytest.raises(
        GraderConfigError, match=re.escape("importing 'site_graders.broken' failed")
    ):
        resolve_grader("site_graders.broken:Anything")
    with pytest.raises(GraderConfigError, match="boom at import"):
        resolve_grader("site_graders.crashes:Anything")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("no_such_package_xyz.graders:G", "module 'no_such_package_xyz.graders' not found"),
        ("orchestrator.grading.no_such_module:G", "not found"),
        (f"{THIS_MODULE}:Missing", "has no attribute 'Missing'"),
        (f"{THIS_MODULE}:NotAGrader", "not a subclass"),
        (f"{THIS_MODULE}:THIS_MODULE", "not a subclass"),
        (f"{THIS_MODULE}:AbstractGrader", "abstract"),
        (f"{THIS_MODULE}:NamelessGrader", "name"),
        ("orchestrator.grading:Grader", "abstract"),
        (":MyGrader", "package.module:ClassName"),
        ("module:", "package.module:ClassName"),
        ("", "non-empty"),
    ],
)
def test_custom_grader_errors(spec: str, fragment: str) -> None:
    with pytest.raises(GraderConfigError, match=re.escape(fragment)):
        get_grader(spec)


def _step(seq: int) -> TrajectoryStep:
    return TrajectoryStep(
        seq=seq,
        call_id=f"call_{seq}",
        tool="shell",
        arguments={"command": "ls"},
        outcome=Outcome.OK,
        exit_code=0,
        output="a.py\n",
        started_at=datetime(2025, 1, 1, tzinfo=UTC),
        duration_ms=1.0,
    )


def test_grade_sample_reads_the_answer_and_passes_the_trajectory() -> None:
    grader = get_grader(f"{THIS_MODULE}:MyGrader")
    sample = {"choices": [{"message": {"content": [{"type": "text", "text": "yes"}]}}]}
    result = grade_sample(grader, sample, {"expected": "yes"}, [_step(1), _step(2)])
    assert result == GradeResult(score=1.0, details={"steps": 2})
    json_sample = {"output_json": {"files": ["./a.py"]}}
    assert grade_sample(get_grader("file_f1"), json_sample, {"gold_files": ["a.py"]}, []).score == 1


def test_grade_sample_errors_keep_their_kind() -> None:
    with pytest.raises(ItemError) as caught:
        grade_sample(get_grader(f"{THIS_MODULE}:MyGrader"), {"output_text": "x"}, {}, [])
    assert caught.value.field == "expected"
    # A grader returning garbage is a grader failure (503), not a score.
    with pytest.raises(TypeError, match="not a GradeResult"):
        grade_sample(BadReturnGrader(), {"output_text": "x"}, {}, [])
