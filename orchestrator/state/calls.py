"""The call machine: a tool call's start and end on the API (one Lua step each, on the
call path's lean connection) and its run ticket, both sides, with every script and its
KEYS/ARGV contract here.

The start (:meth:`ApiCalls.begin`) answers a stored reply, or takes the call's lock, queues
its ticket, counts it in flight and sends its task message, all in one step; the end
(:meth:`ApiCalls.end`) stores the reply and the trajectory step once and takes it out of
flight. The run ticket is the fence between the API and the workers that makes a call run
at most once and keeps its result through a worker crash or a Redis restart.

A ticket is a Redis hash, ``rollout:{id}:run:{call_id}``, that moves through::

    queued ──claim (a worker)──▶ running ──finish──▶ done
      │                            │
      └─cancel (the API)─▶ cancelled      └─(its worker died)─▶ lost

Every move is one Lua compare-and-set, so a worker's claim and the API's cancel cannot both
win: a cancelled call never ran and may be sent again under the same sequence number; a
lost call may have run in part, so its rollout is ``infra_failed``. The ticket also holds
the finished call's result, so the result outlives the connection that waited for it.

Each attempt to send the call has its own ``attempt`` id; a worker only claims the attempt
the ticket names, so a stale message of an earlier attempt is skipped, never run. Each
delivery of a message claims under its own ``claim`` id, so a message delivered twice runs
once, whatever the broker does.
"""

from __future__ import annotations

import json
import time
import uuid
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from orchestrator.state.heartbeat import Heartbeat
from orchestrator.state.keys import Keys
from orchestrator.state.models import TrajectoryStep
from orchestrator.state.resp import AsyncConnection, Script, SyncConnection

TICKET_TTL_S = 86400
REPLY_TTL_S = 7 * 86400
"""How long a call's reply is kept (a trainer's retry of the same call gets it back)."""
REPLY_LIST_TTL_S = 300
"""A reply nobody popped (its caller gave up) goes after this."""


DUPLICATE_DELIVERY = "duplicate"
"""What a claim answers a second delivery of a message whose call runs already."""


class TicketState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    LOST = "lost"


class Ticket(BaseModel):
    """A ticket as read back from Redis."""

    state: TicketState | None = None
    seq: int = 0
    attempt: str = ""
    worker: str = ""
    reply_to: str = ""
    result: str = ""

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> Ticket:
        text = {_text(k): _text(v) for k, v in raw.items()}
        return cls(
            state=TicketState(text["state"]) if text.get("state") else None,
            seq=int(text.get("seq") or 0),
            attempt=text.get("attempt", ""),
            worker=text.get("worker", ""),
            reply_to=text.get("reply_to", ""),
            result=text.get("result", ""),
        )


