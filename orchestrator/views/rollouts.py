"""Rollouts as operators look them up: a filtered listing, newest first, and one in full.

A rollout is found by its id; an Agent RFT rollout's id is its ``trace_id``
(api/agent_rft.py), so a trace id finds it too. The listing walks the store's index of
rollouts by creation time (every rollout, paged by a cursor: the last one's creation time
and id), plus, on the first page, live rollouts the index does not hold (made before it).
"""

from __future__ import annotations

import time

from orchestrator.state.models import RolloutSource
from orchestrator.state.records import ListingCursor, Rollout, RolloutStore
from orchestrator.views.models import RolloutDetail, RolloutSummary

_PAGE = 500


def summarize(rollout: Rollout, calls: int, now: float) -> RolloutSummary:
    """The listing's view of one record."""
    return RolloutSummary(
        rollout_id=rollout.rollout_id,
        trace_id=rollout.rollout_id if rollout.source == RolloutSource.AGENT_RFT else None,
        source=rollout.source,
        tenant=rollout.tenant,
        environment=rollout.environment,
        codebase=rollout.codebase,
        state=rollout.state,
        outcome=rollout.outcome,
        calls=calls,
        score=rollout.score,
        host=rollout.sandbox.host if rollout.sandbox is not None else rollout.host,
        sandbox_id=rollout.sandbox.sandbox_id if rollout.sandbox is not None else None,
        pool_hit=rollout.pool_hit,
        created_at=rollout.created_at,
        age_s=max(0.0, now - rollout.created_at),
        infra_cause=(rollout.infra_failure or {}).get("cause"),
    )


async def summaries(store: RolloutStore, rollout_ids: list[str]) -> list[RolloutSummary]:
    """Summaries of the rollouts among ``rollout_ids`` that have a record (two round trips)."""
    records = await store.get_many(rollout_ids)
    counts = await store.call_counts(rollout_ids)
    now = time.time()
    return [summarize(r, n, now) for r, n in zip(records, counts, strict=True) if r is not None]


def _matches(
    summary: RolloutSummary, state: str | None, outcome: str | None, tenant: str | None
) -> bool:
    if state is not None and summary.state != state:
        return False
    if tenant is not None and summary.tenant != tenant:
        return False
    return outcome is None or summary.outcome == outcome


async def list_rollouts(
    store: RolloutStore,
    *,
    state: str | None = None,
    outcome: str | None = None,
    limit: int = 50,
    before: ListingCursor | None = None,
    tenant: str | None = None,
) -> list[RolloutSummary]:
    """The newest ``limit`` rollouts in ``state`` with ``outcome`` of ``tenant`` (None:
    any), older than ``before`` (the cursor of the previous page's last one,
    :func:`cursor_of`), over the whole history."""
    found: dict[str, RolloutSummary] = {}
    cursor = before
    while len(found) < limit:
        page = await store.indexed_before(cursor, _PAGE)
        if not page:
            break
        for summary in await summaries(store, [rollout_id for rollout_id, _ in page]):
            if _matches(summary, state, outcome, tenant) and len(found) < limit:
                found[summary.rollout_id] = summary
        last_id, last_time = page[-1]
        cursor = ListingCursor(created_at=last_time, rollout_id=last_id)
    if before is None:
        # Live rollouts the index may not hold (made before it kept every rollout).
        live = [i for i in await store.live_ids() if i not in found]
        for summary in await summaries(store, live):
            if _matches(summary, state, outcome, tenant):
                found[summary.rollout_id] = summary
    newest = sorted(found.values(), key=lambda s: (s.created_at, s.rollout_id), reverse=True)
    return newest[:limit]


def cursor_of(summary: RolloutSummary) -> ListingCursor:
    """Where the next page starts, after ``summary``."""
    return ListingCursor(created_at=summary.created_at, rollout_id=summary.rollout_id)


async def rollout_detail(store: RolloutStore, rollout_id: str) -> RolloutDetail | None:
    """One rollout with its trajectory; None when there is no such rollout."""
    rollout = await store.get(rollout_id)
    if rollout is None:
        return None
    steps = await store.trajectory(rollout_id)
    calls = await store.call_count(rollout_id)
    return RolloutDetail(
        summary=summarize(rollout, calls, time.time()),
        item=rollout.item,
        sandbox_ready_at=rollout.sandbox_ready_at,
        graded_at=rollout.graded_at,
        closed_at=rollout.closed_at,
        last_activity=rollout.last_activity,
        calls_in_flight=rollout.calls_in_flight,
        grade_details=rollout.grade_details,
        grade_inputs=rollout.grade_inputs,
        infra_failure=rollout.infra_failure,
        trajectory=steps,
    )
