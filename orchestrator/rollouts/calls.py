"""A rollout's tool calls: each one checked for agent mistakes before any state changes,
counted and run exactly once on the host holding the sandbox (a retry gets the stored
reply), within the request's bound, and recorded in the trajectory.

Given the start (a call may be a rollout's first: Agent RFT) and the close (a call to a
rollout that failed or ended is refused; a fault fails the rollout).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import BaseModel

from orchestrator.config import Settings
from orchestrator.environments.http_tool import HttpArgs, HttpTool, ServiceFailed
from orchestrator.environments.loader import ResolvedEnvironment
from orchestrator.observability import metrics
from orchestrator.observability.logging import bind_sandbox, in_rollout_context
from orchestrator.outcomes import Cause, Outcome
from orchestrator.rollouts.bounds import (
    Deadline,
    agent_rft_settings,
    call_bound_s,
    call_overhead_s,
)
from orchestrator.rollouts.closes import Closer
from orchestrator.rollouts.dispatch import CallDispatcher
from orchestrator.rollouts.errors import (
    CallLost,
    CallNotRun,
    CallPending,
    InfraError,
    Rejected,
    RejectedKind,
)
from orchestrator.rollouts.lookup import owned, present, unknown
from orchestrator.rollouts.models import CallReply
from orchestrator.rollouts.starts import Starter
from orchestrator.state.calls import CallStartStatus, DispatchOutcome, TicketState
from orchestrator.state.models import RolloutSource, RolloutState, TrajectoryStep
from orchestrator.state.records import Rollout, RolloutStore
from orchestrator.state.replies import WorkerClient
from orchestrator.state.wire import InfraFault, OpDone, RunOp, SandboxKilled
from orchestrator.tenants import OPERATOR, Principal
from orchestrator.tls import tls
from orchestrator.tools.base import (
    InvalidArguments,
    Tool,
    ToolResult,
    agent_error,
    sandbox_killed,
)
from orchestrator.tools.shell import LIMIT_KINDS


@dataclass(frozen=True)
class PendingCall:
    """One counted tool call on its way through :meth:`ToolCalls.call_tool`."""

    rollout: Rollout
    resolved: ResolvedEnvironment
    tool_name: str
    tool: Tool[Any]
    arguments: Any
    """As the agent sent them (the trajectory keeps these)."""
    parsed: BaseModel
    """As the tool validated them: what its operation and its result are made of."""
    tool_settings: Settings
    """The settings the tool sees (the environment's output budget; Agent RFT: capped)."""
    call_id: str
    received: float  # time.monotonic() when the request came
    started_at: datetime
    settings: Settings
    """The deployment's settings as this call's tools see them (Agent RFT: capped)."""
    deadline: Deadline
    stream_key: str | None = None
    """A client command's output stream (state/streams.py), or None."""


@dataclass(frozen=True)
class CallCheck:
    """What :meth:`ToolCalls._check_call` found: an agent mistake to answer now
    (``early``), or how long the call's command may take."""

    early: CallReply | None = None
    command_timeout_s: float = 0.0
    tool: Tool[Any] | None = None
    parsed: BaseModel | None = None
    tool_settings: Settings | None = None


class ToolCalls:
    def __init__(
        self,
        settings: Settings,
        store: RolloutStore,
        queue: WorkerClient,
        dispatcher: CallDispatcher,
        starter: Starter,
        closer: Closer,
    ) -> None:
        self.settings = settings
        self.store = store
        self.queue = queue
        self.keys = store.keys
        self.dispatcher = dispatcher
        self.starter = starter
        self.closer = closer
        self._agent_rft_settings = agent_rft_settings(settings)
        self._active = ActiveRollouts()
        self._http_client: httpx.AsyncClient | None = None

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
        stream_key: str | None = None,
        caller: Principal = OPERATOR,
    ) -> CallReply:
        """Run one tool call. ``item`` given (Agent RFT) means: start the rollout if new.
        ``stream_key``: a client command's output goes to that stream too, as printed.
        ``caller``: another tenant's rollout is unknown to it (a 404).

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
        clients = source in (RolloutSource.E2B, RolloutSource.SETUP)
        # Active with its sandbox when last seen here: no record to read. The start of the
        # call checks that it still is, in the same step (ApiCalls.begin).
        known = self._active.get(rollout_id)
        existing = None if known is not None else await self.store.get(rollout_id)
        if known is not None:
            rollout, resolved = known
            owned(rollout, rollout_id, caller)
        elif existing is not None:
            owned(existing, rollout_id, caller)
            if existing.infra_failure is not None:  # its cause, before its environment's
                await self.closer.refuse_failed(existing, "rollout failed earlier")
            resolved = self.starter.environment_of(existing)
        elif item is None:
            raise unknown(rollout_id)
        else:
            resolved = await self.starter.aresolve(item)
        # Agent mistakes are answered before any state changes (a new rollout's: before
        # anything of it exists).
        check = self._check_call(
            resolved, settings, tool_name, arguments, call_id, received, clients=clients
        )
        if check.early is not None:
            return check.early
        await self.starter.quotas.call(caller)
        if known is None:
            reserve = check.command_timeout_s + call_overhead_s(settings)
            if existing is None:  # a new rollout (Agent RFT)
                assert item is not None
                rollout = await self.starter.start(
                    rollout_id,
                    item,
                    source=source,
                    resolved=resolved,
                    deadline=deadline,
                    reserve_s=reserve,
                    caller=caller,
                )
            else:
                rollout = await self.starter.wait_ready(existing, deadline, reserve)
        bind_sandbox(rollout.sandbox.sandbox_id if rollout.sandbox else None)
        if known is None:
            if rollout.state != RolloutState.ACTIVE or rollout.infra_failure:
                # A retry gets its stored reply even after the rollout ended or failed.
                stored = await self.store.calls.stored_reply(rollout_id, call_id)
                if stored is not None:
                    return CallReply.model_validate(stored)
                await self._refuse_ended(rollout)
            if deadline.cap(math.inf) < check.command_timeout_s + call_overhead_s(settings):
                # Waiting for the sandbox took the time this call's command needs: cutting
                # the command short would score our delay as the agent's timeout. Never
                # run; the retry (a request with its own time) runs it whole.
                raise CallNotRun(
                    "too little of this request's time is left to run the call within the "
                    "platform's bound after its sandbox was made; retry",
                    rollout_id=rollout_id,
                )
            if rollout.sandbox is not None:
                self._active.put(rollout, resolved)
        assert check.tool is not None and check.parsed is not None and check.tool_settings
        pending = PendingCall(
            rollout=rollout,
            resolved=resolved,
            tool_name=tool_name,
            tool=check.tool,
            arguments=arguments,
            parsed=check.parsed,
            tool_settings=check.tool_settings,
            call_id=call_id,
            received=received,
            started_at=started_at,
            settings=settings,
            deadline=deadline,
            stream_key=stream_key,
        )
        try:
            return await self._call_once(pending)
        except SandboxMoved:
            # Paused and resumed since this process saw it (docs/snapshots.md): nothing ran;
            # once more, from its record.
            self._active.drop(rollout_id)
            return await self.call_tool(
                rollout_id,
                tool_name,
                arguments,
                call_id=call_id,
                item=item,
                source=source,
                stream_key=stream_key,
                caller=caller,
            )
        except InfraError:
            metrics.TOOL_CALLS.labels(tool_name, Outcome.INFRA_ERROR).inc()
            raise

    async def _call_outside(self, call: PendingCall, tool: HttpTool) -> CallReply:
        """A call of a tool that runs outside the sandbox (an HTTP tool), run by this
        process: begun, counted against the budget and stored like any other (a retry
        gets the stored reply; one racing its original waits for it). The service's
        failure is ours: the rollout fails with its evidence, never scored."""
        rollout_id, call_id = call.rollout.rollout_id, call.call_id
        lock_ttl = call_bound_s(call.settings) + 60
        budget = call.resolved.environment.tool_call_budget
        delay = 0.02
        while True:
            start = await self.store.calls.begin(
                rollout_id, call_id, lock_ttl_s=lock_ttl, reply_to=""
            )
            if start.status == CallStartStatus.STORED:
                assert start.stored is not None
                return CallReply.model_validate(start.stored)
            if start.status == CallStartStatus.ENDED:
                raise await self._ended(rollout_id)
            if start.status == CallStartStatus.RUN:
                break
            if call.deadline.remaining() <= 0:  # its first attempt still runs
                raise CallPending(rollout_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)
        result: ToolResult | None = None
        failed: ServiceFailed | None = None
        try:
            if budget is not None and start.seq > budget:
                result = self._over_budget(call)
            else:
                assert isinstance(call.parsed, HttpArgs)
                result = await tool.request(self._http(), call.parsed, call.tool_settings)
        except ServiceFailed as exc:
            failed = exc
        finally:
            if result is None:  # ours failed, or cancelled: out of flight, lock released
                await self.store.calls.end(rollout_id, call_id, start.token, reply=None, step=None)
        if failed is not None:
            raise await self.closer.fail(
                rollout_id, Cause.TOOL_SERVICE_FAILED, failed.message, failed.evidence
            )
        assert result is not None
        return await self._settle(call, start.seq, start.token, result)

    def _http(self) -> httpx.AsyncClient:
        """This process's client of HTTP tools' services (one pool of connections; on the
        process's one TLS context, orchestrator/tls.py)."""
        if self._http_client is None:
            self._http_client = httpx.AsyncClient(verify=tls(), follow_redirects=False)
        return self._http_client

    async def aclose(self) -> None:
        """Close the HTTP tools' client, if one was made."""
        if self._http_client is not None:
            await self._http_client.aclose()

    async def _call_once(self, call: PendingCall) -> CallReply:
        """Run the call once, or give back what its other attempt did (a retry racing
        its original, or one whose first waiter died: the result is on its ticket)."""
        if isinstance(call.tool, HttpTool):
            return await self._call_outside(call, call.tool)
        rollout, rollout_id, call_id = call.rollout, call.rollout.rollout_id, call.call_id
        bound = call_bound_s(call.settings)
        lock_ttl = bound + 60
        deadline = time.monotonic() + lock_ttl
        reply_key = self.queue.reply_key()
        budget = call.resolved.environment.tool_call_budget
        delay = 0.02
        while True:
            # The call is sent by the step that starts it, where it may run now: one round
            # trip (tests/e2e/test_round_trips.py).
            payload = self._payload(call, attempt=uuid.uuid4().hex)
            start = await self.store.calls.begin(
                rollout_id,
                call_id,
                lock_ttl_s=lock_ttl,
                reply_to=reply_key,
                token=payload.attempt,
                dispatch=self.dispatcher.prepare(payload, budget, bound),
                sandbox_id=rollout.sandbox.sandbox_id if rollout.sandbox else "",
            )
            if start.status == CallStartStatus.STORED:
                assert start.stored is not None
                return CallReply.model_validate(start.stored)
            if start.status == CallStartStatus.ENDED:
                raise await self._ended(rollout_id)
            if start.status == CallStartStatus.MOVED:
                raise SandboxMoved(rollout_id)
            if start.status == CallStartStatus.LOST or start.ticket == TicketState.LOST:
                raise await self._lost(
                    CallLost("the worker running this call died", rollout_id=rollout_id)
                )
            if start.status in (CallStartStatus.RUN, CallStartStatus.DONE):
                break
            # Another attempt of this call is under way.
            ticket = await self.store.calls.read(rollout_id, call_id)
            if ticket.state == TicketState.DONE:
                finished = OpDone.model_validate_json(ticket.result)
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
        done: OpDone | ToolResult | None = None
        try:
            if start.status == CallStartStatus.DONE:
                ticket = await self.store.calls.read(rollout_id, call_id)
                done = OpDone.model_validate_json(ticket.result)
            elif start.dispatch == DispatchOutcome.OVER_BUDGET:
                done = self._over_budget(call)
            else:
                done = await self.dispatcher.run(
                    payload, reply_key=reply_key, start=start, bound_s=bound
                )
        except CallLost as exc:
            raise await self._lost(exc) from exc
        finally:
            if done is None:  # nothing to store: out of flight, lock released
                await self.store.calls.end(rollout_id, call_id, start.token, reply=None, step=None)
        return await self._settle(call, start.seq, start.token, done)

    def _over_budget(self, call: PendingCall) -> ToolResult:
        """The answer to a call past its rollout's tool-call budget: never sent."""
        environment = call.resolved.environment
        return agent_error(
            f"the tool-call budget of {environment.tool_call_budget} calls for this "
            "rollout is spent; give your final answer now",
            "budget_exhausted",
            budget=environment.effective_output_budget(self.settings),
        )

    def _payload(self, call: PendingCall, *, attempt: str) -> RunOp:
        """The task of this attempt of the call, for its host's worker: the tool's
        operation, decided here, which the worker runs without knowing the tool."""
        rollout = call.rollout
        assert rollout.sandbox is not None
        op = call.tool.operation(call.parsed, call.tool_settings)
        environment = call.resolved.environment
        if environment.sandbox_secrets and call.stream_key is None:
            # Where each is read, never its value (the worker reads it where it runs). A
            # client's command, its output streamed as printed, is given none.
            where = {v: environment.secrets[n] for v, n in environment.sandbox_secrets.items()}
            op = op.model_copy(update={"secrets": where})
        return RunOp(
            rollout_id=rollout.rollout_id,
            trace_id=rollout.rollout_id,
            call_id=call.call_id,
            ticket=self.keys.ticket(rollout.rollout_id, call.call_id),
            attempt=attempt,
            handle=rollout.sandbox,
            op=op,
            stream_key=call.stream_key,
            enqueued_at=time.time(),
        )

    async def _ended(self, rollout_id: str) -> Exception:
        """Why a call to a rollout no longer active is refused (its start found it so)."""
        self._active.drop(rollout_id)
        # It was there when the call began (read, or active here): gone now, Redis lost it.
        rollout = present(await self.store.get(rollout_id), rollout_id, "its call began")
        await self._refuse_ended(rollout)
        return Rejected(
            RejectedKind.CONFLICT, f"rollout {rollout_id} is {rollout.state}", code="ended"
        )

    async def _lost(self, exc: CallLost) -> CallLost:
        await self.closer.mark_infra_failed(exc.rollout_id, exc.cause, exc.message, exc.evidence)
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
                return CallCheck(
                    command_timeout_s=tool.command_timeout_s(args, tool_settings),
                    tool=tool,
                    parsed=args,
                    tool_settings=tool_settings,
                )
            except InvalidArguments as exc:
                result = agent_error(exc.message, "invalid_arguments", budget=budget)
        # An unknown name is the agent's free text: never a label value.
        metrics.TOOL_CALLS.labels(tool_name if tool else "(unknown)", result.outcome).inc()
        return CallCheck(early=_reply(call_id, 0, result, (time.monotonic() - received) * 1000))

    async def _refuse_ended(self, rollout: Rollout) -> None:
        """Refuse a call to a rollout that is over: a 503 naming the cause when it failed
        or when we ended it before its grade (it must be discarded, never scored); a 409
        when the trainer itself ended it (graded, or closed through the rollout API)."""
        await self.closer.refuse_failed(rollout, "rollout failed earlier")
        if rollout.state in (RolloutState.GRADED, RolloutState.CLOSED):
            raise Rejected(
                RejectedKind.CONFLICT,
                f"rollout {rollout.rollout_id} is {rollout.state}",
                code="ended",
            )

    async def _settle(
        self, call: PendingCall, seq: int, token: str, done: OpDone | ToolResult
    ) -> CallReply:
        """Store a finished call's reply and trajectory step (the first stored wins) and
        return it; an infrastructure fault marks the rollout infra_failed instead. ``done``:
        what the call's operation did, shaped here by its tool; or a result given without
        running it (past the budget)."""
        rollout, rollout_id, call_id = call.rollout, call.rollout.rollout_id, call.call_id
        queue_ms = exec_ms = None
        if isinstance(done, ToolResult):
            result = done
        else:
            outcome = done.outcome
            if isinstance(outcome, InfraFault):
                await self.store.calls.end(rollout_id, call_id, token, reply=None, step=None)
                raise await self.closer.fail(
                    rollout_id, outcome.cause, outcome.error, outcome.evidence
                )
            if isinstance(outcome, SandboxKilled):
                budget = call.tool.fitted_budget(call.tool_settings)
                result = sandbox_killed(outcome.cause, outcome.detail, budget)
            else:
                result = call.tool.result(
                    call.parsed, call.tool_settings, outcome, duration_ms=done.exec_ms
                )
            queue_ms, exec_ms = round(done.queue_ms, 2), round(done.exec_ms, 2)
        duration_ms = (time.monotonic() - call.received) * 1000
        reply = _reply(call_id, seq, result, duration_ms)
        step = TrajectoryStep(
            seq=seq,
            call_id=call_id,
            tool=call.tool_name,
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
        stored = await self.store.calls.end(
            rollout_id, call_id, token, reply=reply.model_dump(mode="json"), step=step
        )
        metrics.TOOL_CALLS.labels(call.tool_name, result.outcome).inc()
        if result.error_kind in LIMIT_KINDS:
            # A spike of these says the environment is mis-sized: its rollouts are being
            # scored on what its limits cut, not on what the agent could do.
            metrics.LIMIT_HITS.labels(rollout.environment, result.error_kind).inc()
        metrics.TOOL_CALL_SECONDS.labels("total").observe(duration_ms / 1000)
        if queue_ms is not None and exec_ms is not None:
            metrics.TOOL_CALL_SECONDS.labels("queue").observe(queue_ms / 1000)
            metrics.TOOL_CALL_SECONDS.labels("exec").observe(exec_ms / 1000)
        # Another attempt's reply, stored first, is the call's (a retry raced its original).
        return CallReply.model_validate(stored) if stored is not None else reply


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


class SandboxMoved(Exception):
    """The rollout's sandbox is another than the one this process knew (paused and
    resumed): the call did not start."""


class ActiveRollouts:
    """The rollouts this process last saw active with a sandbox, and their environments:
    a steady call needs neither re-read, as both are fixed once a rollout is active (its
    sandbox is bound once; its environment is pinned by snapshot). Whether it is still
    active is checked by the call's start, in Redis, in the same step; a rollout found
    ended is dropped. Least recently used first out, so a long run's memory stays flat."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._known: OrderedDict[str, tuple[Rollout, ResolvedEnvironment]] = OrderedDict()

    def get(self, rollout_id: str) -> tuple[Rollout, ResolvedEnvironment] | None:
        known = self._known.get(rollout_id)
        if known is not None:
            self._known.move_to_end(rollout_id)
        return known

    def put(self, rollout: Rollout, resolved: ResolvedEnvironment) -> None:
        self._known[rollout.rollout_id] = (rollout, resolved)
        self._known.move_to_end(rollout.rollout_id)
        while len(self._known) > self._size:
            self._known.popitem(last=False)

    def drop(self, rollout_id: str) -> None:
        self._known.pop(rollout_id, None)