# One round trip to start a call, and send it. KEYS: stored reply, call lock, seq counter,
# record, live set, run ticket (below), the host's heartbeat, the host's queue (the
# last two '' when not sending). ARGV: attempt (also the lock token), lock ttl (ms), now,
# rollout id, ticket ttl (s), reply list of this attempt, the task message ('': do not
# send), the rollout's call budget ('': none), the id of the sandbox the caller knows
# ('': none), the wire the host's worker must speak (its heartbeat's 'wire'). Returns
# {status, value[, dispatch outcome [, heartbeat]]} (CallStart).
# Nothing changes for a rollout that is not active, or not on that sandbox.
_BEGIN_CALL = Script("""
local stored = redis.call('GET', KEYS[1])
if stored then return {'stored', stored} end
local record = redis.call('HMGET', KEYS[4], 'state', 'infra_failure', 'ended_by')
if record[1] ~= 'active' or (record[2] or 'null') ~= 'null' or (record[3] or 'null') ~= 'null' then
  return {'ended', record[1] or ''}
end
local sandbox = ARGV[9] ~= '' and redis.call('HGET', KEYS[4], 'sandbox') or ''
if ARGV[9] ~= '' and not string.find(sandbox, ARGV[9], 1, true) then return {'moved', ''} end
local st = redis.call('HGET', KEYS[6], 'state')
if redis.call('GET', KEYS[2]) == ARGV[1] and redis.call('HGET', KEYS[6], 'attempt') == ARGV[1] then
  -- This very attempt, run twice (the connection dropped): whether it was sent is unknown.
  return {'run', redis.call('HGET', KEYS[6], 'seq'), ARGV[7] == '' and '' or 'retried'}
end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {'busy', st or ''} end
if st == 'running' or st == 'lost' then
  redis.call('DEL', KEYS[2])
  return {st, ''}
end
local seq
if st == 'done' then
  seq = redis.call('HGET', KEYS[6], 'seq')
  return {'done', seq}
elseif st == 'queued' or st == 'cancelled' then
  -- The same call, never run (a queued one is superseded: its message will be skipped).
  seq = redis.call('HGET', KEYS[6], 'seq')
else
  seq = tostring(redis.call('INCR', KEYS[3]))
end
redis.call('HSET', KEYS[6], 'state', 'queued', 'seq', seq, 'attempt', ARGV[1],
  'reply_to', ARGV[6], 'queued_at', ARGV[3])
redis.call('HDEL', KEYS[6], 'worker', 'claim', 'result')
redis.call('EXPIRE', KEYS[6], ARGV[5])
if redis.call('HGET', KEYS[6], 'open') ~= '1' then
  redis.call('HSET', KEYS[6], 'open', '1')
  redis.call('HINCRBY', KEYS[4], 'calls_in_flight', 1)
end
redis.call('HSET', KEYS[4], 'last_activity', ARGV[3])
redis.call('ZADD', KEYS[5], 'XX', ARGV[3], ARGV[4])
if ARGV[7] == '' then return {'run', seq, ''} end
if ARGV[8] ~= '' and tonumber(seq) > tonumber(ARGV[8]) then return {'run', seq, 'over_budget'} end
local beat = redis.call('GET', KEYS[7])
if not beat then return {'run', seq, 'no_worker', ''} end
local found = cjson.decode(beat)
if found['draining'] or (tonumber(found['wire']) or 0) < tonumber(ARGV[10]) then
  return {'run', seq, 'no_worker', beat}
end
redis.call('LPUSH', KEYS[8], ARGV[7])
return {'run', seq, 'sent'}
""")

# One round trip to end it; safe to run twice (a retry may finish a call whose first
# waiter died). KEYS: as above, plus the trajectory. ARGV: lock token, now, rollout id,
# reply ttl (s), reply JSON ('' when none), step JSON ('' when none). Returns the reply
# another attempt stored first (the first stored wins), or '' when the reply given is the
# one stored, or when none was given and none is stored: a reply is sent back only when
# it is not the caller's own.
_END_CALL = Script("""
local mine = false
if ARGV[5] ~= '' then
  if redis.call('SET', KEYS[1], ARGV[5], 'EX', ARGV[4], 'NX') then
    mine = true
    if ARGV[6] ~= '' then redis.call('RPUSH', KEYS[7], ARGV[6]) end
  end
end
-- (A record Redis lost is not made again, field by field, from a call's end.)
local known = redis.call('HEXISTS', KEYS[4], 'state') == 1
if redis.call('HGET', KEYS[6], 'open') == '1' then
  redis.call('HSET', KEYS[6], 'open', '0')
  if known then redis.call('HINCRBY', KEYS[4], 'calls_in_flight', -1) end
end
if known then redis.call('HSET', KEYS[4], 'last_activity', ARGV[2]) end
redis.call('ZADD', KEYS[5], 'XX', ARGV[2], ARGV[3])
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
if mine then return '' end
return redis.call('GET', KEYS[1]) or ''
""")


