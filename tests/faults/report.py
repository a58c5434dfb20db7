"""One row per fault: what the batch saw, computed from the trainer's results, the rollout
records and the sandboxes' ledgers; written as JSON lines and printed as a table at the end
of the run (conftest.py's ``pytest_terminal_summary``)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.faults.trainer import Result

REPORT_ENV = "ORCH_FAULTS_REPORT"
"""The JSON-lines file rows go to; set by conftest.py in the controlling process."""


@dataclass
class Row:
    fault: str
    rollouts: int
    affected: int
    """Rollouts the fault touched: its victims, the flagged, and any that saw a 5xx."""
    flagged: int
    """Records in state infra_failed."""
    wrongly_scored: int
    """Infra-harmed rollouts (victims, flagged, discarded) with any score: must be 0."""
    agent_wrongly_flagged: int
    """Rollouts whose agent broke its own sandbox that were flagged, or not scored as their
    answer deserves: must be 0."""
    unaffected: int
    unaffected_right: int
    """Unaffected rollouts scored exactly as expected: must equal ``unaffected``."""
    leaked: int
    """The deployment's containers still on the daemon after the reaper ran: must be 0."""
    lost: int
    """Calls answered 200 whose command never ran (not in the ledger): must be 0."""
    twice: int
    """Calls whose command ran more than once: must be 0."""
    seconds: float
    notes: str = ""
    clean: bool = False
    """A batch run after the fault was over: every rollout must be unaffected."""

    def problems(self) -> list[str]:
        found = []
        if self.wrongly_scored:
            found.append(f"{self.wrongly_scored} infra-harmed rollout(s) got a score")
        if self.agent_wrongly_flagged:
            found.append(
                f"{self.agent_wrongly_flagged} agent-caused rollout(s) flagged or unscored"
            )
        if self.unaffected_right != self.unaffected:
            found.append(
                f"only {self.unaffected_right} of {self.unaffected} unaffected rollouts "
                "scored right"
            )
        if self.leaked:
            found.append(f"{self.leaked} container(s) leaked")
        if self.lost or self.twice:
            found.append(f"{self.lost} call(s) lost, {self.twice} run twice")
        if self.clean and self.affected:
            found.append(f"{self.affected} rollout(s) affected after the fault was over")
        return found


def flagged(result: Result) -> bool:
    record = result.record or {}
    return record.get("state") == "infra_failed" or bool(record.get("infra_failure"))


def stored_score(result: Result) -> float | None:
    score = (result.record or {}).get("score")
    return None if score is None else float(score)


def ledger_check(result: Result) -> tuple[int, int, bool, int]:
    """(lost, twice, checked, ledger writes that failed) for one rollout's ledger."""
    failed = sum(c.ledger_write_failed for c in result.calls)
    if result.ledger is None:
        return 0, 0, False, failed
    start = 0
    for index, call in enumerate(result.calls):
        if call.step.resets_ledger:
            if not call.ok:
                return 0, 0, False, failed  # deleted or not: nothing can be told
            start = index + 1
    counts = Counter(result.ledger)
    expected = [
        c for c in result.calls[start:] if c.step.ledger and c.ok and not c.ledger_write_failed
    ]
    lost = sum(1 for c in expected if counts[c.call_id] == 0)
    twice = sum(1 for n in counts.values() if n > 1)
    return lost, twice, True, failed


def make_row(
    fault: str,
    results: Iterable[Result],
    *,
    victims: Iterable[str] = (),
    leaked: int,
    leaked_volumes: int = 0,
    seconds: float,
    notes: Iterable[str] = (),
    clean: bool = False,
) -> Row:
    results = list(results)
    victim_ids = set(victims)
    is_flagged = {r.trace_id for r in results if flagged(r)}
    harmed = victim_ids | is_flagged | {r.trace_id for r in results if r.discarded}
    affected = harmed | {r.trace_id for r in results if r.saw_5xx}
    wrongly = [
        r
        for r in results
        if r.trace_id in harmed and (r.score is not None or stored_score(r) is not None)
    ]
    agent = [r for r in results if r.plan.agent_caused is not None]
    agent_wrong = [r for r in agent if r.trace_id in is_flagged or r.score != r.plan.expected_score]
    unaffected = [r for r in results if r.trace_id not in affected]
    right = [r for r in unaffected if r.score == r.plan.expected_score]
    recovered = [
        r for r in results if r.trace_id in affected - harmed and r.score == r.plan.expected_score
    ]
    lost = twice = checked = write_failed = 0
    for r in results:
        one_lost, one_twice, one_checked, one_failed = ledger_check(r)
        lost += one_lost
        twice += one_twice
        checked += one_checked
        write_failed += one_failed
    codes = Counter(
        f"{a.status} {a.code}".strip()
        for r in results
        for a in [*(a for c in r.calls for a in c.attempts), *r.grade_attempts]
        if a.status != 200
    )
    text = [
        f"discarded {sum(1 for r in results if r.discarded)}",
        f"recovered after a 5xx {len(recovered)}",
        f"ledgers read {checked}/{len(results)}",
    ]
    if write_failed:
        text.append(f"ledger appends failed (disk full) {write_failed}")
    if leaked_volumes:
        text.append(f"volumes leaked {leaked_volumes}")
    if codes:
        text.append("non-200: " + ", ".join(f"{k} x{n}" for k, n in sorted(codes.items())))
    causes = Counter(
        str(((r.record or {}).get("infra_failure") or {}).get("cause"))
        for r in results
        if flagged(r)
    )
    if causes:
        text.append("flagged as: " + ", ".join(f"{k} x{n}" for k, n in sorted(causes.items())))
    return Row(
        fault=fault,
        rollouts=len(results),
        affected=len(affected),
        flagged=len(is_flagged),
        wrongly_scored=len(wrongly),
        agent_wrongly_flagged=len(agent_wrong),
        unaffected=len(unaffected),
        unaffected_right=len(right),
        leaked=leaked,
        lost=lost,
        twice=twice,
        seconds=round(seconds, 1),
        notes="; ".join([*text, *notes]),
        clean=clean,
    )


def write_row(row: Row) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    with Path(path).open("a") as out:
        out.write(json.dumps(asdict(row)) + "\n")


def read_rows(path: Path) -> list[Row]:
    if not path.exists():
        return []
    return [Row(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


COLUMNS = [
    ("fault", "fault"),
    ("rollouts", "rollouts"),
    ("affected", "affected"),
    ("flagged", "flagged infra_failed"),
    ("wrongly_scored", "wrongly scored"),
    ("agent_wrongly_flagged", "agent-caused wrongly flagged"),
    ("unaffected_right", "unaffected right/unaffected"),
    ("leaked", "containers leaked"),
    ("lost_twice", "calls lost/twice"),
    ("seconds", "s"),
]


def table(rows: list[Row]) -> list[str]:
    """The rows as a text table, then each row's notes."""
    cells = [
        [
            row.fault,
            str(row.rollouts),
            str(row.affected),
            str(row.flagged),
            str(row.wrongly_scored),
            str(row.agent_wrongly_flagged),
            f"{row.unaffected_right}/{row.unaffected}",
            str(row.leaked),
            f"{row.lost}/{row.twice}",
            f"{row.seconds:.0f}",
        ]
        for row in rows
    ]
    headers = [title for _, title in COLUMNS]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return " | ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    out = [line(headers), "-+-".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    out.append("")
    for row in rows:
        problems = row.problems()
        status = "FAILED: " + "; ".join(problems) if problems else "ok"
        out.append(f"{row.fault}: {status}. {row.notes}")
    return out
