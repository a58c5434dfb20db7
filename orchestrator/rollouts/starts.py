"""The start of a rollout: resolving its environment, and acquiring and starting its
sandbox on its first call (a warm one from its pool, or a cold one on a host with a free
slot), exactly once however many first calls race.

The call loop and the grading are given this part: both wait for a rollout's sandbox
(:meth:`Starter.wait_ready`) and read its pinned environment (:meth:`Starter.environment_of`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.config import Settings
from orchestrator.environments.loader import (
    EnvironmentRegistry,
    ResolvedEnvironment,
    UnknownRepository,
    row_commit,
)
from orchestrator.observability import metrics
from orchestrator.observability.logging import bind_sandbox, get_logger, in_rollout_context
from orchestrator.outcomes import Cause
from orchestrator.rollouts.bounds import Deadline
from orchestrator.rollouts.closes import Closer
from orchestrator.rollouts.errors import InfraError, Rejected, RejectedKind, StillStarting
from orchestrator.rollouts.lookup import owned, present
from orchestrator.rollouts.models import new_record, rollout_group
from orchestrator.sandbox.agent.client import PROBE_MAX_S
from orchestrator.sandbox.backend import CommitWorkspace, ProbeResult, SandboxHandle
from orchestrator.state.admission import Admission
from orchestrator.state.errors import outlasting_an_outage
from orchestrator.state.models import RolloutSource, RolloutState
from orchestrator.state.pools import PoolClaims
from orchestrator.state.records import Rollout, RolloutStore
from orchestrator.state.replies import QueueTimeout, WorkerClient
from orchestrator.state.repos import RepoRegistry
from orchestrator.state.snapshots import SnapshotRecord
from orchestrator.state.wire import (
    CheckCommit,
    CommitChecked,
    CreateSandbox,
    DestroySandbox,
    InfraFault,
    Nothing,
    ProbeSandbox,
    SandboxCreated,
    Tasks,
)
from orchestrator.tenants import DEFAULT_TENANT, OPERATOR, Principal

log = get_logger(__name__)


GroupSetupHook = Callable[
    [ResolvedEnvironment, dict[str, Any], RolloutSource, str], Awaitable[SnapshotRecord | None]
]


@dataclass(frozen=True)
class Acquired:
    """Where a new rollout's sandbox comes from: a warm one (``handle``), or a cold one
    to create on ``host``, whose slot is taken."""

    host: str
    handle: SandboxHandle | None
    started: float  # time.monotonic() when the acquisition began


class Starter:
    def __init__(
        self,
        settings: Settings,
        store: RolloutStore,
        environments: EnvironmentRegistry,
        queue: WorkerClient,
        admission: Admission,
        pools: PoolClaims,
        closer: Closer,
    ) -> None:
        self.settings = settings
        self.store = store
        self.environments = environments
        self.queue = queue
        self.keys = store.keys
        self.admission = admission
        self.pools = pools
        self.closer = closer
        self.quotas = closer.quotas
        self.repos = RepoRegistry(store.redis, store.keys)
        self._checking: dict[tuple[str, str], asyncio.Future[CommitChecked]] = {}
        # A new rollout's group's set-up, when its environment has one (set by the
        # service: rollouts/snapshots.Snapshots.for_group).
        self.group_setup: GroupSetupHook | None = None

    # -- resolving ---------------------------------------------------------------------------

    def resolve(
        self,
        item: dict[str, Any],
        *,
        environment: str | None = None,
        codebase: str | None = None,
        workspace: CommitWorkspace | None = None,
    ) -> ResolvedEnvironment:
        """The environment and codebase a rollout runs on; 422 naming what is unknown. A
        row naming a repository at a commit needs ``workspace`` (:meth:`aresolve` finds it)."""
        row = _with_overrides(item, environment, codebase)
        try:
            return self.environments.resolve(row, workspace=workspace)
        except UnknownRepository as exc:
            raise Rejected(RejectedKind.INVALID, _message(exc), code="unknown_repository") from exc
        except LookupError as exc:
            raise Rejected(
                RejectedKind.INVALID, _message(exc), code="unknown_environment_or_codebase"
            ) from exc
        except ValueError as exc:
            raise Rejected(RejectedKind.INVALID, _message(exc), code="invalid_item") from exc

    async def aresolve(
        self, item: dict[str, Any], *, environment: str | None = None, codebase: str | None = None
    ) -> ResolvedEnvironment:
        """:meth:`resolve` off the event loop (a codebase lookup may ask the daemon), with
        the row's repository and commit looked up first (:meth:`workspace_of`)."""
        workspace = await self.workspace_of(_with_overrides(item, environment, codebase))
        return await asyncio.to_thread(
            self.resolve, item, environment=environment, codebase=codebase, workspace=workspace
        )

    async def workspace_of(self, row: dict[str, Any]) -> CommitWorkspace | None:
        """The repository at a commit ``row`` names (None: it names none): 422 when the
        repository is not registered (``unknown_repository``), has no such commit
        (``unknown_commit``) or its set-up does not build for it (``setup_failed``), 503
        ``repo_unavailable`` when no host can tell. A commit is asked of a host (which
        fetches its repository when it lacks it, and builds its set-up image) once per
        deployment: then it is known, with its set-up image (state/repos.py)."""
        try:
            wanted = row_commit(row)
        except ValueError as exc:
            raise Rejected(RejectedKind.INVALID, _message(exc), code="invalid_item") from exc
        if wanted is None or self.settings.sandbox_backend != "docker":
            return None  # (resolving refuses a row at a commit on other backends)
        name, commit = wanted
        record = await self.repos.get(name)
        if record is None:
            raise Rejected(
                RejectedKind.INVALID,
                f"unknown repository {name!r}: the row's repo field names no registered "
                f"repository (register it with `orchestrator repo add {name} SOURCE`)",
                code="unknown_repository",
            )
        known = await self.repos.known(name, commit)
        if known is not None:
            return record.at(commit, known)
        workspace = record.at(commit)
        key = (record.source, commit)
        checking = self._checking.get(key)
        if checking is None:  # one question per commit at a time, however many rows ask
            checking = asyncio.ensure_future(self._check_commit(workspace))
            self._checking[key] = checking
            checking.add_done_callback(lambda _: self._checking.pop(key, None))
        checked = await asyncio.shield(checking)
        if checked.error is not None:
            raise InfraError(
                f"could not find out whether {name!r} has commit {commit}: {checked.error}",
                rollout_id="",
                evidence={"host": checked.host, "repo": name, "commit": commit},
                code=Cause.REPO_UNAVAILABLE,
            )
        if not checked.found:
            raise Rejected(
                RejectedKind.INVALID,
                f"repository {name!r} has no commit {commit} (its source: {record.source})",
                code="unknown_commit",
            )
        if checked.setup_error is not None:
            raise Rejected(RejectedKind.INVALID, checked.setup_error[-2000:], code="setup_failed")
        return record.at(commit, checked.setup_image)

    async def _check_commit(self, workspace: CommitWorkspace) -> CommitChecked:
        try:
            checked = await self.queue.call(
                Tasks.CHECK_COMMIT,
                CheckCommit(workspace=workspace),
                host=None,
                timeout_s=self.settings.sandbox_create_timeout_s,
            )
        except QueueTimeout as exc:
            return CommitChecked(error=f"no worker answered: {exc}")
        if checked.found and checked.setup_error is None:
            await self.repos.remember(workspace.repo, {workspace.commit: checked.setup_image})
        return checked

    def environment_of(self, rollout: Rollout | SnapshotRecord) -> ResolvedEnvironment:
        """The rollout's environment, tools and image as pinned when it started, whatever
        the configuration says now (or those of the rollout a snapshot was taken of). No
        I/O: this is on every call's path."""
        owner = rollout.rollout_id if isinstance(rollout, Rollout) else rollout.parent
        if rollout.environment_digest is None:  # written before rollouts were pinned
            try:
                return self.environments.for_rollout(
                    rollout.environment, rollout.image, rollout.codebase, rollout.workspace
                )
            except LookupError as exc:
                raise InfraError(
                    f"the rollout's environment is no longer configured: {exc}",
                    rollout_id=owner,
                    code=Cause.ENVIRONMENT_REMOVED,
                ) from exc
        snapshot = rollout.environment_config or ""
        return self.environments.pinned(
            rollout.environment_digest,
            lambda: snapshot,
            image=rollout.image,
            codebase=rollout.codebase,
            workspace=rollout.workspace,
        )

    # -- start -------------------------------------------------------------------------------

    @in_rollout_context
    async def start(
        self,
        rollout_id: str,
        item: dict[str, Any],
        *,
        source: RolloutSource,
        environment: str | None = None,
        codebase: str | None = None,
        exclusive: bool = False,
        resolved: ResolvedEnvironment | None = None,
        deadline: Deadline | None = None,
        reserve_s: float = 0.0,
        fields: dict[str, Any] | None = None,
        snapshot: SnapshotRecord | None = None,
        caller: Principal = OPERATOR,
    ) -> Rollout:
        """Return the rollout, creating it and its sandbox if it is new (``caller``'s: an
        id of another tenant's rollout is a 409 when ``exclusive``, else unknown, a 404).

        Concurrent first calls of one id create exactly one sandbox: one caller wins the
        record, the others wait for its sandbox. ``exclusive`` (the rollout API) makes an
        existing id a 409 instead. ``resolved``: the row, already resolved by the caller.
        ``deadline``: the request's bound, of which ``reserve_s`` is kept for the call
        that follows; a sandbox not ready by then is a 503 (:class:`StillStarting`) while
        it goes on being made for the request's retry. ``fields``: more of the record, set
        when it is created (the E2B API's state). ``snapshot``: its sandbox is made from
        that snapshot, on the host that keeps it (``resolved`` is the snapshot's).
        """
        deadline = deadline or Deadline(None)
        if resolved is None:
            resolved = await self.aresolve(item, environment=environment, codebase=codebase)
        existing = await self.store.get(rollout_id)
        if existing is not None:
            return await self._existing(existing, exclusive, deadline, reserve_s, caller)
        if snapshot is None and self.group_setup is not None:
            # The group's set-up goes on when this request is out of time (shielded in
            # the hook): the request's retry finds it done, or waits for it.
            try:
                snapshot = await asyncio.wait_for(
                    self.group_setup(resolved, item, source, caller.tenant),
                    deadline.left(reserve=reserve_s),
                )
            except TimeoutError:
                raise StillStarting(rollout_id) from None
        # One first call of a rollout acquires its sandbox; its parallel first calls wait
        # for the record instead of each taking a warm sandbox or a slot to give back.
        bound = self.settings.admission_wait_s + self.settings.sandbox_create_timeout_s + 30
        while not await self.store.take_start_lease(rollout_id, bound):
            current = await self.store.get(rollout_id)
            if current is not None:
                return await self._existing(current, exclusive, deadline, reserve_s, caller)
            await asyncio.sleep(0.02)  # (its starter failed: the lock is gone, we start it)
        try:
            # The starter before us may have finished: its record is there, the lock gone.
            acquired = None
            if await self.store.get(rollout_id) is None:
                # The tenant's quota first, then the sandbox's place (a warm sandbox, or a
                # host's slot for a cold one), the record after: a rollout refused at
                # either leaves nothing behind, and its retry starts afresh.
                await self.quotas.enter(caller, rollout_id)
                try:
                    warm = await self.quotas.enter_warm(caller, rollout_id)
                    acquired = await self.acquire(
                        rollout_id,
                        resolved,
                        deadline,
                        reserve_s,
                        group=rollout_group(source, item),
                        only_host=snapshot.host if snapshot is not None else None,
                        tenant=caller.tenant,
                        warm=warm,
                    )
                finally:
                    if acquired is None:
                        await self.quotas.leave(caller.tenant, rollout_id)
                if warm and acquired is not None and acquired.handle is None:
                    await self.quotas.leave_warm(caller.tenant, rollout_id)
            record = new_record(
                rollout_id,
                source,
                resolved,
                item,
                state=RolloutState.CREATING,
                host=acquired.host if acquired else None,
                snapshot=snapshot.snapshot_id if snapshot is not None else None,
                tenant=caller.tenant,
                **(fields or {}),
            )
            created = False
            if acquired is not None:
                try:
                    created = await self.store.create(record)
                except BaseException:  # Redis failed us: the slot must not stay taken
                    await self._give_back(acquired, rollout_id)
                    await self.quotas.leave(caller.tenant, rollout_id)
                    raise
            if acquired is None or not created:
                if acquired is not None:
                    await self._give_back(acquired, rollout_id)
                    await self.quotas.leave(caller.tenant, rollout_id)
                current = present(await self.store.get(rollout_id), rollout_id, "it started")
                return await self._existing(current, exclusive, deadline, reserve_s, caller)
            if acquired.handle is None:  # the record names the host: it counts the slot now
                await self.admission.settled(acquired.host, rollout_id)
        finally:
            await self.store.end_start_lease(rollout_id)
        # Shielded: a request out of time leaves, the sandbox goes on being made for its
        # retry (which finds the record and waits for it).
        starting_task = asyncio.ensure_future(self._start_sandbox(record, resolved, acquired))
        starting_task.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(
                asyncio.shield(starting_task), deadline.left(reserve=reserve_s)
            )
        except TimeoutError:
            raise StillStarting(rollout_id) from None

    async def acquire(
        self,
        rollout_id: str,
        resolved: ResolvedEnvironment,
        deadline: Deadline,
        reserve_s: float,
        group: str | None = None,
        only_host: str | None = None,
        new: bool = True,
        tenant: str = DEFAULT_TENANT,
        warm: bool = True,
    ) -> Acquired | None:
        """A warm sandbox from the rollout's pool (probed first), else a host slot for a
        cold one, waiting within the admission bound (and the request's deadline, less
        ``reserve_s``), seated with its ``group``. None: the rollout appeared meanwhile (a
        concurrent first call made it). ``only_host``: a cold one on that host (a
        snapshot's: no pool holds its sandboxes). ``new`` False: for a rollout that exists
        (a paused one resuming), which waits for its slot however its record reads.
        ``tenant``: whose fair share of the hosts it waits in (state/admission.py).
        ``warm`` False: not from a pool (the tenant holds its warm sandboxes quota)."""
        started = time.monotonic()
        recycle_wait_s = deadline.cap(self.settings.pool_recycle_wait_s, reserve=reserve_s)
        for _ in range(3 if only_host is None and warm else 0):
            handle = await self.pools.take(resolved)
            if handle is None:  # a sandbox being reset for the pool is nearer than a cold one
                handle = await self.pools.take_recycled(resolved, recycle_wait_s)
            if handle is None:
                break
            if await self._usable(handle, resolved):
                return Acquired(host=handle.host, handle=handle, started=started)
            await self._discard(handle, "unusable pool sandbox")
        live = await self.queue.heartbeats.live()
        if not live:
            raise InfraError("no live worker host to create the sandbox on", rollout_id=rollout_id)
        if only_host is not None and only_host not in {beat.host for beat in live}:
            raise InfraError(
                f"host {only_host}, which keeps the snapshot, is not live",
                rollout_id=rollout_id,
                evidence={"host": only_host},
                code=Cause.SNAPSHOT_UNAVAILABLE,
            )

        async def rollout_exists() -> bool:
            return await self.store.get(rollout_id) is not None

        wait_s = deadline.cap(self.settings.admission_wait_s, reserve=reserve_s)
        host = await self.admission.take(
            rollout_id,
            give_up=rollout_exists if new else None,
            wait_s=wait_s,
            group=group,
            only_host=only_host,
            tenant=tenant,
        )
        return Acquired(host=host, handle=None, started=started) if host else None

    async def _usable(self, handle: SandboxHandle, resolved: ResolvedEnvironment) -> bool:
        """A pool sandbox may be handed out: far from its expiry, and a probe passes."""
        lifetime = resolved.environment.effective_lifetime_s(self.settings)
        if handle.expires_at.timestamp() - time.time() < lifetime / 2:
            return False
        try:
            probe = await self.probe(handle)
        except QueueTimeout:
            return False
        return probe.alive and probe.agent_ok

    async def probe(self, handle: SandboxHandle) -> ProbeResult:
        """Probe a sandbox through its host's worker; QueueTimeout when none answers
        within the longest a probe takes plus the wait for a worker."""
        return await self.queue.call(
            Tasks.PROBE_SANDBOX,
            ProbeSandbox(handle=handle),
            host=handle.host,
            timeout_s=PROBE_MAX_S + self.settings.queue_wait_s,
        )

    async def _discard(self, handle: SandboxHandle, reason: str) -> None:
        await self.pools.forget(handle)
        await self.queue.send(
            Tasks.DESTROY_SANDBOX, DestroySandbox(handle=handle, reason=reason), host=handle.host
        )
        await self.admission.release(handle.host)

    async def _give_back(self, acquired: Acquired, rollout_id: str) -> None:
        """Undo :meth:`acquire` (the rollout was created by someone else meanwhile)."""
        if acquired.handle is not None:
            await self._discard(acquired.handle, "claimed by a rollout that lost its race")
        else:
            await self.admission.release(acquired.host, rollout_id)

    async def _start_sandbox(
        self, record: Rollout, resolved: ResolvedEnvironment, acquired: Acquired
    ) -> Rollout:
        handle = acquired.handle
        if handle is not None:
            lifetime = resolved.environment.effective_lifetime_s(self.settings)
            await self.pools.bind(handle, record.rollout_id, ttl_s=lifetime)
            await self._request_refill()
        else:
            handle = await self.create_cold(record, resolved, acquired.host)
        bind_sandbox(handle.sandbox_id)
        ready_at = time.time()
        # The sandbox is made: a Redis restart now must not strand it, and its rollout
        # "creating" until the reaper calls it stuck (the update is safe to run twice).
        updated = present(
            await outlasting_an_outage(
                lambda: self.store.update(
                    record.rollout_id,
                    state=RolloutState.ACTIVE,
                    sandbox=handle,
                    host=handle.host,
                    pool_hit=acquired.handle is not None,
                    sandbox_ready_at=ready_at,
                    last_activity=ready_at,
                ),
                for_s=self.settings.sandbox_create_timeout_s,
            ),
            record.rollout_id,
            "its sandbox started",
        )
        waited = time.monotonic() - acquired.started
        source = "pool" if acquired.handle is not None else "cold"
        metrics.SANDBOX_CREATE_SECONDS.labels(source).observe(waited)
        metrics.ROLLOUTS_STARTED.labels(record.source).inc()
        log.info(
            "rollout.started",
            rollout_id=record.rollout_id,
            sandbox_id=handle.sandbox_id,
            sandbox_host=handle.host,
            environment=record.environment,
            pool_hit=acquired.handle is not None,
            ms=round(waited * 1000, 1),
        )
        if updated.state == RolloutState.INFRA_FAILED:
            raise InfraError(
                "rollout failed while its sandbox started", rollout_id=record.rollout_id
            )
        return updated

    async def create_cold(
        self, record: Rollout, resolved: ResolvedEnvironment, host: str
    ) -> SandboxHandle:
        spec = resolved.sandbox_spec(self.settings, record.rollout_id)
        if record.snapshot is not None:
            spec = spec.model_copy(update={"snapshot": record.snapshot})
        try:
            created = await self.queue.call(
                Tasks.CREATE_SANDBOX,
                CreateSandbox(
                    rollout_id=record.rollout_id,
                    trace_id=record.rollout_id,
                    spec=spec,
                    group=rollout_group(record.source, record.item),
                ),
                host=host,
                timeout_s=self.settings.sandbox_create_timeout_s,
            )
        except QueueTimeout as exc:
            created = SandboxCreated(InfraFault(error=f"no worker created the sandbox: {exc}"))
        if isinstance(created.root, InfraFault):
            # A creation that timed out may still finish: the orphan sweep takes it then.
            await self.admission.release(host)
            raise await self.closer.fail(
                record.rollout_id,
                Cause.SANDBOX_CREATE_FAILED,
                f"could not create the sandbox: {created.root.error}",
                created.root.evidence,
            )
        return created.root.handle

    async def _request_refill(self) -> None:
        """Top the pools up after a claim (queue/handlers.refill_pools). One request a second
        at most: the task tops up every pool, a burst of claims needs one of it."""
        if await self.pools.refill_due():
            await self.queue.send(Tasks.REFILL_POOLS, Nothing(), host=None)

    async def _existing(
        self,
        existing: Rollout,
        exclusive: bool,
        deadline: Deadline,
        reserve_s: float,
        caller: Principal,
    ) -> Rollout:
        """A start that found its id's record: a 409 for the rollout API (whoever's it
        is: the same answer, so an id taken says nothing of whose), else the caller's
        rollout once ready (another tenant's: unknown)."""
        if exclusive:
            raise Rejected(
                RejectedKind.CONFLICT,
                f"rollout {existing.rollout_id} exists already",
                code="exists",
            )
        owned(existing, existing.rollout_id, caller)
        return await self.wait_ready(existing, deadline, reserve_s)

    async def wait_ready(
        self, rollout: Rollout, deadline: Deadline | None = None, reserve_s: float = 0.0
    ) -> Rollout:
        """The rollout once its sandbox is ready (or it failed). Past the request's
        deadline (less ``reserve_s``) a 503 that leaves the rollout as it is."""
        bound = time.monotonic() + self.settings.sandbox_create_timeout_s + 5
        left = deadline.left(reserve=reserve_s) if deadline is not None else None
        out_of_time = left is not None and time.monotonic() + left < bound
        if left is not None:
            bound = min(bound, time.monotonic() + left)
        delay = 0.005
        while rollout.state == RolloutState.CREATING:
            if time.monotonic() >= bound:
                if out_of_time:
                    raise StillStarting(rollout.rollout_id)
                raise InfraError("sandbox creation did not finish", rollout_id=rollout.rollout_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
            rollout = present(
                await self.store.get(rollout.rollout_id),
                rollout.rollout_id,
                "its sandbox was being made",
            )
        return rollout


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Consume a shielded task's exception: its request may have stopped waiting."""
    if not task.cancelled():
        task.exception()


def _with_overrides(
    item: dict[str, Any], environment: str | None, codebase: str | None
) -> dict[str, Any]:
    row = dict(item)
    if environment is not None:
        row["environment"] = environment
    if codebase is not None:
        row["codebase"] = codebase
    return row


def _message(exc: Exception) -> str:
    text = str(exc)
    return text[1:-1] if text.startswith(("'", '"')) and text.endswith(("'", '"')) else text
