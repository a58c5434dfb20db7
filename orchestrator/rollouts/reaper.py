"""The reaper, the control plane's controller, a process of its own (``orchestrator
reaper``, :class:`Reaper`): ends rollouts that are idle, too old, or graded and past their
grace period; fails the rollouts of hosts that are lost or unhealthy; recounts the hosts'
slots from what holds them; and has every live host sweep its expired and orphaned
sandboxes (queue/sweep.py). Several may run (a standby): one holds the deployment's
reaper lease and reaps.

It is the API side's code (it ends rollouts as the API does, through
:class:`RolloutService`); the worker's code (queue/) imports none of it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry, load_environments
from orchestrator.observability import metrics
from orchestrator.observability.logging import bind_sandbox, get_logger, rollout_context
from orchestrator.outcomes import Cause
from orchestrator.rollouts.errors import InfraError
from orchestrator.rollouts.service import RolloutService
from orchestrator.state.broker import celery_app
from orchestrator.state.errors import StateError
from orchestrator.state.models import RolloutState
from orchestrator.state.pools import PoolClaims
from orchestrator.state.records import Rollout, RolloutStore
from orchestrator.state.replies import WorkerClient
from orchestrator.state.wire import Nothing, Tasks

log = get_logger(__name__)


class EndReason(StrEnum):
    """Why the reaper ends a rollout; also the ``reason`` label of sandboxes reaped."""

    IDLE = "idle"
    GRADED = "graded"
    MAX_LIFETIME = "max_lifetime"
    INFRA_FAILED = "infra_failed"
    STUCK_CREATING = "stuck_creating"
    UNCONFIGURED = "unconfigured"
    CLIENT_TIMEOUT = "client_timeout"
    """An E2B sandbox past the timeout its client set (docs/e2b.md)."""
    PAUSED_TOO_LONG = "paused_too_long"
    """Paused for longer than ``e2b_paused_keep_s`` (docs/snapshots.md)."""


# The reaper's own ends of a rollout not graded yet: the trainer may still be working on
# it, so it is ended with a cause that fails its next call or grade (never scored).
_ENDED_BY_US = {
    EndReason.IDLE: Cause.IDLE_REAPED,
    EndReason.MAX_LIFETIME: Cause.LIFETIME_EXCEEDED,
    EndReason.UNCONFIGURED: Cause.ENVIRONMENT_REMOVED,
}


@dataclass(frozen=True)
class End:
    """A rollout to end, and what to tell a trainer that comes back to it."""

    reason: EndReason
    why: str = ""


def reason_to_end(rollout: Rollout, service: RolloutService, now: float) -> End | None:
    """Why this rollout should end now, or None to keep it. Its limits are those of the
    environment it was pinned to when it started."""
    if rollout.closed_at is not None:
        return None
    if rollout.environment not in service.environments:
        return End(
            EndReason.UNCONFIGURED,
            f"its environment {rollout.environment!r} was removed from the configuration",
        )
    if rollout.state == RolloutState.INFRA_FAILED:
        return End(EndReason.INFRA_FAILED)
    try:
        config = service.environment_of(rollout).environment
    except InfraError:
        return End(EndReason.UNCONFIGURED, "its environment is no longer configured")
    lifetime = config.effective_lifetime_s(service.settings)
    # A pause stops its clocks: it holds nothing then (docs/snapshots.md).
    paused_s = rollout.paused_s + (now - rollout.paused_at if rollout.paused_at else 0.0)
    if now - rollout.created_at - paused_s > lifetime:
        return End(EndReason.MAX_LIFETIME, f"it passed its maximum lifetime of {lifetime} s")
    if rollout.state == RolloutState.PAUSED and rollout.paused_at is not None:
        keep = service.settings.e2b_paused_keep_s
        return End(EndReason.PAUSED_TOO_LONG) if now - rollout.paused_at > keep else None
    if rollout.state == RolloutState.GRADED and rollout.graded_at is not None:
        graded = now - rollout.graded_at > config.grace_after_grade_s
        return End(EndReason.GRADED) if graded else None
    if rollout.state == RolloutState.CREATING:
        limit = service.settings.sandbox_create_timeout_s * 2
        return End(EndReason.STUCK_CREATING) if now - rollout.created_at > limit else None
    if rollout.e2b is not None:
        # An E2B sandbox lives until its client's timeout (which set_timeout moves), as on
        # E2B: its client, not an idle rule, says when it is done.
        end_at = float(rollout.e2b.get("end_at") or 0)
        return End(EndReason.CLIENT_TIMEOUT) if now > end_at else None
    if rollout.calls_in_flight <= 0 and now - rollout.last_activity > config.idle_timeout_s:
        return End(
            EndReason.IDLE,
            f"no tool call for {now - rollout.last_activity:.0f} s, past the environment's "
            f"idle_timeout_s of {config.idle_timeout_s} s",
        )
    return None


class Reaper:
    """The reaper as a process of its own (``orchestrator reaper``): one service, store and
    queue client built once, a pass every ``reaper_interval_s`` while it holds the
    deployment's reaper lease (``RolloutStore.hold_reaper_lease``). Run one, or more for
    a standby: the others wait for the lease, which lapses ``lease_s`` after its holder's
    last renewal, so a reaper that died is replaced within that."""

    def __init__(
        self,
        settings: Settings,
        environments: EnvironmentRegistry | None = None,
        *,
        holder: str | None = None,
    ) -> None:
        self.settings = settings
        self.environments = environments or load_environments(settings)
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.store = RolloutStore.connect(settings, role="reaper")
        self.queue = WorkerClient(settings, celery_app(), self.store)
        self.service = RolloutService(settings, self.store, self.environments, self.queue)
        self.alive_file = settings.reaper_alive_file
        self.alive_file.parent.mkdir(parents=True, exist_ok=True)

    @property
    def lease_s(self) -> float:
        """How long the lease outlives its holder's last renewal: three passes, at least
        30 s. A pass longer than that may meet a standby's: both are safe to run at once
        (each close takes its rollout's close lease; the recount writes nothing when slots
        moved during it), only wasteful."""
        return max(30.0, 3 * self.settings.reaper_interval_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass until ``stop`` is set; then give the lease up, so a standby
        takes over at once rather than when it lapses."""
        interval = self.settings.reaper_interval_s
        held = False
        try:
            while not stop.is_set():
                started = time.monotonic()
                held = await self._pass_if_held(held)
                self.alive_file.touch()
                rest = max(0.0, interval - (time.monotonic() - started))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), rest)
        finally:
            with contextlib.suppress(StateError):
                await self.store.drop_reaper_lease(self.holder)
            await self.store.close()

    async def _pass_if_held(self, held: bool) -> bool:
        """One pass if this process holds the lease (taken or renewed now); whether it does."""
        try:
            holds = await self.store.hold_reaper_lease(self.holder, self.lease_s)
        except StateError as exc:
            log.warning("reaper.redis_unavailable", error=str(exc))
            return False
        if holds != held:
            log.info("reaper.lease_taken" if holds else "reaper.standing_by", holder=self.holder)
        if not holds:
            return False
        try:
            passed = await self.pass_once()
        except StateError as exc:
            log.warning("reaper.pass_interrupted", error=str(exc))
            return True
        except Exception:  # a bug in one pass must not end the controller
            log.exception("reaper.pass_failed")
            return True
        # A line per pass only when it did something (each rollout it ended has its own).
        if passed["ended"] or passed["hosts_failing"]:
            log.info(
                "reaper.passed",
                rollouts_ended=len(passed["ended"]),
                hosts_swept=passed["hosts_swept"],
                hosts_failing=passed["hosts_failing"],
            )
        return True

    async def pass_once(self) -> dict[str, Any]:
        """One pass: end what must end, fail the rollouts of failing hosts, recount slots,
        record pools' demand, ask every live host to sweep and one to refill pools."""
        store, queue, service = self.store, self.queue, self.service
        ended: dict[str, str] = {}
        now = time.time()
        failing = await _failing_hosts(self.settings, store, queue, now)
        for rollout_id in await store.live_ids():
            with rollout_context(rollout_id):
                reason = await _reap_one(service, rollout_id, failing, now)
            if reason is not None:
                ended[rollout_id] = reason
        await _recount_host_loads(store, service)
        # Two intervals back: a late pass still sees every rollout since the last.
        await _record_pool_demand(
            store, service.pools, time.time() - 2 * self.settings.reaper_interval_s
        )
        hosts = [beat.host for beat in await queue.heartbeats.live()]
        for host in hosts:
            await queue.send(Tasks.SWEEP_HOST, Nothing(), host=host)
        await queue.send(Tasks.REFILL_POOLS, Nothing(), host=None)
        await store.mark_reaper_pass(time.time())
        return {"ended": ended, "hosts_swept": hosts, "hosts_failing": sorted(failing)}


