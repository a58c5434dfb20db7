"""The rollout lifecycle: create a rollout's sandbox on its first call, route its calls to
the host holding it, keep calls idempotent and within budget, record the trajectory,
grade, and end.

The API calls this; it never talks to Docker. Workers run the tools (queue/tasks.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry, ResolvedEnvironment
from orchestrator.grading import Grader, GraderConfigError, ItemError, get_grader
from orchestrator.observability import metrics
from orchestrator.observability.logging import bind_sandbox, get_logger, in_rollout_context
from orchestrator.outcomes import Cause, Outcome
from orchestrator.rollouts.bounds import (
    Deadline,
    agent_rft_settings,
    call_bound_s,
    call_overhead_s,
)
from orchestrator.rollouts.dispatch import CallDispatcher
from orchestrator.rollouts.errors import (
    CallLost,
    CallNotRun,
    CallPending,
    GraderFailed,
    InfraError,
    Rejected,
    StillStarting,
)
from orchestrator.sandbox.agent.client import PROBE_MAX_S
from orchestrator.sandbox.backend import ProbeResult, SandboxHandle
from orchestrator.state.admission import Admission
from orchestrator.state.models import RolloutSource, RolloutState, TrajectoryStep
from orchestrator.state.pools import PoolClaims
from orchestrator.state.records import CallStart, Rollout, RolloutStore
from orchestrator.state.replies import QueueClient, QueueTimeout
from orchestrator.state.tasks import (
    CreateSandbox,
    DestroySandbox,
    ProbeSandbox,
    SandboxCreated,
    TaskName,
    ToolCall,
    ToolCallDone,
)
from orchestrator.state.tickets import TicketState
from orchestrator.tools.base import InvalidArguments, ToolResult, agent_error

log = get_logger(__name__)


class CallReply(BaseModel):
    """What a tool call returned to the agent (also what a retry of it gets back)."""

    call_id: str
    seq: int
    output: str
    outcome: Outcome
    exit_code: int | None = None
    duration_ms: float
    truncated: bool = False
    error_kind: str | None = None


@dataclass(frozen=True)
class Acquired:
    """Where a new rollout's sandbox comes from: a warm one (``handle``), or a cold one
    to create on ``host``, whose slot is taken."""

    host: str
    handle: SandboxHandle | None
    started: float  # time.monotonic() when the acquisition began


@dataclass(frozen=True)
class PendingCall:
    """One counted tool call on its way through :meth:`RolloutService.call_tool`."""

    rollout: Rollout
    resolved: ResolvedEnvironment
    tool: str
    arguments: Any
    call_id: str
    received: float  # time.monotonic() when the request came
    started_at: datetime
    settings: Settings
    """The deployment's settings as this call's tools see them (Agent RFT: capped)."""
    deadline: Deadline


@dataclass(frozen=True)
class CallCheck:
    """What :meth:`RolloutService._check_call` found: an agent mistake to answer now
    (``early``), or how long the call's command may take."""

    early: CallReply | None = None
    command_timeout_s: float = 0.0


class GradeReply(BaseModel):
    score: float
    details: dict[str, Any]


