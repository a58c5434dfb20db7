"""The row checks of ``orchestrator preflight --rows``: what a dataset's rows need before a
job is paid for, checked through the rollout API as a trainer would reach it
(docs/datasets.md):

- the row starts a rollout at all: its environment, its codebase or its repository and
  commit exist (else the API's 422 names which);
- its ``gold_files`` exist at that commit (a planning row whose answer is not in the tree
  scores nothing whatever the agent does);
- a SWE-style row (``FAIL_TO_PASS``): run untouched, its fail-to-pass tests fail and its
  pass-to-pass tests pass; with its ``gold_patch`` applied (``git apply`` in the sandbox),
  every one passes: the row can tell a fix from no fix.

Each check runs in a sandbox of its own, closed after it.
"""

from __future__ import annotations

import secrets
import shlex
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, Field

from orchestrator.client.errors import OrchestratorError
from orchestrator.client.sync import Rollout, RolloutClient


class RowCheck(BaseModel):
    """One check of one row."""

    line: int
    what: str
    ok: bool
    detail: str = ""
    ms: float | None = None


class RowReport(BaseModel):
    line: int
    checks: list[RowCheck] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def check_rows(
    client: RolloutClient,
    rows: list[tuple[int, dict[str, Any]]],
    *,
    parallel: int = 4,
    progress: Callable[[], None] | None = None,
) -> list[RowReport]:
    """Check each ``(line, row)``, ``parallel`` rows at a time; reports in line order."""

    def one(numbered: tuple[int, dict[str, Any]]) -> RowReport:
        line, row = numbered
        report = RowReport(line=line)
        try:
            _check(client, line, row, report)
        except OrchestratorError as exc:
            report.checks.append(
                RowCheck(line=line, what="the orchestrator", ok=False, detail=str(exc))
            )
        if progress is not None:
            progress()
        return report

    with ThreadPoolExecutor(max(1, parallel)) as pool:
        return list(pool.map(one, rows))


def _start(
    client: RolloutClient, line: int, row: dict[str, Any], report: RowReport
) -> Rollout | None:
    try:
        rollout = client.rollout(item=row)
    except OrchestratorError as exc:
        report.checks.append(
            RowCheck(line=line, what="the row starts a rollout", ok=False, detail=str(exc))
        )
        return None
    where = rollout.created.codebase or rollout.created.environment
    report.checks.append(
        RowCheck(line=line, what="the row starts a rollout", ok=True, detail=where)
    )
    return rollout


def _check(client: RolloutClient, line: int, row: dict[str, Any], report: RowReport) -> None:
    rollout = _start(client, line, row, report)
    if rollout is None:
        return
    fail_to_pass = row.get("FAIL_TO_PASS")
    with rollout:
        gold = row.get("gold_files")
        if isinstance(gold, list) and gold:
            paths = " ".join(shlex.quote(str(p)) for p in gold)
            ran = rollout.call(
                "shell", {"command": f'for f in {paths}; do [ -e "$f" ] || echo "$f"; done'}
            )
            missing = [p for p in ran.output.splitlines() if p and p != "(no output)"]
            report.checks.append(
                RowCheck(
                    line=line,
                    what="its gold files exist at the commit",
                    ok=not missing,
                    detail=f"missing: {', '.join(missing)}" if missing else f"{len(gold)} files",
                )
            )
        if not fail_to_pass:
            return
        before = rollout.grade(answer="")
    report.checks.append(_tests_before(line, before.details))
    patch = row.get("gold_patch")
    if not isinstance(patch, str) or not patch.strip():
        report.checks.append(
            RowCheck(
                line=line,
                what="its tests pass with the gold patch",
                ok=False,
                detail="the row has no gold_patch",
            )
        )
        return
    fixed = _start(client, line, row, RowReport(line=line))
    if fixed is None:
        return
    with fixed:
        marker = f"ORCH_PATCH_{secrets.token_hex(8)}"
        applied = fixed.call(
            "shell", {"command": f"git apply --whitespace=nowarn <<'{marker}'\n{patch}{marker}\n"}
        )
        if applied.exit_code != 0:
            report.checks.append(
                RowCheck(
                    line=line,
                    what="its tests pass with the gold patch",
                    ok=False,
                    detail=f"the gold patch does not apply: {applied.output[-300:]}",
                )
            )
            return
        after = fixed.grade(answer="")
    report.checks.append(_tests_after(line, after.details))


def _outcomes(details: dict[str, Any], part: str) -> dict[str, str]:
    found = details.get(part)
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def _tests_before(line: int, details: dict[str, Any]) -> RowCheck:
    passing = [t for t, o in _outcomes(details, "fail_to_pass").items() if o == "passed"]
    broken = [t for t, o in _outcomes(details, "pass_to_pass").items() if o != "passed"]
    problems = []
    if passing:
        problems.append(f"FAIL_TO_PASS passing already: {', '.join(passing[:5])}")
    if broken:
        problems.append(f"PASS_TO_PASS not passing: {', '.join(broken[:5])}")
    if not _outcomes(details, "fail_to_pass"):
        problems.append(f"no test outcome: {details.get('reason', details)}")
    return RowCheck(
        line=line,
        what="its tests fail before the gold patch",
        ok=not problems,
        detail="; ".join(problems)
        or f"{len(_outcomes(details, 'fail_to_pass'))} fail, "
        f"{len(_outcomes(details, 'pass_to_pass'))} pass",
    )


def _tests_after(line: int, details: dict[str, Any]) -> RowCheck:
    outcomes = {**_outcomes(details, "fail_to_pass"), **_outcomes(details, "pass_to_pass")}
    failing = [f"{t} ({o})" for t, o in outcomes.items() if o != "passed"]
    return RowCheck(
        line=line,
        what="its tests pass with the gold patch",
        ok=bool(outcomes) and not failing,
        detail=f"not passing: {', '.join(failing[:5])}" if failing else f"{len(outcomes)} pass",
    )