async def _reap_one(
    service: RolloutService,
    rollout_id: str,
    failing: dict[str, tuple[str, str, dict[str, Any]]],
    now: float,
) -> str | None:
    """Fail the rollout if its host is failing; end it if it should end. Why it ended."""
    store = service.store
    rollout = await store.get(rollout_id)
    if rollout is None:
        await _forget_vanished(store, rollout_id)
        return None
    bind_sandbox(rollout.sandbox.sandbox_id if rollout.sandbox else None)
    host = rollout.sandbox.host if rollout.sandbox is not None else None
    host_cause = None
    if host in failing and rollout.state != RolloutState.INFRA_FAILED:
        host_cause, message, evidence = failing[host]
        await service.mark_infra_failed(rollout_id, host_cause, message, evidence)
        failed = await store.get(rollout_id)
        if failed is None:
            await _forget_vanished(store, rollout_id)
            return None
        rollout = failed
    end = reason_to_end(rollout, service, now)
    if end is None:
        return None
    if end.reason in _ENDED_BY_US and await _failed_over(service, rollout):
        # Not the trainer's doing: Redis failed over while the rollout ran, and a primary
        # that hung rather than died kept every call away for as long as it took (the
        # idle clock ran meanwhile). Its grade would be refused for the failover anyway.
        end = End(EndReason.INFRA_FAILED)
    if end.reason == EndReason.STUCK_CREATING:
        await service.mark_infra_failed(
            rollout_id, Cause.STUCK_CREATING, "sandbox never became ready", {}
        )
    await service.close(
        rollout_id, end.reason, wait=False, ended_by=_ENDED_BY_US.get(end.reason), why=end.why
    )
    if rollout.sandbox is not None:
        # A lost host's sandbox goes when the host's sweep runs again; it is reaped now.
        metrics.SANDBOXES_REAPED.labels(host_cause or end.reason).inc()
    return end.reason