class RolloutService:
    def __init__(
        self,
        settings: Settings,
        store: RolloutStore,
        environments: EnvironmentRegistry,
        queue: QueueClient,
    ) -> None:
        self.settings = settings
        self.store = store
        self.environments = environments
        self.queue = queue
        self.keys = store.keys
        self.dispatcher = CallDispatcher(settings, store, queue)
        self._agent_rft_settings = agent_rft_settings(settings)
        self.admission = Admission(settings, store.redis)
        self.pools = PoolClaims(settings, store.redis)

    # -- resolving ---------------------------------------------------------------------------

    def resolve(
        self, item: dict[str, Any], *, environment: str | None = None, codebase: str | None = None
    ) -> ResolvedEnvironment:
        """The environment and codebase a rollout runs on; 422 naming what is unknown."""
        row = dict(item)
        if environment is not None:
            row["environment"] = environment
        if codebase is not None:
            row["codebase"] = codebase
        try:
            return self.environments.resolve(row)
        except LookupError as exc:
            raise Rejected(422, _message(exc), code="unknown_environment_or_codebase") from exc
        except ValueError as exc:
            raise Rejected(422, _message(exc), code="invalid_item") from exc

    async def aresolve(
        self, item: dict[str, Any], *, environment: str | None = None, codebase: str | None = None
    ) -> ResolvedEnvironment:
        """:meth:`resolve` off the event loop: a codebase lookup may ask the daemon."""
        return await asyncio.to_thread(
            self.resolve, item, environment=environment, codebase=codebase
        )

    def environment_of(self, rollout: Rollout) -> ResolvedEnvironment:
        """The rollout's environment, tools and image as pinned when it started, whatever
        the configuration says now. No I/O: this is on every call's path."""
        if rollout.environment_digest is None:  # written before rollouts were pinned
            try:
                return self.environments.for_rollout(
                    rollout.environment, rollout.image, rollout.codebase
                )
            except LookupError as exc:
                raise InfraError(
                    f"the rollout's environment is no longer configured: {exc}",
                    rollout_id=rollout.rollout_id,
                    code=Cause.ENVIRONMENT_REMOVED,
                ) from exc
        snapshot = rollout.environment_config or ""
        return self.environments.pinned(
            rollout.environment_digest,
            lambda: snapshot,
            image=rollout.image,
            codebase=rollout.codebase,
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
    ) -> Rollout:
        """Return the rollout, creating it and its sandbox if it is new.

        Concurrent first calls of one id create exactly one sandbox: one caller wins the
        record, the others wait for its sandbox. ``exclusive`` (the rollout API) makes an
        existing id a 409 instead. ``resolved``: the row, already resolved by the caller.
        ``deadline``: the request's bound, of which ``reserve_s`` is kept for the call
        that follows; a sandbox not ready by then is a 503 (:class:`StillStarting`) while
        it goes on being made for the request's retry. ``fields``: more of the record, set
        when it is created (the E2B API's state).
        """
        deadline = deadline or Deadline(None)
        if resolved is None:
            resolved = await self.aresolve(item, environment=environment, codebase=codebase)
        existing = await self.store.get(rollout_id)
        if existing is not None:
            if exclusive:
                raise Rejected(409, f"rollout {rollout_id} exists already", code="exists")
            return await self._wait_ready(existing, deadline, reserve_s)
        # One first call of a rollout acquires its sandbox; its parallel first calls wait
        # for the record instead of each taking a warm sandbox or a slot to give back.
        bound = self.settings.admission_wait_s + self.settings.sandbox_create_timeout_s + 30
        while not await self.store.take_start_lease(rollout_id, bound):
            current = await self.store.get(rollout_id)
            if current is not None:
                if exclusive:
                    raise Rejected(409, f"rollout {rollout_id} exists already", code="exists")
                return await self._wait_ready(current, deadline, reserve_s)
            await asyncio.sleep(0.02)  # (its starter failed: the lock is gone, we start it)
        try:
            # The starter before us may have finished: its record is there, the lock gone.
            acquired = None
            if await self.store.get(rollout_id) is None:
                # The sandbox's place first (a warm sandbox, or a host's slot for a cold
                # one), the record after: a rollout refused at capacity leaves nothing
                # behind, and its retry starts afresh.
                acquired = await self._acquire(rollout_id, resolved, deadline, reserve_s)
            record = _new_record(
                rollout_id,
                source,
                resolved,
                item,
                state=RolloutState.CREATING,
                host=acquired.host if acquired else None,
                **(fields or {}),
            )
            created = False
            if acquired is not None:
                try:
                    created = await self.store.create(record)
                except BaseException:  # Redis failed us: the slot must not stay taken
                    await self._give_back(acquired, rollout_id)
                    raise
            if acquired is None or not created:
                if acquired is not None:
                    await self._give_back(acquired, rollout_id)
                if exclusive:
                    raise Rejected(409, f"rollout {rollout_id} exists already", code="exists")
                current = await self.store.get(rollout_id)
                if current is None:
                    raise InfraError("the rollout vanished while it started", rollout_id=rollout_id)
                return await self._wait_ready(current, deadline, reserve_s)
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

    async def _acquire(
        self,
        rollout_id: str,
        resolved: ResolvedEnvironment,
        deadline: Deadline,
        reserve_s: float,
    ) -> Acquired | None:
        """A warm sandbox from the rollout's pool (probed first), else a host slot for a
        cold one, waiting within the admission bound (and the request's deadline, less
        ``reserve_s``). None: the rollout appeared meanwhile (a concurrent first call made
        it)."""
        started = time.monotonic()
        for _ in range(3):
            handle = await self.pools.take(resolved)
            if handle is None:
                break
            if await self._usable(handle, resolved):
                return Acquired(host=handle.host, handle=handle, started=started)
            await self._discard(handle, "unusable pool sandbox")
        if not await self.queue.heartbeats.live():
            raise InfraError("no live worker host to create the sandbox on", rollout_id=rollout_id)

        async def rollout_exists() -> bool:
            return await self.store.get(rollout_id) is not None

        wait_s = deadline.cap(self.settings.admission_wait_s, reserve=reserve_s)
        host = await self.admission.take(rollout_id, give_up=rollout_exists, wait_s=wait_s)
        return Acquired(host=host, handle=None, started=started) if host else None

    async def _usable(self, handle: SandboxHandle, resolved: ResolvedEnvironment) -> bool:
        """A pool sandbox may be handed out: far from its expiry, and a probe passes."""
        lifetime = resolved.environment.effective_lifetime_s(self.settings)
        if handle.expires_at.timestamp() - time.time() < lifetime / 2:
            return False
        try:
            probe = await self._probe(handle)
        except QueueTimeout:
            return False
        return probe.alive and probe.agent_ok

    async def _probe(self, handle: SandboxHandle) -> ProbeResult:
        """Probe a sandbox through its host's worker; QueueTimeout when none answers
        within the longest a probe takes plus the wait for a worker."""
        raw = await self.queue.call(
            TaskName.PROBE_SANDBOX,
            ProbeSandbox(handle=handle).model_dump(mode="json"),
            queue=self.keys.host_queue(handle.host),
            timeout_s=PROBE_MAX_S + self.settings.queue_wait_s,
            host_id=handle.host,
        )
        return ProbeResult.model_validate(raw)

    async def _discard(self, handle: SandboxHandle, reason: str) -> None:
        await self.pools.forget(handle)
        payload = DestroySandbox(handle=handle, reason=reason).model_dump(mode="json")
        await self.queue.send(
            TaskName.DESTROY_SANDBOX, payload, queue=self.keys.host_queue(handle.host)
        )
        await self.admission.release(handle.host)

    async def _give_back(self, acquired: Acquired, rollout_id: str) -> None:
        """Undo :meth:`_acquire` (the rollout was created by someone else meanwhile)."""
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
            handle = await self._create_cold(record, resolved, acquired.host)
        bind_sandbox(handle.sandbox_id)
        updated = await self.store.update(
            record.rollout_id,
            state=RolloutState.ACTIVE,
            sandbox=handle,
            host=handle.host,
            pool_hit=acquired.handle is not None,
            sandbox_ready_at=time.time(),
            last_activity=time.time(),
        )
        assert updated is not None
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

    async def _create_cold(
        self, record: Rollout, resolved: ResolvedEnvironment, host: str
    ) -> SandboxHandle:
        spec = resolved.sandbox_spec(self.settings, record.rollout_id)
        try:
            raw = await self.queue.call(
                TaskName.CREATE_SANDBOX,
                CreateSandbox(
                    rollout_id=record.rollout_id, trace_id=record.rollout_id, spec=spec
                ).model_dump(mode="json"),
                queue=self.keys.host_queue(host),
                timeout_s=self.settings.sandbox_create_timeout_s,
                host_id=host,
            )
            created = SandboxCreated.model_validate(raw)
        except QueueTimeout as exc:
            created = SandboxCreated(error=f"no worker created the sandbox: {exc}")
        if created.handle is None:
            # A creation that timed out may still finish: the orphan sweep takes it then.
            await self.admission.release(host)
            raise await self.fail(
                record.rollout_id,
                Cause.SANDBOX_CREATE_FAILED,
                f"could not create the sandbox: {created.error or 'unknown'}",
                {},
            )
        return created.handle

    async def _request_refill(self) -> None:
        """Top the pools up after a claim (queue/tasks.refill_pools). One request a second
        at most: the task tops up every pool, a burst of claims needs one of it."""
        if await self.pools.refill_due():
            await self.queue.send(TaskName.REFILL_POOLS, {}, queue=self.keys.shared_queue)

    async def _wait_ready(
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
            current = await self.store.get(rollout.rollout_id)
            assert current is not None
            rollout = current
        return rollout

    # -- tool calls --------------------------------------------------------------------------

    @in_rollout_context
    async def call_tool(
        self,
        rollout_id: str,
        tool_name: str,
        arguments: Any,
        *,
        call_id: str | None,
        item: dict[str, Any] | None = None,
        source: RolloutSource = RolloutSource.API,
    ) -> CallReply:
        """Run one tool call. ``item`` given (Agent RFT) means: start the rollout if new.

        Agent mistakes (unknown tool, bad arguments, spent budget) come back as
        ``agent_error`` replies without touching the sandbox; infrastructure faults raise
        :class:`InfraError` and mark the rollout ``infra_failed``.
        """
        received = time.monotonic()
        started_at = datetime.now(UTC)
        call_id = call_id or f"auto_{time.time_ns()}"
        deadline = Deadline.for_source(self.settings, source)
        settings = self._settings_for(source)
        # Only a client that drives its sandbox itself may run a client tool: never a model.
        clients = source == RolloutSource.E2B
        existing = await self.store.get(rollout_id)
        if existing is None:
            if item is None:
                raise Rejected(404, f"unknown rollout {rollout_id}", code="unknown_rollout")
            # A new rollout (Agent RFT): agent mistakes are answered before anything exists.
            resolved = await self.aresolve(item)
            check = self._check_call(
                resolved, settings, tool_name, arguments, call_id, received, clients=clients
            )
            if check.early is not None:
                return check.early
            rollout = await self.start(
                rollout_id,
                item,
                source=source,
                resolved=resolved,
                deadline=deadline,
                reserve_s=check.command_timeout_s + call_overhead_s(settings),
            )
        else:
            resolved = self.environment_of(existing)
            check = self._check_call(
                resolved, settings, tool_name, arguments, call_id, received, clients=clients
            )
            if check.early is not None:
                return check.early
            reserve = check.command_timeout_s + call_overhead_s(settings)
            rollout = await self._wait_ready(existing, deadline, reserve)
        bind_sandbox(rollout.sandbox.sandbox_id if rollout.sandbox else None)
        if rollout.state != RolloutState.ACTIVE or rollout.infra_failure:
            # A retry gets its stored reply even after the rollout ended or failed.
            stored = await self.store.stored_reply(rollout_id, call_id)
            if stored is not None:
                return CallReply.model_validate(stored)
            await self._refuse_ended(rollout)
        if deadline.cap(math.inf) < check.command_timeout_s + call_overhead_s(settings):
            # Waiting for the sandbox took the time this call's command needs: cutting the
            # command short would score our delay as the agent's timeout. Never run; the
            # retry (a request with its own time) runs it whole.
            raise CallNotRun(
                "too little of this request's time is left to run the call within the "
                "platform's bound after its sandbox was made; retry",
                rollout_id=rollout_id,
            )
        pending = PendingCall(
            rollout=rollout,
            resolved=resolved,
            tool=tool_name,
            arguments=arguments,
            call_id=call_id,
            received=received,
            started_at=started_at,
            settings=settings,
            deadline=deadline,
        )
        try:
            return await self._call_once(pending)
        except InfraError:
            metrics.TOOL_CALLS.labels(tool_name, Outcome.INFRA_ERROR).inc()
            raise

    async def _call_once(self, call: PendingCall) -> CallReply:
        """Run the call once, or give back what its other attempt did (a retry racing
        its original, or one whose first waiter died: the result is on its ticket)."""
        rollout, rollout_id, call_id = call.rollout, call.rollout.rollout_id, call.call_id
        lock_ttl = call_bound_s(call.settings) + 60
        deadline = time.monotonic() + lock_ttl
        reply_key = self.queue.reply_key()
        delay = 0.02
        while True:
            start = await self.store.begin_call(
                rollout_id, call_id, lock_ttl_s=lock_ttl, reply_to=reply_key
            )
            if start.status == "stored":
                assert start.stored is not None
                return CallReply.model_validate(start.stored)
            if start.status == "lost" or start.ticket == "lost":
                raise await self._lost(
                    CallLost("the worker running this call died", rollout_id=rollout_id)
                )
            if start.status in ("run", "done"):
                break
            # Another attempt of this call is under way.
            ticket = await self.store.tickets.read(rollout_id, call_id)
            if ticket.state == TicketState.DONE:
                finished = ToolCallDone.model_validate_json(ticket.result)
                return await self._settle(call, ticket.seq, "", finished)
            if ticket.state == TicketState.RUNNING and rollout.sandbox is not None:
                try:
                    await self.dispatcher.check_running(
                        rollout_id, call_id, rollout.sandbox.host, ticket
                    )
                except CallLost as exc:
                    raise await self._lost(exc) from exc
            if time.monotonic() > deadline:
                raise InfraError(f"call {call_id} never finished", rollout_id=rollout_id)
            if call.deadline.remaining() <= 0:
                raise CallPending(rollout_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)
        done: ToolCallDone | None = None
        try:
            if start.status == "done":
                ticket = await self.store.tickets.read(rollout_id, call_id)
                done = ToolCallDone.model_validate_json(ticket.result)
            else:
                done = await self._dispatch(call, start, reply_key)
        except CallLost as exc:
            raise await self._lost(exc) from exc
        finally:
            if done is None:  # nothing to store: out of flight, lock released
                await self.store.end_call(rollout_id, call_id, start.token, reply=None, step=None)
        return await self._settle(call, start.seq, start.token, done)

    async def _dispatch(self, call: PendingCall, start: CallStart, reply_key: str) -> ToolCallDone:
        """The call's result: from its host's worker, or the spent budget's answer."""
        rollout, resolved = call.rollout, call.resolved
        budget = resolved.environment.tool_call_budget
        if budget is not None and start.seq > budget:
            return ToolCallDone(
                result=agent_error(
                    f"the tool-call budget of {budget} calls for this rollout is spent; "
                    "give your final answer now",
                    "budget_exhausted",
                    budget=resolved.environment.effective_output_budget(self.settings),
                )
            )
        assert rollout.sandbox is not None
        payload = ToolCall(
            rollout_id=rollout.rollout_id,
            trace_id=rollout.rollout_id,
            call_id=call.call_id,
            ticket=self.keys.ticket(rollout.rollout_id, call.call_id),
            attempt=start.token,
            environment=resolved.environment.name,
            environment_digest=resolved.environment.digest,
            handle=rollout.sandbox,
            tool=call.tool,
            arguments=call.arguments,
            command_timeout_max_s=call.settings.command_timeout_max_s,
            enqueued_at=time.time(),
        )
        return await self.dispatcher.run(payload, reply_key=reply_key)

    async def _lost(self, exc: CallLost) -> CallLost:
        await self.mark_infra_failed(exc.rollout_id, exc.cause, exc.message, exc.evidence)
        return exc

    def _settings_for(self, source: RolloutSource) -> Settings:
        """The settings a request's tools see: Agent RFT's commands are capped so that its
        calls fit the platform's bound (rollouts/bounds.py)."""
        return self._agent_rft_settings if source == RolloutSource.AGENT_RFT else self.settings

    def _check_call(
        self,
        resolved: ResolvedEnvironment,
        settings: Settings,
        tool_name: str,
        arguments: Any,
        call_id: str,
        received: float,
        *,
        clients: bool,
    ) -> CallCheck:
        """Agent mistakes caught before any state changes: no sandbox, no budget spent."""
        budget = resolved.environment.effective_output_budget(settings)
        tool = resolved.tool(tool_name, clients=clients)
        if tool is None:
            known = ", ".join(sorted(resolved.tools))
            result = agent_error(
                f"unknown tool {tool_name!r}; this environment's tools are: {known}",
                "unknown_tool",
                budget=budget,
            )
        else:
            tool_settings = resolved.tool_settings(settings)
            try:
                args = tool.parse(arguments, tool_settings)
                return CallCheck(command_timeout_s=tool.command_timeout_s(args, tool_settings))
            except InvalidArguments as exc:
                result = agent_error(exc.message, "invalid_arguments", budget=budget)
        # An unknown name is the agent's free text: never a label value.
        metrics.TOOL_CALLS.labels(tool_name if tool else "(unknown)", result.outcome).inc()
        return CallCheck(early=_reply(call_id, 0, result, (time.monotonic() - received) * 1000))

    async def _refuse_ended(self, rollout: Rollout) -> None:
        """Refuse a call to a rollout that is over: a 503 naming the cause when it failed
        or when we ended it before its grade (it must be discarded, never scored); a 409
        when the trainer itself ended it (graded, or closed through the rollout API)."""
        await self._refuse_failed(rollout, "rollout failed earlier")
        if rollout.state in (RolloutState.GRADED, RolloutState.CLOSED):
            raise Rejected(409, f"rollout {rollout.rollout_id} is {rollout.state}", code="ended")

    async def _refuse_failed(self, rollout: Rollout, context: str) -> None:
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

    async def _settle(
        self, call: PendingCall, seq: int, token: str, done: ToolCallDone
    ) -> CallReply:
        """Store a finished call's reply and trajectory step (the first stored wins) and
        return it; an infrastructure fault marks the rollout infra_failed instead."""
        rollout, rollout_id, call_id = call.rollout, call.rollout.rollout_id, call.call_id
        if done.result is None:
            await self.store.end_call(rollout_id, call_id, token, reply=None, step=None)
            message = done.infra_error or "tool call failed"
            raise await self.fail(rollout_id, done.cause, message, done.evidence)
        result = done.result
        ran = rollout.sandbox is not None and (done.queue_ms or done.exec_ms)
        queue_ms = round(done.queue_ms, 2) if ran else None
        exec_ms = round(done.exec_ms, 2) if ran else None
        duration_ms = (time.monotonic() - call.received) * 1000
        reply = _reply(call_id, seq, result, duration_ms)
        step = TrajectoryStep(
            seq=seq,
            call_id=call_id,
            tool=call.tool,
            arguments=call.arguments,
            outcome=result.outcome,
            exit_code=result.exit_code,
            output=result.output,
            truncated=result.truncated,
            error_kind=result.error_kind,
            started_at=call.started_at,
            duration_ms=round(duration_ms, 2),
            queue_ms=queue_ms,
            exec_ms=exec_ms,
        )
        stored = await self.store.end_call(
            rollout_id, call_id, token, reply=reply.model_dump(mode="json"), step=step
        )
        metrics.TOOL_CALLS.labels(call.tool, result.outcome).inc()
        metrics.TOOL_CALL_SECONDS.labels("total").observe(duration_ms / 1000)
        if queue_ms is not None and exec_ms is not None:
            metrics.TOOL_CALL_SECONDS.labels("queue").observe(queue_ms / 1000)
            metrics.TOOL_CALL_SECONDS.labels("exec").observe(exec_ms / 1000)
        return CallReply.model_validate(stored) if stored is not None else reply

    async def fail(
        self, rollout_id: str, cause: str, message: str, evidence: dict[str, Any]
    ) -> InfraError:
        """:meth:`mark_infra_failed`, then the error to raise for it."""
        await self.mark_infra_failed(rollout_id, cause, message, evidence)
        return InfraError(message, rollout_id=rollout_id, evidence=evidence, code=cause)

    async def mark_infra_failed(
        self, rollout_id: str, cause: str, message: str, evidence: dict[str, Any]
    ) -> None:
        """Sticky: the rollout will never be graded, only 503s from now on."""
        failure = {"cause": cause, "message": message, "evidence": evidence, "at": time.time()}
        metrics.INFRA_ERRORS.labels(cause).inc()
        await self.store.mark_infra_failed(rollout_id, failure, outcome=Outcome.INFRA_ERROR)
        log.error("rollout.infra_failed", rollout_id=rollout_id, cause=cause, error=message)

    # -- grading -----------------------------------------------------------------------------

    @in_rollout_context
    async def grade(
        self,
        rollout_id: str,
        answer: str,
        item: dict[str, Any] | None,
        *,
        source: RolloutSource,
    ) -> GradeReply:
        """Grade once; a retry (even a concurrent one) gets the score stored first. An
        infra-failed rollout is a 503. A rejected grade (422) stores nothing."""
        rollout = await self.store.get(rollout_id)
        if rollout is None:
            if source != RolloutSource.AGENT_RFT or item is None:
                raise Rejected(404, f"unknown rollout {rollout_id}", code="unknown_rollout")
            # A rollout may end without a single tool call: grade it on an empty trajectory,
            # and keep a record only once the grade succeeded.
            resolved = await self.aresolve(item)
            graded = await self._run_grader(self._grader(resolved), rollout_id, answer, item, [])
            record = _new_record(
                rollout_id,
                source,
                resolved,
                item,
                state=RolloutState.GRADED,
                graded_at=time.time(),
                score=graded.score,
                grade_details=graded.details,
                outcome=Outcome.OK,
            )
            if await self.store.create(record):
                return graded
            rollout = await self.store.get(rollout_id)
            assert rollout is not None
        rollout = await self._wait_ready(rollout, Deadline.for_source(self.settings, source))
        bind_sandbox(rollout.sandbox.sandbox_id if rollout.sandbox else None)
        await self._refuse_failed(rollout, "rollout failed")
        if rollout.score is not None:
            return GradeReply(score=rollout.score, details=rollout.grade_details or {})
        grader = self._grader(self.environment_of(rollout))
        if grader.needs_sandbox:
            # Only a grader that reads the sandbox needs it alive; one that scores the
            # answer against the row and the trajectory (file_f1, numeric_match) does not,
            # so a sandbox that is slow, or dead after its last call, changes nothing.
            await self._probe_before_grading(rollout)
        trajectory = await self.store.trajectory(rollout_id)
        graded = await self._run_grader(
            grader, rollout_id, answer, item if item is not None else rollout.item, trajectory
        )
        fields: dict[str, Any] = {
            "score": graded.score,
            "grade_details": graded.details,
            "graded_at": time.time(),
            "outcome": Outcome.OK,
            "last_activity": time.time(),
        }
        if rollout.state != RolloutState.CLOSED:
            fields["state"] = RolloutState.GRADED
        updated = await self.store.update(rollout_id, once=True, **fields)
        if updated is None or updated.score is None:
            raise InfraError("the rollout vanished while it was graded", rollout_id=rollout_id)
        metrics.ROLLOUTS_GRADED.inc()
        metrics.GRADE_SCORE.observe(updated.score)
        log.info(
            "rollout.graded", rollout_id=rollout_id, score=updated.score, tool_calls=len(trajectory)
        )
        return GradeReply(score=updated.score, details=updated.grade_details or {})

    async def _probe_before_grading(self, rollout: Rollout) -> None:
        """For a grader that needs the sandbox: a sandbox that died behind the agent's
        back (not by its own doing) makes the score unsound, so the rollout is
        infra_failed rather than scored. A slow sandbox is a live one."""
        handle = rollout.sandbox
        if handle is None or rollout.closed_at is not None:
            return
        try:
            probe = await self._probe(handle)
        except QueueTimeout as exc:
            raise await self.fail(
                rollout.rollout_id,
                Cause.PROBE_FAILED,
                f"the sandbox could not be checked before grading: {exc}",
                {},
            ) from exc
        if (probe.alive and probe.agent_ok) or probe.agent_caused:
            return
        evidence = {"probe": probe.model_dump(mode="json")}
        message = f"the sandbox is not healthy: {probe.detail or probe.state}"
        raise await self.fail(rollout.rollout_id, Cause.SANDBOX_DEAD, message, evidence)

    def _grader(self, resolved: ResolvedEnvironment) -> Grader:
        """The rollout's grader; a misconfigured one is a 503 (checked at start, so only a
        pinned environment from an older configuration can get here)."""
        config = resolved.environment.grader
        try:
            return get_grader(config.name, config.options)
        except GraderConfigError as exc:
            metrics.GRADER_ERRORS.inc()
            raise GraderFailed(f"grader misconfigured: {exc}") from exc

    async def _run_grader(
        self,
        grader: Grader,
        rollout_id: str,
        answer: str,
        row: dict[str, Any],
        trajectory: list[TrajectoryStep],
    ) -> GradeReply:
        try:
            graded = await asyncio.to_thread(grader.grade, answer, row, trajectory)
        except ItemError as exc:
            raise Rejected(
                422, f"the dataset row cannot be graded: {exc}", code="invalid_item"
            ) from exc
        except Exception as exc:  # any grader bug is a 503, never a 0
            metrics.GRADER_ERRORS.inc()
            log.exception("grade.failed", rollout_id=rollout_id)
            raise GraderFailed(f"grader {grader.name} failed: {exc!r}") from exc
        return GradeReply(
            score=graded.score, details={**graded.details, "tool_calls": len(trajectory)}
        )

    # -- ending ------------------------------------------------------------------------------

    @in_rollout_context
    async def close(
        self,
        rollout_id: str,
        reason: str,
        *,
        wait: bool = True,
        ended_by: Cause | None = None,
        why: str = "",
    ) -> Rollout:
        """Destroy the sandbox and close the record (an infra-failed rollout stays so).

        ``ended_by``: the orchestrator ends the rollout on its own (``why`` says what
        happened, for the trainer): a call or grade that comes later finds it failed with
        that cause, so the trainer discards it instead of scoring it."""
        rollout = await self.store.get(rollout_id)
        if rollout is None:
            raise Rejected(404, f"unknown rollout {rollout_id}", code="unknown_rollout")
        bind_sandbox(rollout.sandbox.sandbox_id if rollout.sandbox else None)
        if rollout.sandbox is not None and rollout.closed_at is None:
            payload = DestroySandbox(handle=rollout.sandbox, reason=reason).model_dump(mode="json")
            queue = self.keys.host_queue(rollout.sandbox.host)
            if wait:
                try:
                    await self.queue.call(
                        TaskName.DESTROY_SANDBOX,
                        payload,
                        queue=queue,
                        timeout_s=30,
                        host_id=rollout.sandbox.host,
                    )
                except QueueTimeout as exc:
                    # The host's label sweep destroys it when the worker is back.
                    log.warning("rollout.destroy_deferred", rollout_id=rollout_id, error=str(exc))
            else:
                await self.queue.send(TaskName.DESTROY_SANDBOX, payload, queue=queue)
        if rollout.sandbox is not None and rollout.closed_at is None:
            await self.admission.release(rollout.sandbox.host)
        state = rollout.state if rollout.state == RolloutState.INFRA_FAILED else RolloutState.CLOSED
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
        updated = await self.store.update(rollout_id, **fields)
        assert updated is not None
        if rollout.closed_at is None:  # counted once, by the close that ended it
            metrics.ROLLOUTS_FINISHED.labels(updated.outcome or Outcome.OK).inc()
            metrics.TOOL_CALLS_PER_ROLLOUT.observe(await self.store.call_count(rollout_id))
        log.info("rollout.closed", rollout_id=rollout_id, reason=reason)
        return updated


def _new_record(
    rollout_id: str,
    source: RolloutSource,
    resolved: ResolvedEnvironment,
    item: dict[str, Any],
    *,
    state: RolloutState,
    **fields: Any,
) -> Rollout:
    now = time.time()
    return Rollout(
        rollout_id=rollout_id,
        source=source,
        environment=resolved.environment.name,
        codebase=resolved.codebase,
        image=resolved.image,
        environment_digest=resolved.environment.digest,
        environment_config=resolved.environment.snapshot,
        state=state,
        item=item,
        created_at=now,
        last_activity=now,
        **fields,
    )


def _reply(call_id: str, seq: int, result: ToolResult, duration_ms: float) -> CallReply:
    return CallReply(
        call_id=call_id,
        seq=seq,
        output=result.output,
        outcome=result.outcome,
        exit_code=result.exit_code,
        duration_ms=round(duration_ms, 2),
        truncated=result.truncated,
        error_kind=result.error_kind,
    )


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Consume a shielded task's exception: its request may have stopped waiting."""
    if not task.cancelled():
        task.exception()


def _message(exc: Exception) -> str:
    text = str(exc)
    return text[1:-1] if text.startswith(("'", '"')) and text.endswith(("'", '"')) else text