class CallStartStatus(StrEnum):
    """What :meth:`ApiCalls.begin` found."""

    STORED = "stored"
    """The call's reply, stored already: return it."""
    RUN = "run"
    """Go ahead, as attempt ``token`` with sequence number ``seq``."""
    DONE = "done"
    """It ran, its result is on the ticket: finish it (as ``token``)."""
    BUSY = "busy"
    """Another attempt of it holds its lock; ``ticket`` says how far it is."""
    RUNNING = "running"
    """Another attempt's worker runs it now."""
    LOST = "lost"
    """Its worker died while running it."""
    MOVED = "moved"
    """The rollout has another sandbox than the caller's (it was paused and resumed):
    nothing changed; read the record again."""
    ENDED = "ended"
    """The rollout is not active (ended, failed, or gone): nothing was changed."""


class Dispatch(BaseModel):
    """Send the call in the same step as its start, where it may run now (the rollout is
    active, the call is within its budget, the host's worker beats and is not draining)."""

    heartbeat_key: str
    queue: str
    message: str = Field(description="The task message (state/broker.task_message).")
    budget: int | None = Field(None, description="Calls the rollout may make; None: no cap.")
    wire: int = Field(
        0, description="The wire the host's worker must speak (its heartbeat's); else not sent."
    )


class DispatchOutcome(StrEnum):
    """What happened to the :class:`Dispatch` of a call that may run."""

    NOT_ASKED = ""
    SENT = "sent"
    OVER_BUDGET = "over_budget"
    """Not sent: the call's sequence number is past the rollout's budget."""
    NO_WORKER = "no_worker"
    """Not sent: the host has no live worker, or it is draining, or speaks another wire
    (``heartbeat``: its last)."""
    RETRIED = "retried"
    """The step ran twice (a dropped connection, retried): whether the first sent it is
    unknown, so the caller waits as for a sent call, whose checks of the ticket and the
    heartbeat settle it within a second."""


class CallStart(BaseModel):
    """What :meth:`ApiCalls.begin` found, and did."""

    status: CallStartStatus
    stored: dict[str, Any] | None = None
    seq: int = 0
    token: str = ""
    ticket: str = Field("", description="busy: the state of the ticket; ended: the record's.")
    dispatch: DispatchOutcome = DispatchOutcome.NOT_ASKED
    heartbeat: str = Field("", description="no_worker: the host's heartbeat JSON, if any.")


# KEYS: ticket. ARGV: attempt, worker instance, now, claim (one per delivery of the task
# message). Returns the state after the call, as the worker should read it: 'running' only
# for this delivery's own claim (run twice when the connection dropped), 'duplicate' for
# any other delivery of a call that is running already.
CLAIM = f"""
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 'missing' end
if st == 'running' then
  if redis.call('HGET', KEYS[1], 'claim') == ARGV[4] then return 'running' end
  return '{DUPLICATE_DELIVERY}'
end
if st ~= 'queued' then return st end
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 'superseded' end
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[2], 'claim', ARGV[4],
  'claimed_at', ARGV[3])
return 'running'
"""

# KEYS: ticket. ARGV: worker instance, result JSON, now, reply TTL. Returns {state,
# reply_to}. Only the worker's own running claim becomes done, and its result is pushed to
# the reply list of the ticket's current attempt in the same step (one round trip for the
# worker, and no reply without its result on the ticket); a result that comes later than
# that (the call was declared lost, or aborted at shutdown) is kept apart as evidence,
# never as the result, and nobody is told.
FINISH = """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {'missing', ''} end
if st == 'running' and redis.call('HGET', KEYS[1], 'worker') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'state', 'done', 'result', ARGV[2], 'finished_at', ARGV[3])
  -- (The list is named by the ticket, not declared in KEYS: a retry may have replaced it.)
  local reply_to = redis.call('HGET', KEYS[1], 'reply_to') or ''
  if reply_to ~= '' then
    redis.call('RPUSH', reply_to, ARGV[2])
    redis.call('EXPIRE', reply_to, ARGV[4])
  end
  return {'done', reply_to}
end
redis.call('HSET', KEYS[1], 'late_result', ARGV[2])
return {st, ''}
"""

