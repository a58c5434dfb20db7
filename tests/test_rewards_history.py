"""Exports, regrades and the listing read the whole history, against a real Redis: past
10,000 rollouts, and never a run ticket or an E2B process table (hashes below a record's
key) taken for a rollout; the filters select by creation
time, environment, outcome and grade; the export's files keep one schema whatever the rows
hold (views/rewards.py)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from orchestrator.config import Settings
from orchestrator.outcomes import Outcome
from orchestrator.state.forget import forget_deployment
from orchestrator.state.models import RolloutSource, RolloutState, TrajectoryStep
from orchestrator.state.records import GradeInputs, ListingCursor, Rollout, RolloutStore
from orchestrator.views.rewards import (
    ExportFormat,
    ExportWriter,
    RolloutFilter,
    export_row,
    matching_ids,
    stored,
)
from orchestrator.views.rollouts import cursor_of, list_rollouts

pytestmark = pytest.mark.anyio
START = 1_700_000_000.0


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture()
async def store(settings: Settings) -> AsyncIterator[RolloutStore]:
    own = settings.model_copy(
        update={"deployment": f"{settings.deployment}-rh{uuid.uuid4().hex[:4]}"}
    )
    connected = RolloutStore.connect(own)
    yield connected
    await connected.close()
    forget_deployment(own.redis_url, own.deployment)


def _record(n: int, *, environment: str = "a", score: float | None = 1.0) -> Rollout:
    return Rollout(
        rollout_id=f"r{n:06d}",
        source=RolloutSource.AGENT_RFT if n % 2 else RolloutSource.API,
        environment=environment,
        image="unused",
        state=RolloutState.GRADED if score is not None else RolloutState.INFRA_FAILED,
        outcome=Outcome.OK if score is not None else Outcome.INFRA_ERROR,
        created_at=START + n,
        last_activity=START + n,
        score=score,
        item={"gold_files": ["a.py"]} if n % 3 else {"answer": n, "unit": "%"},
        grade_details={"n": n} if n % 2 else {"other": [n]},
        grade_inputs=GradeInputs(
            answer=str(n), sample={"output_text": str(n)}, grader="file_f1", grader_digest="d"
        )
        if score is not None
        else None,
    )


async def test_the_whole_history_is_read_and_listed_past_10000(store: RolloutStore) -> None:
    """Exports and regrades read every record; the listing pages through every one, newest
    first, none lost or repeated where a page ends inside rollouts created at one time (3
    at each here); a deployment whose index lost its oldest gets them back by reindex."""
    count = 10_025
    records = [_record(n).model_copy(update={"created_at": START + n // 3}) for n in range(count)]
    for start in range(0, count, 50):  # within the store's connection pool
        assert all(await asyncio.gather(*(store.create(r) for r in records[start : start + 50])))
    # Hashes below a record's key (a run ticket, an E2B process table) are not rollouts.
    await store.redis.hset(store.keys.rollout("r000001") + ":run:call_1", mapping={"x": "1"})
    await store.redis.hset(store.keys.rollout("r000002") + ":e2b:processes", mapping={"1": "{}"})
    ids = await matching_ids(store)
    assert sorted(ids) == sorted(r.rollout_id for r in records)

    async def every_page(limit: int, state: str | None = None) -> list[str]:
        listed: list[str] = []
        cursor = None
        while page := await list_rollouts(store, limit=limit, state=state, before=cursor):
            listed += [summary.rollout_id for summary in page]
            cursor = cursor_of(page[-1])
        return listed

    newest_first = [
        r.rollout_id
        for r in sorted(records, key=lambda r: (r.created_at, r.rollout_id), reverse=True)
    ]
    assert await every_page(997) == newest_first
    failed = [i for i in newest_first if int(i[1:]) % 7 == 0]
    marked = [f"r{n:06d}" for n in range(0, count, 7)]
    for start in range(0, len(marked), 50):
        chunk = marked[start : start + 50]
        await asyncio.gather(*(store.update(i, state=RolloutState.INFRA_FAILED) for i in chunk))
    assert await every_page(400, state="infra_failed") == failed
    # A time as the cursor: every rollout created before it.
    before = await list_rollouts(
        store, limit=5, before=ListingCursor(created_at=START + 10, rollout_id="")
    )
    assert [s.rollout_id for s in before] == [f"r{n:06d}" for n in (29, 28, 27, 26, 25)]

    # An index cut to its newest 10,000, as releases before this one kept it.
    await store.redis.zremrangebyrank(store.keys.index, 0, count - 10_001)
    assert len(await every_page(5000)) == 10_000
    assert await store.reindex() == count
    assert await every_page(5000) == newest_first


async def test_the_filters_select_by_time_environment_outcome_and_grade(
    store: RolloutStore,
) -> None:
    records = [
        _record(0),
        _record(1, environment="b"),
        _record(2, score=None),
        _record(3),
        _record(4, score=0.25),
    ]
    for record in records:
        assert await store.create(record)
    ids = await matching_ids(store)

    async def chosen(selection: RolloutFilter) -> list[str]:
        return [r.rollout_id async for r, _ in stored(store, ids, selection)]

    assert await chosen(RolloutFilter()) == [r.rollout_id for r in records]
    assert await chosen(RolloutFilter(since=START + 1, until=START + 3)) == ["r000001", "r000002"]
    assert await chosen(RolloutFilter(environment="b")) == ["r000001"]
    assert await chosen(RolloutFilter(outcome=Outcome.INFRA_ERROR)) == ["r000002"]
    assert "r000002" not in await chosen(RolloutFilter(graded=True))


async def test_an_export_of_unlike_rows_keeps_one_schema(
    store: RolloutStore, tmp_path: Path
) -> None:
    step = TrajectoryStep(
        seq=1,
        call_id="call_1",
        tool="shell",
        arguments='{"command": "ls"}',
        outcome=Outcome.OK,
        exit_code=0,
        output="a.py\n",
        started_at=datetime(2026, 1, 1, tzinfo=UTC),
        duration_ms=3.5,
    )
    rows = [
        export_row(_record(1), [step]),
        export_row(_record(2, score=None), []),
        export_row(_record(3), [step.model_copy(update={"arguments": {"command": "ls"}})]),
    ]
    for form in ExportFormat:
        path = tmp_path / f"out.{form.value}"
        writer = ExportWriter(path, form)
        for row in rows:
            writer.write(row)
        writer.close()
        if form == ExportFormat.PARQUET:
            table = pq.read_table(path).to_pylist()
        else:
            table = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["rollout_id"] for r in table] == ["r000001", "r000002", "r000003"]
        assert table[0]["trace_id"] == "r000001" and table[1]["trace_id"] is None
        assert table[1]["score"] is None and table[1]["answer"] is None
        assert json.loads(table[0]["item"]) == {"gold_files": ["a.py"]}
        assert json.loads(table[2]["trajectory"][0]["arguments"]) == {"command": "ls"}
        assert table[0]["trajectory"][0]["started_at"] == "2026-01-01T00:00:00+00:00"
    empty = tmp_path / "empty.parquet"
    writer = ExportWriter(empty, ExportFormat.PARQUET)
    writer.close()
    assert pq.read_table(empty).num_rows == 0
    assert time.time() > START