async def _failed_over(service: RolloutService, rollout: Rollout) -> bool:
    """Whether Redis failed over since the rollout's record was made; if so it is failed
    for that (sticky, ``state_failover``: rollouts/closes.py)."""
    try:
        await service.closer.refuse_failed_over(rollout)
    except InfraError:
        return True
    return False


async def _record_pool_demand(store: RolloutStore, pools: PoolClaims, since: float) -> None:
    """What each pool's demand is now, for the pools that size themselves by it
    (state/pools.py): its live rollouts, and the most of them live at once among those
    live now or created since ``since`` (the rollouts of a burst that ended between two
    passes count too)."""
    # Read first: a claim after it may be missing from the live rollouts read next.
    out_changes = await pools.out_changes()
    live_ids = await store.live_ids()
    recent_ids = set(await store.created_since(since)) - set(live_ids)
    records = [r for r in await store.get_many([*live_ids, *recent_ids]) if r is not None]
    live = [(r.environment, r.codebase) for r in records if r.closed_at is None]
    await pools.record_demand(live, records, out_changes)


async def _forget_vanished(store: RolloutStore, rollout_id: str) -> None:
    """A live rollout whose record Redis lost has nothing left to end or close (a close
    would be a 404, ending the pass for every rollout after it): it leaves the live set."""
    await store.forget_live(rollout_id)


async def _failing_hosts(
    settings: Settings, store: RolloutStore, queue: WorkerClient, now: float
) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Hosts whose rollouts cannot go on: silent for ``host_lost_after_s`` (first silence
    remembered in Redis, so the clock survives a beat restart), or whose daemon failed
    ``host_unhealthy_after`` probes in a row. Value: (cause, message, evidence)."""
    heartbeats = queue.heartbeats
    failing: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for host in await heartbeats.known_hosts():
        beat = await heartbeats.get(host)
        if beat is None:
            since = await heartbeats.silent_since(host, now)
            if now - since > settings.host_lost_after_s:
                message = f"host {host!r} sent no heartbeat for {now - since:.0f} s"
                failing[host] = (Cause.HOST_LOST, message, {"silent_since": since})
            continue
        await heartbeats.heard_from(host)
        if beat.backend_failures >= settings.host_unhealthy_after:
            message = f"host {host!r} is unhealthy: {beat.error or 'daemon probe failed'}"
            evidence = {"heartbeat": beat.model_dump(mode="json")}
            failing[host] = (Cause.HOST_UNHEALTHY, message, evidence)
    for host, (cause, message, _) in failing.items():
        log.error("host.failing", host=host, cause=cause, error=message)
    return failing


async def _recount_host_loads(store: RolloutStore, service: RolloutService) -> None:
    """Rebuild the per-host slot counts (state/admission.py) from what holds slots:
    live rollouts with a host, ready pool sandboxes, and pool sandboxes in transit (being
    created, or handed out); so a count that drifted (a crash between taking a slot and
    using it) heals within one reaper pass. A pass during which slots moved writes
    nothing (``Admission.recount``): its count may have missed them."""

    async def count(in_transit: dict[str, int]) -> dict[str, int]:
        # Pool sandboxes being created, or taken and being probed, and new rollouts not
        # yet in their record, are in neither place below: without them a recount gave
        # their slots away (a host overcommitted).
        counts = dict(in_transit)
        for rollout_id in await store.live_ids():
            rollout = await store.get(rollout_id)
            if rollout is not None and rollout.host is not None and rollout.closed_at is None:
                counts[rollout.host] = counts.get(rollout.host, 0) + 1
        # Every ready list there is: demand-sized pools and pools no longer configured
        # hold slots too.
        for pool in await service.pools.stocked():
            for handle in await service.pools.ready(pool):
                counts[handle.host] = counts.get(handle.host, 0) + 1
        return counts

    if not await service.admission.recount(count):
        log.info("admission.recount_skipped", reason="slots moved while counting")
