"""Build the repository-task examples from a real project's history: `six`
(https://github.com/benjaminp/six), whose commits change one small module and its tests.

    python examples/repo_tasks/build.py /path/to/a/clone/of/six

writes, beside this file:

- ``six.bundle``: six's history up to :data:`TIP` (2020-01-08, 506 commits), what
  ``orchestrator repo add six examples/repo_tasks/six.bundle`` registers;
- ``planning.jsonl``: Cognition-style planning rows: at the parent of a real commit, its
  subject as the request, the files it changed as ``gold_files`` (environment
  ``codebase-planning``, graded by ``file_f1``);
- ``swe.jsonl``: SWE-bench-style rows: at the parent of a commit that changed ``six.py`` and
  ``test_six.py``, its test change as ``test_patch``, its source change as ``gold_patch``,
  ``FAIL_TO_PASS`` the tests that fail before the gold patch and pass after it, and
  ``PASS_TO_PASS`` (at most 10) that pass both ways, found by running pytest in the
  sandboxes' base image (`make images` builds it); `orchestrator preflight --rows` checks
  them again in a sandbox (environment ``swe-tests``, graded by ``sandbox_tests``).

Needs git and Docker. Deterministic for a given clone: the same commits, in history order.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TIP = "10a2b75b8be7b68eacfa168834d9938b77d2d7e3"
"""six's "Add assertNotRegex. (#289)", 2020-01-08: the newest commit the bundle holds."""
REPO = "six"
BASE_IMAGE = os.environ.get("ORCH_BASE_IMAGE", "orchestrator/sandbox-base:latest")
HERE = Path(__file__).resolve().parent
PLANNING_ROWS = 24
SWE_ROWS = 10
PASS_TO_PASS_MAX = 10
SOURCE_FILES = {
    "six.py",
    "test_six.py",
    "documentation/index.rst",
    "CHANGES",
    "README",
    "README.rst",
}
NOT_A_TASK = re.compile(r"copyright|year|license|merge|release|version|typo|bump", re.IGNORECASE)
RESULT = re.compile(r"^(PASSED|FAILED|ERROR) (test_six\.py::\S+)", re.MULTILINE)


def git(repo: Path, *args: str, check: bool = True) -> str:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
    }
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=check
    )
    return done.stdout


def commits(repo: Path) -> list[tuple[str, str, str, list[str]]]:
    """(commit, parent, subject, files changed) of each non-merge commit up to TIP, oldest
    first."""
    log = git(repo, "log", "--reverse", "--no-merges", "--format=@@%H %P%n%s", "--name-only", TIP)
    found = []
    for block in log.split("@@")[1:]:
        lines = [line for line in block.splitlines() if line.strip()]
        ids = lines[0].split()
        if len(ids) != 2:
            continue  # the root commit has no parent
        found.append((ids[0], ids[1], lines[1], lines[2:]))
    return found


def outcomes(repo: Path, commit: str, patches: list[str]) -> dict[str, str]:
    """Each test of test_six.py at ``commit`` with ``patches`` applied: PASSED/FAILED/ERROR."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        git(repo, "worktree", "add", "--detach", "-q", str(tree), commit)
        try:
            for patch in patches:
                applied = subprocess.run(
                    ["git", "apply", "-"], cwd=tree, input=patch, text=True, capture_output=True
                )
                if applied.returncode != 0:
                    return {}
            # In the sandboxes' own image: its Python and pytest (and Debian's `py`, which
            # six's older tests use as py.test) decide what passes, not this host's.
            run = subprocess.run(
                [
                    "docker",
                    "run",
                    "--rm",
                    "--network=none",
                    "-v",
                    f"{tree}:/w",
                    "-w",
                    "/w",
                    BASE_IMAGE,
                    "python3",
                    "-m",
                    "pytest",
                    "-p",
                    "no:cacheprovider",
                    "-q",
                    "-rA",
                    "--tb=no",
                    "test_six.py",
                ],
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            git(repo, "worktree", "remove", "--force", str(tree))
    return {name: kind for kind, name in RESULT.findall(run.stdout)}


def planning_rows(history: list[tuple[str, str, str, list[str]]]) -> list[dict[str, Any]]:
    rows = []
    for commit, parent, subject, files in reversed(history):
        if not 1 <= len(files) <= 3 or not set(files) <= SOURCE_FILES or NOT_A_TASK.search(subject):
            continue
        rows.append(
            {
                "environment": "codebase-planning",
                "repo": REPO,
                "commit": parent,
                "request": subject,
                "gold_files": sorted(files),
                "source_commit": commit,
            }
        )
        if len(rows) == PLANNING_ROWS:
            break
    return rows


def swe_rows(repo: Path, history: list[tuple[str, str, str, list[str]]]) -> list[dict[str, Any]]:
    rows = []
    for commit, parent, subject, files in reversed(history):
        if "six.py" not in files or "test_six.py" not in files or NOT_A_TASK.search(subject):
            continue
        test_patch = git(repo, "diff", parent, commit, "--", "test_six.py")
        gold_patch = git(repo, "diff", parent, commit, "--", "six.py")
        before = outcomes(repo, parent, [test_patch])
        after = outcomes(repo, parent, [test_patch, gold_patch])
        fail_to_pass = sorted(
            t for t, kind in after.items() if kind == "PASSED" and before.get(t) != "PASSED"
        )
        pass_to_pass = sorted(
            t for t, kind in after.items() if kind == "PASSED" and before.get(t) == "PASSED"
        )
        print(f"{commit[:10]} {subject[:50]!r}: {len(fail_to_pass)} fail to pass", file=sys.stderr)
        if not fail_to_pass or not pass_to_pass:
            continue
        rows.append(
            {
                "environment": "swe-tests",
                "repo": REPO,
                "commit": parent,
                "request": subject,
                "gold_files": ["six.py"],
                "test_patch": test_patch,
                "gold_patch": gold_patch,
                "FAIL_TO_PASS": fail_to_pass,
                "PASS_TO_PASS": pass_to_pass[:PASS_TO_PASS_MAX],
                "source_commit": commit,
            }
        )
        if len(rows) == SWE_ROWS:
            break
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("clone", type=Path, help="a clone (bare or not) of benjaminp/six")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "six"
        subprocess.run(
            ["git", "clone", "-q", "--no-checkout", str(args.clone), str(work)], check=True
        )
        git(work, "checkout", "-q", "-B", "main", TIP)
        history = commits(work)
        bundle = HERE / "six.bundle"
        git(work, "bundle", "create", str(bundle), "HEAD", "main")
        planning = planning_rows(history)
        swe = swe_rows(work, history)
    for name, rows in (("planning.jsonl", planning), ("swe.jsonl", swe)):
        (HERE / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(
        f"{bundle.name}: {bundle.stat().st_size} bytes; {len(planning)} planning rows, "
        f"{len(swe)} SWE rows",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
