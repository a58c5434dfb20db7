"""Stored rewards, read back: every rollout exported with its grade (JSONL or Parquet, for
``datasets.load_dataset``), and stored rollouts scored again by another environment's
grader without touching their scores (``orchestrator export`` and ``orchestrator regrade``,
docs/graders.md).

Both read the whole history (state/records.RolloutStore.every_id), not only the listing
index's newest 10,000, and filter records by creation time, environment and outcome.

The export's schema is fixed, so any mix of environments loads as one table: what has no
fixed shape (the row, the sample, the grade's details, an infrastructure failure, a tool
call's arguments) is a JSON string, and times are Unix seconds (a step's start, ISO 8601).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field

from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.grading import (
    GradeContext,
    GraderConfigError,
    ItemError,
    get_grader,
    grade_context,
)
from orchestrator.outcomes import Outcome
from orchestrator.state.models import RolloutSource, TrajectoryStep
from orchestrator.state.records import Rollout, RolloutStore

_BATCH = 500


class RolloutFilter(BaseModel):
    """Which stored rollouts an export or a regrade reads (None: any)."""

    since: float | None = Field(None, description="Created at or after (Unix seconds).")
    until: float | None = Field(None, description="Created before (Unix seconds).")
    environment: str | None = None
    outcome: Outcome | None = None
    graded: bool = Field(False, description="Only rollouts with a stored score.")
    tenant: str | None = Field(None, description="Only this tenant's (docs/tenancy.md).")

    def admits(self, rollout: Rollout) -> bool:
        """Whether ``rollout`` is one of those asked for."""
        if self.since is not None and rollout.created_at < self.since:
            return False
        if self.until is not None and rollout.created_at >= self.until:
            return False
        if self.environment is not None and rollout.environment != self.environment:
            return False
        if self.outcome is not None and rollout.outcome != self.outcome:
            return False
        if self.tenant is not None and rollout.tenant != self.tenant:
            return False
        return not self.graded or rollout.score is not None


async def matching_ids(store: RolloutStore) -> list[str]:
    """Every rollout id of the deployment (the count a progress bar needs first)."""
    ids: list[str] = []
    async for batch in store.every_id():
        ids += batch
    return ids


async def stored(
    store: RolloutStore,
    ids: list[str],
    selection: RolloutFilter,
    *,
    progress: Callable[[int], None] | None = None,
) -> AsyncIterator[tuple[Rollout, list[TrajectoryStep]]]:
    """The rollouts among ``ids`` that ``selection`` admits, oldest first within each batch
    of reads, with their trajectories (two round trips a batch)."""
    for start in range(0, len(ids), _BATCH):
        batch = ids[start : start + _BATCH]
        records = [r for r in await store.get_many(batch) if r is not None]
        admitted = sorted((r for r in records if selection.admits(r)), key=_created)
        steps = await store.trajectories([r.rollout_id for r in admitted])
        for rollout, trajectory in zip(admitted, steps, strict=True):
            yield rollout, trajectory
        if progress is not None:
            progress(len(batch))


def _created(rollout: Rollout) -> float:
    return rollout.created_at


# --- export ---------------------------------------------------------------------------


class ExportFormat(StrEnum):
    JSONL = "jsonl"
    PARQUET = "parquet"


STEP_SCHEMA = pa.struct(
    [
        ("seq", pa.int64()),
        ("call_id", pa.string()),
        ("tool", pa.string()),
        ("arguments", pa.string()),
        ("outcome", pa.string()),
        ("exit_code", pa.int64()),
        ("output", pa.string()),
        ("truncated", pa.bool_()),
        ("error_kind", pa.string()),
        ("started_at", pa.string()),
        ("duration_ms", pa.float64()),
    ]
)
SCHEMA = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("trace_id", pa.string()),
        ("source", pa.string()),
        ("tenant", pa.string()),
        ("environment", pa.string()),
        ("codebase", pa.string()),
        ("state", pa.string()),
        ("outcome", pa.string()),
        ("score", pa.float64()),
        ("created_at", pa.float64()),
        ("graded_at", pa.float64()),
        ("closed_at", pa.float64()),
        ("item", pa.string()),
        ("answer", pa.string()),
        ("sample", pa.string()),
        ("grader", pa.string()),
        ("grader_digest", pa.string()),
        ("environment_digest", pa.string()),
        ("grade_details", pa.string()),
        ("infra_failure", pa.string()),
        ("trajectory", pa.list_(STEP_SCHEMA)),
    ]
)
"""One exported rollout (docs/graders.md, "Export")."""


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), sort_keys=True)


def export_row(rollout: Rollout, trajectory: list[TrajectoryStep]) -> dict[str, Any]:
    """One rollout as a row of :data:`SCHEMA`."""
    inputs = rollout.grade_inputs
    return {
        "rollout_id": rollout.rollout_id,
        "trace_id": rollout.rollout_id if rollout.source == RolloutSource.AGENT_RFT else None,
        "source": rollout.source.value,
        "tenant": rollout.tenant,
        "environment": rollout.environment,
        "codebase": rollout.codebase,
        "state": rollout.state.value,
        "outcome": rollout.outcome.value if rollout.outcome else None,
        "score": rollout.score,
        "created_at": rollout.created_at,
        "graded_at": rollout.graded_at,
        "closed_at": rollout.closed_at,
        "item": _json(rollout.item),
        "answer": inputs.answer if inputs else None,
        "sample": _json(inputs.sample) if inputs else None,
        "grader": inputs.grader if inputs else None,
        "grader_digest": inputs.grader_digest if inputs else None,
        "environment_digest": rollout.environment_digest,
        "grade_details": _json(rollout.grade_details),
        "infra_failure": _json(rollout.infra_failure),
        "trajectory": [
            {
                "seq": step.seq,
                "call_id": step.call_id,
                "tool": step.tool,
                "arguments": step.arguments
                if isinstance(step.arguments, str)
                else _json(step.arguments),
                "outcome": step.outcome.value,
                "exit_code": step.exit_code,
                "output": step.output,
                "truncated": step.truncated,
                "error_kind": step.error_kind,
                "started_at": step.started_at.isoformat(),
                "duration_ms": step.duration_ms,
            }
            for step in trajectory
        ],
    }


class ExportWriter:
    """Rows to one file, JSONL or Parquet, written as they come (a batch at a time)."""

    def __init__(self, path: Path, form: ExportFormat) -> None:
        self.path = path
        self.form = form
        self.rows = 0
        self._pending: list[dict[str, Any]] = []
        self._jsonl = path.open("w", encoding="utf-8") if form == ExportFormat.JSONL else None
        self._parquet = pq.ParquetWriter(path, SCHEMA) if form == ExportFormat.PARQUET else None

    def write(self, row: dict[str, Any]) -> None:
        self.rows += 1
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row, separators=(",", ":")) + "\n")
            return
        self._pending.append(row)
        if len(self._pending) >= _BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._parquet is not None and self._pending:
            self._parquet.write_table(pa.Table.from_pylist(self._pending, schema=SCHEMA))
        self._pending = []

    def close(self) -> None:
        """Finish the file (Parquet's footer); a file with no rows is still a valid one."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._parquet is not None:
            self._flush()
            self._parquet.close()


# --- regrade --------------------------------------------------------------------------


class Regraded(BaseModel):
    """One stored rollout scored again: its stored score and the new grader's, or why
    it could not be."""

    rollout_id: str
    environment: str
    old_score: float | None
    new_score: float | None = None
    new_details: dict[str, Any] | None = None
    skipped: str | None = Field(None, description="Why it was not scored again.")
    error: str | None = Field(None, description="The new grader failed: never a score.")


class RegradeReport(BaseModel):
    """``orchestrator regrade --json``: every rollout read, and the summary."""

    grader_environment: str
    grader: str
    grader_digest: str
    rollouts: list[Regraded]
    regraded: int
    changed: int
    skipped: int
    errors: int
    old_mean: float | None
    new_mean: float | None


class Regrader:
    """Another environment's grader, applied to stored grade inputs."""

    def __init__(self, registry: EnvironmentRegistry, environment: str) -> None:
        """Raises UnknownEnvironment, or GraderConfigError for a grader that does not build."""
        self.environment = environment
        self.config = registry.get(environment).grader
        self.grader = get_grader(self.config.name, self.config.options)

    def regrade(self, rollout: Rollout, trajectory: list[TrajectoryStep]) -> Regraded:
        """``rollout`` scored by this grader (pure: nothing stored)."""
        entry = Regraded(
            rollout_id=rollout.rollout_id, environment=rollout.environment, old_score=rollout.score
        )
        inputs = rollout.grade_inputs
        if inputs is None:
            return entry.model_copy(update={"skipped": "no stored answer (never graded here)"})
        if self.grader.uses_sandbox():
            return entry.model_copy(
                update={"skipped": "its grader needs the sandbox, gone since: its verdict stands"}
            )
        context = GradeContext(
            answer=inputs.answer, item=rollout.item, trajectory=trajectory, sample=inputs.sample
        )
        try:
            result = grade_context(self.grader, context)
        except ItemError as exc:
            return entry.model_copy(update={"error": f"the row cannot be graded: {exc}"})
        except GraderConfigError as exc:
            return entry.model_copy(update={"error": f"grader misconfigured: {exc}"})
        except Exception as exc:  # noqa: BLE001 - a grader's bug is reported, never a score
            return entry.model_copy(update={"error": f"grader failed: {exc!r}"})
        return entry.model_copy(update={"new_score": result.score, "new_details": result.details})

    def report(self, rollouts: Iterable[Regraded]) -> RegradeReport:
        """The summary of ``rollouts``."""
        entries = list(rollouts)
        scored = [e for e in entries if e.new_score is not None]
        olds = [e.old_score for e in scored if e.old_score is not None]
        news = [e.new_score for e in scored if e.new_score is not None]
        return RegradeReport(
            grader_environment=self.environment,
            grader=self.config.name,
            grader_digest=self.config.digest,
            rollouts=entries,
            regraded=len(scored),
            changed=sum(1 for e in scored if e.old_score != e.new_score),
            skipped=sum(1 for e in entries if e.skipped),
            errors=sum(1 for e in entries if e.error),
            old_mean=sum(olds) / len(olds) if olds else None,
            new_mean=sum(news) / len(news) if news else None,
        )
