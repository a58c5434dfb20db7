"""The Redis primary killed, or hung, mid-burst, on a deployment that reaches Redis through Sentinel
(tests/redis_ha.py: a primary, two replicas, three Sentinels; conftest.failover_stack),
with the worker's claims and results on a replica before they count.

While a batch of rollouts is in flight (one of them in a 3-second call), the primary is
SIGKILLed (its connections reset at once), or SIGSTOPped (a hung process, or a host cut
off: its connections stay open and nothing is ever answered, so each client finds out by
its own reply timeout). What the trainer must be able to rely on, checked as the other faults are
(test_faults.py, report.py):

- every call answered 200 ran exactly once (the sandboxes' ledgers); every other call was
  answered 5xx, none left without an answer;
- every rollout in flight at the failover is discarded, never scored: its record was made
  under the old primary, which may have taken writes the replica never got, so its grade
  is a 503 ``state_failover`` (docs/failure-model.md, "Redis failover");
- the service resumes by itself: the time from the fault to the first call answered 200
  is measured and bounded, and a fresh batch afterwards scores exactly right;
- nothing is leaked on the daemon once the reaper has run.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.faults.infra import FaultStack
from tests.faults.report import flagged
from tests.faults.test_faults import (
    VICTIM,
    B,
    _dump,
    batch,
    check,
    finish,
    ledger_shows,
    run_batch,
)
from tests.faults.trainer import Result, Trainer
from tests.redis_ha import DOWN_AFTER_MS

pytestmark = [pytest.mark.xdist_group("faults"), pytest.mark.slow]

# From the fault to the first call answered 200 again: the Sentinels' down-after (1 s
# here), their vote and the promotion (about a second), then each client's next retry
# (a quarter second apart), Celery's consumer reconnecting its BRPOP included. Measured
# 2-4 s on 2 cores for a kill; a hang adds the clients' reply timeouts
# (state/resp.REPLY_TIMEOUT_S, state/broker.HUNG_REDIS_OPTIONS: 5 s). The bound leaves
# room for a loaded machine.
RESUME_BOUND_S = 20.0


@pytest.fixture()
def failover(failover_stack: FaultStack) -> FaultStack:
    failover_stack.wait_healthy()
    return failover_stack


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_primary_lost_mid_burst(failover: FaultStack, fault: str) -> None:
    sentinels = failover.sentinels
    assert sentinels is not None
    killed: dict[str, float] = {}
    started = time.monotonic()

    async def inject(trainer: Trainer) -> set[str]:
        victim, call_id = await trainer.wait_marker(VICTIM)
        await ledger_shows(failover, victim.trace_id, call_id)
        primary = sentinels.primary()
        killed["at"] = time.monotonic()
        await asyncio.to_thread(primary.kill if fault == "killed" else primary.pause)
        return set()  # known only once the batch is over: see below

    results, _ = run_batch(failover, batch(), inject)
    killed_at = killed["at"]
    # In flight at the kill: every rollout not graded before it.
    victims = {r.trace_id for r in results if not _graded_before(r, killed_at)}
    resumed_s = _resumed_after(results, killed_at)
    answered_5xx = sum(
        1
        for r in results
        for a in [*(a for c in r.calls for a in c.attempts), *r.grade_attempts]
        if a.status == 0 or a.status >= 500
    )
    notes = [
        f"resumed {resumed_s:.1f} s after it (down-after {DOWN_AFTER_MS} ms)",
        f"{answered_5xx} answers 5xx",
    ]
    row = finish(failover, f"redis primary {fault} (Sentinel)", results, victims, started, notes)
    check(row, results)
    assert victims, _dump(results)
    # Discarded, never scored; a grade asked for is refused naming the failover.
    for result in results:
        if result.trace_id in victims:
            assert result.score is None and result.discarded, _dump(results)
            if result.grade_attempts:
                assert flagged(result), _dump(results)
                cause = ((result.record or {}).get("infra_failure") or {}).get("cause")
                assert cause == "state_failover", _dump(results)
    assert resumed_s < RESUME_BOUND_S, _dump(results)

    # Sentinel has a primary again (the lost one comes back as its replica): a fresh batch
    # is not touched at all.
    sentinels.restore()
    started = time.monotonic()
    fresh, _ = run_batch(failover, batch(victim=False))
    fresh_row = finish(failover, "  then a fresh batch", fresh, set(), started, clean=True)
    check(fresh_row, fresh)
    assert fresh_row.unaffected_right == B, _dump(fresh)


def _graded_before(result: Result, at: float) -> bool:
    return any(a.status == 200 and a.started + a.seconds < at for a in result.grade_attempts)


def _resumed_after(results: list[Result], at: float) -> float:
    """Seconds from ``at`` to the end of the first call sent after it that was answered
    200."""
    ends = [
        a.started + a.seconds - at
        for r in results
        for c in r.calls
        for a in c.attempts
        if a.status == 200 and a.started > at
    ]
    assert ends, "no call was answered 200 after the fault"
    return min(ends)
