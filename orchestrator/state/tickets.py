"""The run ticket of one tool call: the fence between the API and the workers that makes a
call run at most once and keeps its result through a worker crash or a Redis restart.

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

from enum import StrEnum
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel

from orchestrator.state.keys import Keys
from orchestrator.state.resp import Script, SyncConnection

TICKET_TTL_S = 86400
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


class ApiTickets:
    """The API's side: read a call's ticket, cancel it while queued, declare it lost when
    the worker that claimed it is gone. (A ticket is made queued by the call's start,
    state/records.RolloutStore.begin_call, in the same step as its lock.)"""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._keys = keys
        self._redis = client
        self._cancel = client.register_script(CANCEL)
        self._mark_lost = client.register_script(MARK_LOST)

    async def read(self, rollout_id: str, call_id: str) -> Ticket:
        raw = await self._redis.hgetall(self._keys.ticket(rollout_id, call_id))
        return Ticket.from_hash(raw)

    async def cancel(self, rollout_id: str, call_id: str, attempt: str) -> str:
        """queued → cancelled, unless a worker claimed it first; the state after."""
        key = self._keys.ticket(rollout_id, call_id)
        return _text(await self._cancel(keys=[key], args=[attempt]))

    async def mark_lost(self, rollout_id: str, call_id: str, worker: str) -> str:
        """running (by ``worker``, now dead) → lost; the state after."""
        key = self._keys.ticket(rollout_id, call_id)
        return _text(await self._mark_lost(keys=[key], args=[worker]))


class WorkerTickets:
    """The worker's side: claim a ticket before running its call, finish it after. On the
    call path: a lean connection per worker thread (state/resp.py), one round trip each."""

    def __init__(self, connection: SyncConnection) -> None:
        self._connection = connection

    def claim(self, key: str, attempt: str, instance: str, now: float, claim: str) -> str:
        """``running`` when this delivery of the call's message may run it; anything else
        (``duplicate``: another delivery runs it): skip it. ``claim`` names the delivery,
        so that this claim retried after a dropped connection still finds itself."""
        state = _CLAIM.run_sync(
            self._connection, [key], [attempt, instance, now, claim], retry_for_s=OUTAGE_RETRY_S
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
        )
        return _text(state), _text(reply_to)


_CLAIM = Script(CLAIM)
_FINISH = Script(FINISH)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
