"""Snapshots of rollouts' sandboxes, and what a new rollout made from one needs
(docs/snapshots.md): a snapshot is kept by the host that took it (sandbox/docker/snapshots.py),
so a sandbox from it is made there, never taken from a pool; it runs its parent's
environment as the parent was pinned.

Also an environment's ``setup``: run once per group of rollouts (the rollouts of one
dataset item), in a rollout of source ``setup`` of its own, snapshotted; the group's
rollouts start from that snapshot (:meth:`Snapshots.for_group`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from orchestrator.config import Settings
from orchestrator.environments.loader import ResolvedEnvironment
from orchestrator.environments.models import SetupStep
from orchestrator.observability import metrics
from orchestrator.observability.logging import get_logger
from orchestrator.outcomes import Cause, Outcome
from orchestrator.rollouts.bounds import Deadline
from orchestrator.rollouts.errors import InfraError, Rejected, RejectedKind
from orchestrator.rollouts.lookup import present
from orchestrator.rollouts.models import CallReply, rollout_group
from orchestrator.rollouts.starts import Starter
from orchestrator.sandbox.docker.snapshots import COPY_TIMEOUT_S
from orchestrator.state.models import RolloutSource, RolloutState
from orchestrator.state.records import Rollout
from orchestrator.state.replies import QueueTimeout, WorkerClient
from orchestrator.state.snapshots import (
    GroupSetup,
    SnapshotKind,
    SnapshotRecord,
    SnapshotRegistry,
    new_snapshot_id,
)
from orchestrator.state.wire import (
    DestroySandbox,
    DropSnapshot,
    InfraFault,
    SnapshotMade,
    SnapshotNotTaken,
    SnapshotSandbox,
    Tasks,
)
from orchestrator.tenants import DEFAULT_TENANT, Principal
from orchestrator.tools.command import COMMAND_TOOL, CommandOutput

log = get_logger(__name__)

SNAPSHOT_TIMEOUT_S = 2 * COPY_TIMEOUT_S
"""The longest a snapshot may take: its writable trees packed, its upper layer copied."""
DESTROY_WAIT_S = 30.0
"""How long a pause waits for its sandbox's destroy (as a close does)."""
SETUP_ERROR_KEEP_S = 60
"""A group's failed set-up answers its rollouts this long (then a rollout tries again)."""

CallTool = Callable[..., Awaitable[CallReply]]
Close = Callable[[str, str], Awaitable[Any]]


