"""Snapshots of rollouts' sandboxes, and what a new rollout made from one needs
(docs/snapshots.md): a snapshot is kept by the host that took it (sandbox/snapshots.py),
so a sandbox from it is made there, never taken from a pool; it runs its parent's
environment as the parent was pinned."""

from __future__ import annotations

from orchestrator.config import Settings
from orchestrator.environments.loader import ResolvedEnvironment
from orchestrator.observability.logging import get_logger
from orchestrator.outcomes import Cause
from orchestrator.rollouts.errors import InfraError, Rejected
from orchestrator.rollouts.starts import Starter
from orchestrator.sandbox.snapshots import COPY_TIMEOUT_S
from orchestrator.state.models import RolloutState
from orchestrator.state.records import Rollout
from orchestrator.state.replies import QueueClient, QueueTimeout
from orchestrator.state.snapshots import SnapshotRecord, SnapshotRegistry, new_snapshot_id
from orchestrator.state.tasks import DropSnapshot, SnapshotMade, SnapshotSandbox, TaskName

log = get_logger(__name__)

SNAPSHOT_TIMEOUT_S = 2 * COPY_TIMEOUT_S
"""The longest a snapshot may take: its writable trees packed, its upper layer copied."""


class Snapshots:
    """Take, find and drop the deployment's snapshots."""

    def __init__(self, settings: Settings, queue: QueueClient, starter: Starter) -> None:
        self.settings = settings
        self.queue = queue
        self.keys = starter.keys
        self.starter = starter
        self.registry = SnapshotRegistry(starter.store.redis, starter.keys)

    async def take(
        self,
        rollout: Rollout,
        *,
        name: str | None = None,
        template: str = "",
        for_fork: bool = False,
    ) -> SnapshotRecord:
        """Keep the rollout's sandbox's filesystem state (the sandbox runs on). 409 when
        it cannot be snapshotted (not started yet; too many generations); 503
        ``snapshot_failed`` when its host could not, which fails nothing."""
        handle = rollout.sandbox
        if handle is None or rollout.state != RolloutState.ACTIVE:
            raise Rejected(
                409, f"{rollout.rollout_id} has no running sandbox to snapshot", code="not_running"
            )
        snapshot_id = new_snapshot_id()
        try:
            raw = await self.queue.call(
                TaskName.SNAPSHOT_SANDBOX,
                SnapshotSandbox(handle=handle, snapshot_id=snapshot_id).model_dump(mode="json"),
                queue=self.keys.host_queue(handle.host),
                timeout_s=self.settings.queue_wait_s + SNAPSHOT_TIMEOUT_S,
                host_id=handle.host,
            )
            made = SnapshotMade.model_validate(raw)
        except QueueTimeout as exc:
            made = SnapshotMade(error=f"no worker answered: {exc}")
        if made.refused is not None:
            raise Rejected(409, made.refused, code="snapshot_refused")
        if made.taken is None:
            raise InfraError(
                f"could not snapshot {rollout.rollout_id}: {made.error or 'unknown'}",
                rollout_id=rollout.rollout_id,
                evidence={"host": handle.host, "sandbox_id": handle.sandbox_id},
                code=Cause.SNAPSHOT_FAILED,
            )
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
            taken=made.taken,
            for_fork=for_fork,
        )
        await self.registry.add(record)
        log.info(
            "snapshot.taken",
            rollout_id=rollout.rollout_id,
            sandbox_id=handle.sandbox_id,
            snapshot_id=snapshot_id,
            bytes=made.taken.bytes,
            ms=made.taken.ms,
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
            TaskName.DROP_SNAPSHOT,
            DropSnapshot(snapshot_id=snapshot_id).model_dump(mode="json"),
            queue=self.keys.host_queue(record.host),
        )
        return True
