"""A small real project with a real history, for the SWE-style grader's tests
(tests/e2e/test_sandbox_tests.py): ``calc``, a git repository whose first commit has two
bugs (``mul`` ignores the sign of its second argument, ``power`` multiplies) and whose
second commit fixes both and adds the tests that show it. A dataset row is made the way
SWE-bench makes one: the codebase at the buggy commit, the second commit's test changes as
``test_patch``, the tests it makes pass as ``FAIL_TO_PASS``, the first commit's as
``PASS_TO_PASS``; the second commit's source change is the gold fix.

Built here, not vendored: ``build(root)`` writes and commits it (about 50 ms).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

BUGGY = '''\
"""Arithmetic, by hand."""


def add(a: int, b: int) -> int:
    return a + b


def mul(a: int, b: int) -> int:
    result = 0
    for _ in range(abs(b)):
        result += a
    return result


def power(base: int, exponent: int) -> int:
    return base * exponent
'''

MUL_FIXED = BUGGY.replace(
    "        result += a\n    return result\n",
    "        result += a\n    return result if b >= 0 else -result\n",
)
FIXED = MUL_FIXED.replace(
    "    return base * exponent\n",
    "    result = 1\n    for _ in range(exponent):\n        result = mul(result, base)\n"
    "    return result\n",
)

CONFTEST = """\
import pytest


@pytest.fixture()
def two() -> int:
    return 2
"""

PYTEST_INI = "[pytest]\ntestpaths = tests\n"

TESTS = """\
from calc import add, mul


def test_add(two):
    assert add(two, 3) == 5


def test_mul_positive(two):
    assert mul(two, 3) == 6
"""

NEW_TESTS = """

def test_mul_negative(two):
    assert mul(3, -two) == -6


def test_mul_both_negative(two):
    assert mul(-3, -two) == 6


def test_power(two):
    from calc import power

    assert power(two, 5) == 32
"""

FAIL_TO_PASS = [
    "tests/test_calc.py::test_mul_negative",
    "tests/test_calc.py::test_mul_both_negative",
    "tests/test_calc.py::test_power",
]
PASS_TO_PASS = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_mul_positive"]

GIT_ENV = {
    "GIT_AUTHOR_NAME": "calc",
    "GIT_AUTHOR_EMAIL": "calc@localhost",
    "GIT_COMMITTER_NAME": "calc",
    "GIT_COMMITTER_EMAIL": "calc@localhost",
    "PATH": "/usr/bin:/bin",
}


@dataclass(frozen=True)
class Project:
    repo: Path
    base_commit: str
    fix_commit: str
    test_patch: str
    gold_patch: str

    def row(self, codebase: str, environment: str, **fields: object) -> dict[str, object]:
        """A SWE-bench-style row of this project at its buggy commit."""
        return {
            "environment": environment,
            "codebase": codebase,
            "request": "mul ignores the sign of b, and power multiplies: fix both.",
            "test_patch": self.test_patch,
            "FAIL_TO_PASS": FAIL_TO_PASS,
            "PASS_TO_PASS": PASS_TO_PASS,
            **fields,
        }


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args],
        check=True,
        capture_output=True,
        text=True,
        env={**GIT_ENV, "HOME": str(repo)},
    )
    return done.stdout


def build(root: Path) -> Project:
    """The project as a git repository under ``root``, with its two commits."""
    repo = root / "calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text(BUGGY)
    (repo / "conftest.py").write_text(CONFTEST)
    (repo / "pytest.ini").write_text(PYTEST_INI)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "calc: add, mul and power")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc" / "__init__.py").write_text(FIXED)
    (repo / "tests" / "test_calc.py").write_text(TESTS + NEW_TESTS)
    _git(repo, "commit", "-qam", "Fix mul for a negative b, and power")
    fix = _git(repo, "rev-parse", "HEAD").strip()
    return Project(
        repo=repo,
        base_commit=base,
        fix_commit=fix,
        test_patch=_git(repo, "diff", base, fix, "--", "tests"),
        gold_patch=_git(repo, "diff", base, fix, "--", "calc"),
    )