class Snapshots:
    """Take, find and drop the deployment's snapshots; set groups up."""

    def __init__(
        self,
        settings: Settings,
        queue: WorkerClient,
        starter: Starter,
        call_tool: CallTool,
        close: Close,
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.keys = starter.keys
        self.starter = starter
        self.redis = starter.store.redis
        self.registry = SnapshotRegistry(starter.store.redis, starter.keys)
        self.call_tool = call_tool
        self.close = close
        self._setting_up: dict[str, asyncio.Future[SnapshotRecord]] = {}

    async def take(
        self,
        rollout: Rollout,
        *,
        name: str | None = None,
        template: str = "",
        kind: SnapshotKind = SnapshotKind.NAMED,
        keep_s: float | None = None,
    ) -> SnapshotRecord:
        """Keep the rollout's sandbox's filesystem state (the sandbox runs on). 409 when
        it cannot be snapshotted (not started yet; too many generations); 503
        ``snapshot_failed`` when its host could not, which fails nothing."""
        handle = rollout.sandbox
        if handle is None or rollout.state not in (RolloutState.ACTIVE, RolloutState.PAUSED):
            raise Rejected(
                RejectedKind.CONFLICT,
                f"{rollout.rollout_id} has no running sandbox to snapshot",
                code="not_running",
            )
        snapshot_id = new_snapshot_id()
        try:
            made = await self.queue.call(
                Tasks.SNAPSHOT_SANDBOX,
                SnapshotSandbox(handle=handle, snapshot_id=snapshot_id),
                host=handle.host,
                timeout_s=self.settings.queue_wait_s + SNAPSHOT_TIMEOUT_S,
            )
        except QueueTimeout as exc:
            made = SnapshotMade(InfraFault(error=f"no worker answered: {exc}"))
        if isinstance(made.root, SnapshotNotTaken):
            raise Rejected(RejectedKind.CONFLICT, made.root.reason, code="snapshot_refused")
        if isinstance(made.root, InfraFault):
            raise InfraError(
                f"could not snapshot {rollout.rollout_id}: {made.root.error}",
                rollout_id=rollout.rollout_id,
                evidence={"host": handle.host, "sandbox_id": handle.sandbox_id},
                code=Cause.SNAPSHOT_FAILED,
            )
        taken = made.root.taken
        record = SnapshotRecord(
            snapshot_id=snapshot_id,
            name=name,
            host=handle.host,
            parent=rollout.rollout_id,
            environment=rollout.environment,
            environment_digest=rollout.environment_digest,
            environment_config=rollout.environment_config,
            image=rollout.image,
            codebase=rollout.codebase,
            workspace=rollout.workspace,
            runtime=handle.runtime,
            template=template,
            taken=taken,
            kind=kind,
            tenant=rollout.tenant,
            keep_until=time.time() + keep_s if keep_s is not None else None,
        )
        await self.registry.add(record)
        metrics.SNAPSHOT_SECONDS.labels(kind, "taken").observe(taken.ms / 1000)
        metrics.SNAPSHOT_SECONDS.labels(kind, "frozen").observe(taken.paused_ms / 1000)
        log.info(
            "snapshot.taken",
            rollout_id=rollout.rollout_id,
            sandbox_id=handle.sandbox_id,
            snapshot_id=snapshot_id,
            bytes=taken.bytes,
            ms=taken.ms,
        )
        return record

    def environment_of(self, record: SnapshotRecord) -> ResolvedEnvironment:
        """What a sandbox made from the snapshot runs: its parent's environment, image and
        /workspace as they were pinned."""
        return self.starter.environment_of(record)

    async def drop(self, snapshot_id: str) -> bool:
        """Forget a snapshot and have its host remove its files (at once, or when no
        sandbox is made over it any more: the host's sweep); False when there was none."""
        record = await self.registry.get(snapshot_id)
        if record is None or not await self.registry.remove(snapshot_id):
            return False
        await self.queue.send(
            Tasks.DROP_SNAPSHOT, DropSnapshot(snapshot_id=snapshot_id), host=record.host
        )
        return True

    # -- a group's set-up ----------------------------------------------------------------

    async def for_group(
        self,
        resolved: ResolvedEnvironment,
        item: dict[str, Any],
        source: RolloutSource,
        tenant: str = DEFAULT_TENANT,
    ) -> SnapshotRecord | None:
        """The snapshot a new rollout of ``item`` starts from: its group's set-up, run now
        when no rollout of the group has had it run (one set-up per group however many of
        its rollouts ask at once, on any API process); None when its environment has no
        ``setup`` (or the rollout has no group: an E2B sandbox, the set-up's own). 422
        ``setup_failed`` when the step exits non-zero; 503 when a sandbox of ours failed
        it."""
        step = resolved.environment.setup
        group = rollout_group(source, item)
        if step is None or group is None or source == RolloutSource.SETUP:
            return None
        if self.settings.sandbox_backend != "docker":
            raise Rejected(
                RejectedKind.INVALID,
                f"environment {resolved.environment.name!r} has a setup step, which needs "
                "snapshots: the Docker backend (docs/snapshots.md)",
                code="invalid_item",
            )
        # Once per (tenant, environment, codebase or commit, group): a row that names no
        # codebase of its own takes it from the request; tenants never share a set-up.
        where = resolved.codebase or resolved.image
        key = f"{tenant}:{resolved.environment.digest}:{where}:{group}"
        running = self._setting_up.get(key)
        if running is None:  # one waiter per group in this process, however many ask
            running = asyncio.ensure_future(self._group_snapshot(key, resolved, item, step, tenant))
            self._setting_up[key] = running
            running.add_done_callback(lambda _: self._setting_up.pop(key, None))
        return await asyncio.shield(running)

    async def _group_snapshot(
        self,
        key: str,
        resolved: ResolvedEnvironment,
        item: dict[str, Any],
        step: SetupStep,
        tenant: str,
    ) -> SnapshotRecord:
        lease_s = step.timeout_s + self.settings.sandbox_create_timeout_s
        lease_s += self.settings.admission_wait_s + SNAPSHOT_TIMEOUT_S
        deadline = time.monotonic() + lease_s
        delay = 0.05
        while True:
            raw = await self.redis.get(self.keys.group_setup(key))
            if raw is not None:
                found = GroupSetup.model_validate_json(raw)
                if found.error is not None:
                    raise Rejected(RejectedKind.INVALID, found.error, code="setup_failed")
                record = await self.registry.get(found.snapshot_id or "")
                live = {beat.host for beat in await self.queue.heartbeats.live()}
                if record is not None and record.host in live:
                    return record
                # Forgotten meanwhile, or its host is gone: set the group up again.
                await self.redis.delete(self.keys.group_setup(key))
                if record is not None:
                    await self.registry.remove(record.snapshot_id)
            lease = self.keys.group_setup_lease(key)
            if await self.redis.set(lease, "1", nx=True, ex=int(lease_s) + 1):
                try:
                    return await self._set_up(key, resolved, item, step, tenant)
                finally:
                    await self.redis.delete(lease)
            if time.monotonic() > deadline:
                raise InfraError(
                    "the group's set-up, run by another request, did not finish",
                    rollout_id="",
                    code=Cause.SANDBOX_CREATE_FAILED,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _set_up(
        self,
        key: str,
        resolved: ResolvedEnvironment,
        item: dict[str, Any],
        step: SetupStep,
        tenant: str,
    ) -> SnapshotRecord:
        """Run ``step`` in a sandbox of its own (a rollout of source ``setup``), snapshot it
        for the group, and close it."""
        rollout_id = f"setup-{uuid.uuid4().hex[:20]}"
        started = time.monotonic()
        await self.starter.start(
            rollout_id,
            item,
            source=RolloutSource.SETUP,
            resolved=resolved,
            exclusive=True,
            caller=Principal(tenant),
        )
        try:
            timeout_s = min(step.timeout_s, self.settings.command_timeout_max_s)
            reply = await self.call_tool(
                rollout_id,
                COMMAND_TOOL,
                {"argv": ["bash", "-c", step.command], "timeout_s": timeout_s},
                call_id="setup",
                source=RolloutSource.SETUP,
            )
            refused = reply.outcome != Outcome.OK and reply.error_kind != "timeout"
            output = None if refused else CommandOutput.model_validate_json(reply.output)
            if output is None or output.exit_code != 0:
                if output is None:  # refused before it ran (its arguments): the message
                    why, said = "not run", reply.output
                elif output.timed_out:
                    why, said = "timed out", output.stderr or output.stdout
                else:
                    why, said = f"exit status {output.exit_code}", output.stderr or output.stdout
                error = (
                    f"environment {resolved.environment.name!r}: its setup step failed ({why}): "
                    f"{said[-1500:]}"
                )
                failed = GroupSetup(error=error).model_dump_json()
                await self.redis.set(self.keys.group_setup(key), failed, ex=SETUP_ERROR_KEEP_S)
                raise Rejected(RejectedKind.INVALID, error, code="setup_failed")
            current = await self.starter.store.get(rollout_id)
            assert current is not None
            record = await self.take(current, kind=SnapshotKind.GROUP, keep_s=step.keep_s)
            done = GroupSetup(snapshot_id=record.snapshot_id).model_dump_json()
            await self.redis.set(self.keys.group_setup(key), done, ex=step.keep_s)
            log.info(
                "group.set_up",
                rollout_id=rollout_id,
                snapshot_id=record.snapshot_id,
                environment=resolved.environment.name,
                ms=round((time.monotonic() - started) * 1000, 1),
            )
            return record
        finally:
            await self.close(rollout_id, "its group's set-up is done")

    # -- pause and resume -----------------------------------------------------------------

    async def pause(
        self,
        rollout: Rollout,
        keep_s: float,
        fields: dict[str, Any],
        end_commands: Callable[[Rollout], Awaitable[None]],
    ) -> Rollout:
        """Keep the rollout's sandbox as a snapshot and destroy it, giving its slot back:
        the rollout is ``paused`` (with ``fields``) until :meth:`resume`. Paused first
        (no call begins on it from then on), its commands ended (``end_commands``: a
        snapshot keeps files, not processes), then snapshotted; a snapshot that fails
        leaves it running."""
        handle = rollout.sandbox
        assert handle is not None
        pausing = present(
            await self.starter.store.update(rollout.rollout_id, state=RolloutState.PAUSED),
            rollout.rollout_id,
            "it was being paused",
        )
        try:
            await end_commands(pausing)
            record = await self.take(pausing, kind=SnapshotKind.PAUSE, keep_s=keep_s)
        except BaseException:
            await self.starter.store.update(rollout.rollout_id, state=RolloutState.ACTIVE)
            raise
        # The record first (no host: a recount in between counts no slot), the slot after.
        paused = await self.starter.store.update(
            rollout.rollout_id,
            state=RolloutState.PAUSED,
            sandbox=None,
            host=None,
            paused_as=record.snapshot_id,
            paused_at=time.time(),
            **fields,
        )
        try:  # gone when the pause answers: it holds nothing from then on
            await self.queue.call(
                Tasks.DESTROY_SANDBOX,
                DestroySandbox(handle=handle, reason="paused"),
                host=handle.host,
                timeout_s=DESTROY_WAIT_S,
            )
        except QueueTimeout as exc:  # the host's sweep takes it (its rollout is paused)
            log.warning(
                "rollout.pause_destroy_deferred", rollout_id=rollout.rollout_id, error=str(exc)
            )
        await self.starter.admission.release(handle.host)
        log.info(
            "rollout.paused",
            rollout_id=rollout.rollout_id,
            sandbox_id=handle.sandbox_id,
            snapshot_id=record.snapshot_id,
        )
        return present(paused, rollout.rollout_id, "it was paused")

    async def resume(self, rollout: Rollout, fields: dict[str, Any]) -> Rollout:
        """Make a paused rollout's sandbox again from its snapshot, on the host that keeps
        it (waiting for a slot there as a create does: 429 when none frees), and set
        ``fields``. A paused rollout whose snapshot is gone has lost its state: it fails
        (503 ``snapshot_unavailable``)."""
        record = await self.registry.get(rollout.paused_as or "")
        if record is None:
            raise await self.starter.closer.fail(
                rollout.rollout_id,
                Cause.SNAPSHOT_UNAVAILABLE,
                f"the snapshot it was paused as ({rollout.paused_as}) is gone",
                {},
            )
        resolved = self.starter.environment_of(rollout)
        acquired = await self.starter.acquire(
            rollout.rollout_id,
            resolved,
            Deadline(None),
            0.0,
            only_host=record.host,
            new=False,
            tenant=rollout.tenant,
        )
        assert acquired is not None and acquired.handle is None
        making = await self.starter.store.update(
            rollout.rollout_id, host=acquired.host, snapshot=record.snapshot_id
        )
        await self.starter.admission.settled(acquired.host, rollout.rollout_id)
        making = present(making, rollout.rollout_id, "it was resuming")
        handle = await self.starter.create_cold(making, resolved, acquired.host)
        now = time.time()
        resumed = await self.starter.store.update(
            rollout.rollout_id,
            state=RolloutState.ACTIVE,
            sandbox=handle,
            paused_as=None,
            paused_at=None,
            paused_s=rollout.paused_s + now - (rollout.paused_at or now),
            sandbox_ready_at=now,
            last_activity=now,
            **fields,
        )
        await self.registry.remove(record.snapshot_id)  # its files go with its last sandbox
        log.info(
            "rollout.resumed",
            rollout_id=rollout.rollout_id,
            sandbox_id=handle.sandbox_id,
            snapshot_id=record.snapshot_id,
            ms=round((time.monotonic() - acquired.started) * 1000, 1),
        )
        return present(resumed, rollout.rollout_id, "it resumed")
