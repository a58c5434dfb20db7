"""The end of a rollout: closing it (its sandbox destroyed, its record closed) and failing
it (infra_failed, sticky: never graded, only 503s from then on).

The call loop and the grading are given this part: both refuse a rollout that failed, or
that the orchestrator ended before its grade (:meth:`Closer.refuse_failed`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from orchestrator.observability import metrics
from orchestrator.observability.logging import bind_sandbox, get_logger, in_rollout_context
from orchestrator.outcomes import Cause, Outcome
from orchestrator.rollouts.errors import InfraError
from orchestrator.rollouts.lookup import known, present
from orchestrator.rollouts.recycling import RecyclePolicy
from orchestrator.state.admission import Admission
from orchestrator.state.models import RolloutState
from orchestrator.state.pools import PoolClaims
from orchestrator.state.quotas import TenantQuotas
from orchestrator.state.records import Rollout, RolloutStore
from orchestrator.state.replies import QueueTimeout, WorkerClient
from orchestrator.state.wire import DestroySandbox, Tasks
from orchestrator.tenants import OPERATOR, Principal

log = get_logger(__name__)

CLOSE_LEASE_S = 40.0
"""The longest a close takes: its wait for the destroy (30 s) and a few round trips."""


class Closer:
    def __init__(
        self,
        store: RolloutStore,
        queue: WorkerClient,
        admission: Admission,
        quotas: TenantQuotas,
    ) -> None:
        self.store = store
        self.queue = queue
        self.keys = store.keys
        self.admission = admission
        self.quotas = quotas
        # Set by RolloutService once the environments can be resolved: which sandboxes go
        # back to a pool instead of being destroyed (rollouts/recycling.py).
        self.recycling: RecyclePolicy | None = None
        self.pools: PoolClaims | None = None

    @in_rollout_context
    async def close(
        self,
        rollout_id: str,
        reason: str,
        *,
        wait: bool = True,
        ended_by: Cause | None = None,
        why: str = "",
        destroy: bool = True,
        caller: Principal = OPERATOR,
    ) -> Rollout:
        """Destroy the sandbox and close the record (an infra-failed rollout stays so).

        ``ended_by``: the orchestrator ends the rollout on its own (``why`` says what
        happened, for the trainer): a call or grade that comes later finds it failed with
        that cause, so the trainer discards it instead of scoring it. ``destroy=False``:
        the caller destroys the sandbox itself (the local stack's teardown, whose worker
        is stopping). ``caller``: another tenant's rollout is unknown to it (a 404)."""
        rollout = await known(self.store, rollout_id, caller)
        bind_sandbox(rollout.sandbox.sandbox_id if rollout.sandbox else None)
        leased = False
        if rollout.closed_at is None:
            if not await self.store.take_close_lease(rollout_id, CLOSE_LEASE_S):
                # Another close of it is under way (the grade's and a reaper pass's at
                # once): that one destroys or recycles the sandbox and releases its slot.
                # Both would have released the slot twice (seen: a host at -10 slots used).
                return await self._closed_by_another(rollout_id)
            leased = True
            # Read again under the lease: a close that held it before us may have ended
            # the rollout since our read (and given the lease back).
            rollout = await known(self.store, rollout_id)
        try:
            recycle = None
            if destroy and self.recycling is not None and rollout.closed_at is None:
                recycle = self.recycling.request(rollout, reason, ended_by)
            if recycle is not None:
                # Its slot stays taken, counted in transit until the worker puts the sandbox in
                # its pool or destroys it; counted before the record closes, so no recount
                # between the two gives it away.
                handle = recycle.handle
                recycle.transit = await self.admission.hold_for_recycling(
                    handle.host, handle.sandbox_id
                )
                if recycle.transit:  # else another close of this rollout sent it already
                    if self.pools is not None:  # before the send: the worker's end comes after
                        await self.pools.recycling(recycle.pool, handle.sandbox_id)
                    await self.queue.send(Tasks.RECYCLE_SANDBOX, recycle, host=handle.host)
            elif destroy and rollout.sandbox is not None and rollout.closed_at is None:
                destroy_it = DestroySandbox(handle=rollout.sandbox, reason=reason)
                host = rollout.sandbox.host
                if wait:
                    try:
                        await self.queue.call(
                            Tasks.DESTROY_SANDBOX, destroy_it, host=host, timeout_s=30
                        )
                    except QueueTimeout as exc:
                        # The host's label sweep destroys it when the worker is back.
                        log.warning(
                            "rollout.destroy_deferred", rollout_id=rollout_id, error=str(exc)
                        )
                else:
                    await self.queue.send(Tasks.DESTROY_SANDBOX, destroy_it, host=host)
            if rollout.sandbox is not None and rollout.closed_at is None and recycle is None:
                await self.admission.release(rollout.sandbox.host)
            if rollout.pool_hit and rollout.closed_at is None and self.pools is not None:
                await self.pools.returned(rollout.environment, rollout.codebase)
            if rollout.closed_at is None:
                await self.quotas.leave(rollout.tenant, rollout_id)
            state = (
                rollout.state if rollout.state == RolloutState.INFRA_FAILED else RolloutState.CLOSED
            )
            fields: dict[str, Any] = {"state": state, "closed_at": time.time()}
            if ended_by is not None and rollout.score is None:
                fields["ended_by"] = {
                    "cause": ended_by,
                    "message": f"the orchestrator ended this rollout before its grade: {why}",
                    "at": time.time(),
                }
            if rollout.outcome is None:
                # Ended without a grade and without a fault (idle, lifetime, closed by the
                # trainer): nothing went wrong on our side.
                fields["outcome"] = (
                    Outcome.INFRA_ERROR if state == RolloutState.INFRA_FAILED else Outcome.OK
                )
            updated = present(
                await self.store.update(rollout_id, **fields), rollout_id, "it was closed"
            )
            if rollout.closed_at is None:  # counted once, by the close that ended it
                metrics.ROLLOUTS_FINISHED.labels(updated.outcome or Outcome.OK).inc()
                metrics.TOOL_CALLS_PER_ROLLOUT.observe(await self.store.call_count(rollout_id))
            log.info("rollout.closed", rollout_id=rollout_id, reason=reason)
            return updated
        finally:
            if leased:  # closed (or failed: a close may be tried again at once)
                await self.store.end_close_lease(rollout_id)

    async def _closed_by_another(self, rollout_id: str) -> Rollout:
        """The record once the close under way has closed it (or its lease lapsed)."""
        deadline = time.monotonic() + CLOSE_LEASE_S
        while True:
            rollout = await known(self.store, rollout_id)
            if rollout.closed_at is not None or time.monotonic() > deadline:
                return rollout
            await asyncio.sleep(0.05)

    async def fail(
        self, rollout_id: str, cause: str, message: str, evidence: dict[str, Any]
    ) -> InfraError:
        """:meth:`mark_infra_failed`, then the error to raise for it."""
        await self.mark_infra_failed(rollout_id, cause, message, evidence)
        return InfraError(message, rollout_id=rollout_id, evidence=evidence, code=cause)

    async def mark_infra_failed(
        self, rollout_id: str, cause: str, message: str, evidence: dict[str, Any]
    ) -> None:
        """Sticky: the rollout will never be graded, only 503s from now on.

        A record that vanished has nothing left to mark, and this raises nothing for it:
        every caller is already on its way to a 503 of its own, whose cause (the fault
        that failed the rollout) says more than a vanished record would, and the reaper's
        pass goes on to the next rollout."""
        failure = {"cause": cause, "message": message, "evidence": evidence, "at": time.time()}
        metrics.INFRA_ERRORS.labels(cause).inc()
        marked = await self.store.mark_infra_failed(
            rollout_id, failure, outcome=Outcome.INFRA_ERROR
        )
        log.error("rollout.infra_failed", rollout_id=rollout_id, cause=cause, error=message)
        if marked is None:
            log.error("rollout.vanished", rollout_id=rollout_id, during="it was failed")

    async def refuse_failed_over(self, rollout: Rollout) -> None:
        """Fail the rollout (sticky, 503) if Redis failed over since its record was made:
        the old primary's last writes (a call's reply and trajectory step, the record's
        updates) may be missing, and a score must not be computed from half a record."""
        if rollout.state_epoch is None:
            return
        now = await self.store.epoch()
        if now is None or now == rollout.state_epoch:
            return
        raise await self.fail(
            rollout.rollout_id,
            Cause.STATE_FAILOVER,
            "Redis failed over to a replica while the rollout ran; its record may miss "
            "the old primary's last writes",
            {"epoch_at_start": rollout.state_epoch, "epoch_now": now},
        )

    async def refuse_failed(self, rollout: Rollout, context: str) -> None:
        """Raise the rollout's :class:`InfraError` if it failed, or if the orchestrator
        ended it before a score was stored (which fails it now, sticky, with the cause
        of its end: the trainer was still working on it and must discard it)."""
        failure = rollout.infra_failure
        if failure is None and rollout.ended_by is not None and rollout.score is None:
            ended = rollout.ended_by
            cause, message = str(ended.get("cause")), str(ended.get("message"))
            await self.mark_infra_failed(rollout.rollout_id, cause, message, {"ended_by": ended})
            failure = {"cause": cause, "message": message}
        if failure is None and rollout.state != RolloutState.INFRA_FAILED:
            return
        failure = failure or {}
        raise InfraError(
            f"{context}: {failure.get('message', 'infrastructure failure')}; it must not be scored",
            rollout_id=rollout.rollout_id,
            code=str(failure.get("cause") or Cause.INFRA_ERROR),
        )