# KEYS: ticket. ARGV: attempt. queued -> cancelled; returns the state after the call.
CANCEL = """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 'missing' end
if st == 'queued' and redis.call('HGET', KEYS[1], 'attempt') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'state', 'cancelled')
  return 'cancelled'
end
return st
"""

# KEYS: ticket. ARGV: worker instance. running (by that worker) -> lost.
MARK_LOST = """
local st = redis.call('HGET', KEYS[1], 'state')
if st == 'running' and redis.call('HGET', KEYS[1], 'worker') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'state', 'lost')
  return 'lost'
end
return st or 'missing'
"""

# Redis may be restarting: the worker holds a result nobody else has, so it keeps trying
# for a while before it gives up on it (both scripts are safe to run twice: see each).
OUTAGE_RETRY_S = 120.0


class ApiCalls:
    """The API's side: a call's start and end (one round trip each), its stored reply; read
    its ticket and its host's heartbeat while it waits, cancel it while queued, declare it
    lost when the worker that claimed it is gone. Every command on the call path's lean
    connection (state/resp.py), with its one retry policy: each is safe to run twice."""

    def __init__(self, connection: AsyncConnection, keys: Keys) -> None:
        self._keys = keys
        self._connection = connection

    def _call_keys(self, rollout_id: str, call_id: str) -> list[str]:
        return [
            self._keys.call_reply(rollout_id, call_id),
            self._keys.call_lock(rollout_id, call_id),
            self._keys.seq(rollout_id),
            self._keys.rollout(rollout_id),
            self._keys.live,
            self._keys.ticket(rollout_id, call_id),
            self._keys.trajectory(rollout_id),
        ]

    async def begin(
        self,
        rollout_id: str,
        call_id: str,
        *,
        lock_ttl_s: float,
        reply_to: str,
        token: str | None = None,
        dispatch: Dispatch | None = None,
        sandbox_id: str = "",
    ) -> CallStart:
        """In one step: the stored reply of ``call_id`` if there is one; else, if the
        rollout is active, the call's lock, a queued ticket for attempt ``token`` (a new
        sequence number, or the old one for a call that never ran), the call counted in
        flight and the rollout's activity; and, given ``dispatch``, the call sent to its
        host's queue (see :class:`Dispatch`). ``sandbox_id``: the sandbox the caller would
        send it to; another one in the record is :attr:`CallStartStatus.MOVED`. One round
        trip on the call path."""
        token = token or uuid.uuid4().hex
        keys = self._call_keys(rollout_id, call_id)[:6]
        args: list[Any] = [
            token, int(lock_ttl_s * 1000), time.time(), rollout_id, TICKET_TTL_S, reply_to,
        ]  # fmt: skip
        if dispatch is None:
            args += ["", ""]
            keys += ["", ""]
        else:
            budget = "" if dispatch.budget is None else dispatch.budget
            args += [dispatch.message, budget]
            keys += [dispatch.heartbeat_key, dispatch.queue]
        args += [sandbox_id, dispatch.wire if dispatch is not None else 0]
        status, value, *rest = await _BEGIN_CALL.run(self._connection, keys, args)
        found = CallStartStatus(status)
        if found == CallStartStatus.STORED:
            return CallStart(status=found, stored=json.loads(value))
        if found in (CallStartStatus.RUN, CallStartStatus.DONE):
            outcome = DispatchOutcome(rest[0] if rest and dispatch is not None else "")
            beat = str(rest[1]) if len(rest) > 1 else ""
            return CallStart(
                status=found, seq=int(value), token=token, dispatch=outcome, heartbeat=beat
            )
        return CallStart(status=found, ticket=value)

    async def end(
        self,
        rollout_id: str,
        call_id: str,
        token: str,
        *,
        reply: dict[str, Any] | None,
        step: TrajectoryStep | None,
    ) -> dict[str, Any] | None:
        """In one step: store the reply and the trajectory step (when the call produced
        them and no reply is stored yet), take the call out of flight, release its lock.
        Returns the reply another attempt of the call stored first, which wins over
        ``reply``; None when ``reply`` is the one stored (or none was given or stored)."""
        stored = await _END_CALL.run(
            self._connection,
            self._call_keys(rollout_id, call_id),
            [
                token,
                time.time(),
                rollout_id,
                REPLY_TTL_S,
                json.dumps(reply) if reply is not None else "",
                step.model_dump_json() if step is not None else "",
            ],
        )
        return json.loads(stored) if stored else None

    async def stored_reply(self, rollout_id: str, call_id: str) -> dict[str, Any] | None:
        key = self._keys.call_reply(rollout_id, call_id)
        raw = await self._connection.call("GET", key, retry=True)
        return json.loads(raw) if raw else None

    async def read(self, rollout_id: str, call_id: str) -> Ticket:
        key = self._keys.ticket(rollout_id, call_id)
        flat = await self._connection.call("HGETALL", key, retry=True)
        return Ticket.from_hash(dict(zip(flat[::2], flat[1::2], strict=True)))

    async def heartbeat(self, host: str) -> Heartbeat | None:
        """The host's latest heartbeat, as the call's start reads it; None when it has
        none (it stopped, or is lost)."""
        raw = await self._connection.call("GET", self._keys.heartbeat(host), retry=True)
        return Heartbeat.model_validate_json(raw) if raw else None

    async def cancel(self, rollout_id: str, call_id: str, attempt: str) -> str:
        """queued → cancelled, unless a worker claimed it first; the state after."""
        key = self._keys.ticket(rollout_id, call_id)
        return _text(await _CANCEL.run(self._connection, [key], [attempt]))

    async def mark_lost(self, rollout_id: str, call_id: str, worker: str) -> str:
        """running (by ``worker``, now dead) → lost; the state after."""
        key = self._keys.ticket(rollout_id, call_id)
        return _text(await _MARK_LOST.run(self._connection, [key], [worker]))


