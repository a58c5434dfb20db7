"""Sending one counted tool call to the worker host that holds the rollout's sandbox and
waiting for its result: never run twice, never lost (the call machine and its run ticket,
state/calls.py).

While it waits, the dispatcher watches the call's ticket and the host's heartbeat, so a
call's fate is known within about a second whatever happens to the worker:

- the worker claimed it and then died, or was replaced by a new instance: the call is
  ``lost`` (:class:`CallLost`; it may have run in part);
- nobody claimed it and the host has no live worker, or is draining, or the wait ran out:
  it is cancelled, atomically against a late claim, and reported as never run
  (:class:`CallNotRun`; a retry may run it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from orchestrator.config import Settings
from orchestrator.outcomes import Cause
from orchestrator.rollouts.errors import CallLost, CallNotRun
from orchestrator.state.calls import CallStart, Dispatch, DispatchOutcome, Ticket, TicketState
from orchestrator.state.heartbeat import Heartbeat
from orchestrator.state.records import RolloutStore
from orchestrator.state.replies import WorkerClient
from orchestrator.state.wire import WIRE_VERSION, OpDone, RunOp, Tasks

CHECK_S = 1.0
# A missing heartbeat must stay missing this many intervals before a running call's worker
# counts as gone (its key expires three intervals after the last beat anyway).
HEARTBEAT_GRACE_BEATS = 2.0


class CallDispatcher:
    def __init__(self, settings: Settings, store: RolloutStore, queue: WorkerClient) -> None:
        self.settings = settings
        self.store = store
        self.queue = queue

    def prepare(self, call: RunOp, budget: int | None, bound_s: float) -> Dispatch:
        """What :meth:`ApiCalls.begin` needs to send ``call`` in its own step; ``bound_s``:
        the call's bound (rollouts/bounds.call_bound_s), its message's expiry."""
        host = call.handle.host
        message = self.queue.message(Tasks.RUN_OP, call, host=host, expires=bound_s)
        return Dispatch(
            heartbeat_key=self.store.keys.heartbeat(host),
            queue=self.queue.queue_of(host),
            message=message,
            budget=budget,
            wire=WIRE_VERSION,
        )

    async def run(self, call: RunOp, *, reply_key: str, start: CallStart, bound_s: float) -> OpDone:
        """Await the result of ``call`` (whose ticket is queued for ``call.attempt``, and
        which ``start`` sent, or found no live worker to send to), for at most ``bound_s``:
        the longest command, the wait for a worker, the exec agent's reply allowance and a
        probe after it (rollouts/bounds.py)."""
        host = call.handle.host
        beat: Heartbeat | None = None
        if start.dispatch == DispatchOutcome.NO_WORKER:
            beat = Heartbeat.model_validate_json(start.heartbeat) if start.heartbeat else None
            if beat is not None and not beat.draining and beat.wire < WIRE_VERSION:
                why = f"host {host!r} runs a worker of an earlier release (its wire {beat.wire})"
            else:
                why = f"host {host!r} has no live worker"
            await self._cancel(call, why, beat)
        else:
            assert start.dispatch in (DispatchOutcome.SENT, DispatchOutcome.RETRIED), start
        deadline = time.monotonic() + bound_s
        while True:
            remaining = deadline - time.monotonic()
            reply = await self.queue.wait_reply(reply_key, max(0.01, min(remaining, CHECK_S)))
            if reply is not None:
                return OpDone.model_validate(reply)
            ticket = await self.store.calls.read(call.rollout_id, call.call_id)
            if ticket.state == TicketState.DONE:
                return OpDone.model_validate_json(ticket.result)
            if ticket.state == TicketState.QUEUED:
                beat = await self.store.calls.heartbeat(host)
                if beat is None or beat.draining:
                    await self._cancel(call, f"host {host!r} lost its worker", beat)
                if time.monotonic() > deadline:
                    await self._cancel(call, "no worker took it in time", beat)
                    if ticket.attempt != call.attempt:
                        raise CallNotRun(
                            "superseded by a retry of the same call", rollout_id=call.rollout_id
                        )
            elif ticket.state == TicketState.RUNNING:
                await self.check_running(call.rollout_id, call.call_id, host, ticket)
                if time.monotonic() > deadline:
                    raise CallLost(
                        f"the call ran past its {bound_s:.0f} s bound on {host!r}",
                        rollout_id=call.rollout_id,
                        evidence={"ticket": _evidence(ticket)},
                        cause=Cause.CALL_OVERRAN,
                    )
            elif ticket.state == TicketState.CANCELLED:
                raise CallNotRun("the call was cancelled", rollout_id=call.rollout_id)
            else:  # lost, or gone (Redis lost it): whether it ran is unknown
                raise CallLost(
                    f"the call's run ticket is {ticket.state or 'missing'}",
                    rollout_id=call.rollout_id,
                    evidence={"ticket": _evidence(ticket)},
                )

    async def check_running(self, rollout_id: str, call_id: str, host: str, ticket: Ticket) -> None:
        """Raise :class:`CallLost` if the worker instance running the call is gone."""
        beat = await self.store.calls.heartbeat(host)
        if beat is None:
            # Gone only if it stays gone: a Redis that just restarted may have lost the
            # worker's last beat (AOF syncs every second), and the next one is on its way.
            beat = await self._heartbeat_within(host, HEARTBEAT_GRACE_BEATS)
        if beat is not None and beat.instance == ticket.worker:
            return
        state = await self.store.calls.mark_lost(rollout_id, call_id, ticket.worker)
        if state == TicketState.LOST:
            why = "stopped" if beat is None else "was replaced by a new worker instance"
            raise CallLost(
                f"the worker running this call on host {host!r} {why}",
                rollout_id=rollout_id,
                evidence={"ticket": _evidence(ticket), "heartbeat": _beat_evidence(beat)},
            )

    async def _heartbeat_within(self, host: str, beats: float) -> Heartbeat | None:
        """The host's heartbeat if one appears within ``beats`` heartbeat intervals."""
        deadline = time.monotonic() + beats * self.settings.heartbeat_interval_s
        while time.monotonic() < deadline:
            await asyncio.sleep(min(0.25, self.settings.heartbeat_interval_s / 4))
            beat = await self.store.calls.heartbeat(host)
            if beat is not None:
                return beat
        return None

    async def _cancel(self, call: RunOp, why: str, beat: Heartbeat | None) -> None:
        """Cancel the queued call; if a worker claimed it meanwhile, keep waiting."""
        state = await self.store.calls.cancel(call.rollout_id, call.call_id, call.attempt)
        if state == TicketState.CANCELLED:
            raise CallNotRun(
                f"the call was not run: {why}; it is safe to retry",
                rollout_id=call.rollout_id,
                evidence={"heartbeat": _beat_evidence(beat)},
            )


def _evidence(ticket: Ticket) -> dict[str, Any]:
    return ticket.model_dump(exclude={"result"})


def _beat_evidence(beat: Heartbeat | None) -> dict[str, Any] | None:
    return beat.model_dump(mode="json") if beat is not None else None