class WorkerCalls:
    """The worker's side: claim a call's ticket before running it, finish it after. On the
    call path: a lean connection per worker thread (state/resp.py), one round trip each."""

    def __init__(self, connection: SyncConnection, *, replicas: int = 0) -> None:
        self._connection = connection
        # Behind Sentinel: the claim and the result are on this many replicas before the
        # command runs and before the caller is told (settings.redis_replicas_to_wait), so
        # a failover can lose neither (docs/failure-model.md, "Redis failover").
        self._replicas = replicas

    def claim(self, key: str, attempt: str, instance: str, now: float, claim: str) -> str:
        """``running`` when this delivery of the call's message may run it; anything else
        (``duplicate``: another delivery runs it): skip it. ``claim`` names the delivery,
        so that this claim retried after a dropped connection still finds itself."""
        state = _CLAIM.run_sync(
            self._connection,
            [key],
            [attempt, instance, now, claim],
            retry_for_s=OUTAGE_RETRY_S,
            replicas=self._replicas,
        )
        return _text(state)

    def finish(self, key: str, instance: str, result_json: str, now: float) -> tuple[str, str]:
        """Store the result and push it to the reply list of the ticket's current attempt
        (the caller waiting now, which may be a retry of the one that sent it); returns the
        ticket's state and that list, ``''`` when nobody was told (the call was declared
        lost meanwhile)."""
        state, reply_to = _FINISH.run_sync(
            self._connection,
            [key],
            [instance, result_json, now, REPLY_LIST_TTL_S],
            retry_for_s=OUTAGE_RETRY_S,
            replicas=self._replicas,
        )
        return _text(state), _text(reply_to)

    def refuse(self, key: str, attempt: str) -> str:
        """queued → cancelled, unrun (a message this worker cannot run), unless it was
        claimed or superseded; the state after."""
        state = _CANCEL.run_sync(self._connection, [key], [attempt], retry_for_s=OUTAGE_RETRY_S)
        return _text(state)


_CLAIM = Script(CLAIM)
_FINISH = Script(FINISH)
_CANCEL = Script(CANCEL)
_MARK_LOST = Script(MARK_LOST)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
