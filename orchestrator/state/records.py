"""Rollout state in Redis: the record, the trajectory, idempotent call results, locks.

The keys are state/keys.py's: the record ``rollout:{id}`` (a hash, see :class:`Rollout`),
its trajectory, its call counter (budget and trajectory order), each call's stored reply
(returned to retries) and lock (a racing retry waits), the live set (id -> last activity;
the reaper walks it), the listing index (id -> creation time, every rollout: an entry is a
hundredth of what its record and trajectory keep, and records are never expired either) and
the newest RECENT_FAILURES_MAX infrastructure failures.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from orchestrator.config import Settings
from orchestrator.outcomes import Cause, Outcome
from orchestrator.sandbox.backend import CommitWorkspace, SandboxHandle
from orchestrator.state.calls import ApiCalls
from orchestrator.state.connection import async_redis_client
from orchestrator.state.keys import Keys
from orchestrator.state.models import RolloutSource, RolloutState, TrajectoryStep
from orchestrator.state.resp import (
    CONNECT_TIMEOUT_S,
    REPLY_TIMEOUT_S,
    AsyncConnection,
    BlockingPool,
)
from orchestrator.state.sentinel import is_sentinel
from orchestrator.tenants import DEFAULT_TENANT

RECENT_FAILURES_MAX = 100
"""Entries kept in the list of recent infrastructure failures."""


class GradeInputs(BaseModel):
    """What a grade read besides the row and the trajectory (both kept already), and which
    grader read it: enough to grade the rollout again with another grader."""

    answer: str
    sample: dict[str, Any] = Field(
        default_factory=dict, description="The trainer's output as sent ({} for an answer)."
    )
    grader: str = Field(description="The grader's name or path.")
    grader_digest: str = Field(description="GraderConfig.digest: its name and options.")
    environment_digest: str | None = None


class Rollout(BaseModel):
    """The record of one rollout."""

    rollout_id: str
    source: RolloutSource = Field(description="Which API the rollout came through.")
    tenant: str = Field(
        DEFAULT_TENANT, description="Whose it is: only its tenant (or an admin) sees it."
    )
    environment: str
    codebase: str | None = None
    image: str
    workspace: CommitWorkspace | None = Field(
        None, description="The repository at a commit its /workspace is (the row's)."
    )
    state: RolloutState
    host: str | None = None
    sandbox: SandboxHandle | None = None
    item: dict[str, Any] = Field(default_factory=dict)
    created_at: float
    last_activity: float
    sandbox_ready_at: float | None = None
    graded_at: float | None = None
    closed_at: float | None = None
    score: float | None = None
    grade_details: dict[str, Any] | None = None
    grade_inputs: GradeInputs | None = Field(
        None, description="What the score was computed from, kept for regrading and export."
    )
    outcome: Outcome | None = None
    infra_failure: dict[str, Any] | None = Field(
        None, description="Why the rollout was marked infra_failed, with the evidence."
    )
    calls_in_flight: int = Field(0, description="Running calls: a busy rollout is not idle.")
    pool_hit: bool | None = Field(None, description="Its sandbox came warm from a pool.")
    environment_digest: str | None = Field(
        None, description="The environment pinned at the start (EnvironmentConfig.digest)."
    )
    environment_config: str | None = Field(
        None, description="The pinned environment's snapshot (EnvironmentConfig.snapshot)."
    )
    state_epoch: str | None = Field(
        None,
        description=(
            "Behind Sentinel, the Redis primary's replication id when the record was made; "
            "another one at its grade means a failover in between, which may have lost "
            'writes of this record (docs/failure-model.md, "Redis failover").'
        ),
    )
    e2b: dict[str, Any] | None = Field(
        None, description="An E2B sandbox's state (orchestrator/e2b/models.py E2BState)."
    )
    snapshot: str | None = Field(
        None, description="The snapshot its sandbox was made from (state/snapshots.py)."
    )
    paused_as: str | None = Field(
        None, description="While it is paused: the snapshot its sandbox is kept as."
    )
    paused_at: float | None = Field(None, description="When it was paused, while it is.")
    paused_s: float = Field(
        0.0, description="How long it was paused before, in all: its clocks do not run then."
    )
    ended_by: dict[str, Any] | None = Field(
        None,
        description="Set when the orchestrator ended the rollout before its grade (idle, "
        "past its lifetime, its environment removed): cause, message, at. A later call or "
        "grade marks it infra_failed with that cause: it is discarded, never scored.",
    )


class InfraFailureEntry(BaseModel):
    """One rollout marked infra_failed, as the operators' list of recent failures keeps it."""

    rollout_id: str
    trace_id: str | None = Field(None, description="Agent RFT's trace id (its rollout id).")
    environment: str | None = None
    host: str | None = None
    cause: str
    message: str
    evidence: str = Field("", description="The evidence, as compact JSON cut to 300 chars.")
    at: float


_JSON_FIELDS = {
    "sandbox",
    "item",
    "grade_details",
    "grade_inputs",
    "infra_failure",
    "ended_by",
    "e2b",
    "workspace",
}


def _encode(rollout: Rollout) -> dict[str, str]:
    data = rollout.model_dump(mode="json")
    return {
        k: json.dumps(v) if k in _JSON_FIELDS else ("" if v is None else str(v))
        for k, v in data.items()
    }


def _decode(raw: dict[str, str]) -> Rollout:
    data: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _JSON_FIELDS:
            data[key] = json.loads(value)
        else:
            data[key] = value if value != "" else None
    return Rollout.model_validate(data)


# KEYS: record, live set, index. ARGV: id, last activity, creation token, creation time,
# field/value pairs. A record with our own token is ours already (the command
# was retried after a dropped connection), not a rival's.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'creation') == ARGV[3] then return 1 end
  return 0
end
redis.call('HSET', KEYS[1], 'creation', ARGV[3], unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
return 1
"""

# KEYS: record, live set, recent infra failures. ARGV: id, mode ('once' or ''), failure
# entry ('' when none), failures bound, field/value pairs. The entry is logged only by the
# update that moves the rollout to infra_failed: a failed rollout fails once.
_UPDATE = """
if redis.call('HEXISTS', KEYS[1], 'state') == 0 then return false end
if ARGV[2] == 'once' then
  local score = redis.call('HGET', KEYS[1], 'score')
  if score and score ~= '' then return redis.call('HGETALL', KEYS[1]) end
end
local state = redis.call('HGET', KEYS[1], 'state')
for i = 5, #ARGV, 2 do
  if not (ARGV[i] == 'state' and state == 'infra_failed' and ARGV[i + 1] ~= 'infra_failed') then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
if ARGV[3] ~= '' and state ~= 'infra_failed'
    and redis.call('HGET', KEYS[1], 'state') == 'infra_failed' then
  redis.call('LPUSH', KEYS[3], ARGV[3])
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1)
end
local closed = redis.call('HGET', KEYS[1], 'closed_at')
if (closed and closed ~= '') or redis.call('HGET', KEYS[1], 'state') == 'closed' then
  redis.call('ZREM', KEYS[2], ARGV[1])
else
  redis.call('ZADD', KEYS[2], redis.call('HGET', KEYS[1], 'last_activity'), ARGV[1])
end
return redis.call('HGETALL', KEYS[1])
"""


def _failure_entry(rollout: Rollout, failure: dict[str, Any]) -> InfraFailureEntry:
    evidence = json.dumps(failure.get("evidence") or {}, separators=(",", ":"), default=str)
    return InfraFailureEntry(
        rollout_id=rollout.rollout_id,
        trace_id=rollout.rollout_id if rollout.source == RolloutSource.AGENT_RFT else None,
        environment=rollout.environment,
        host=rollout.sandbox.host if rollout.sandbox is not None else rollout.host,
        cause=str(failure.get("cause", "")),
        message=str(failure.get("message", "")),
        evidence=evidence if len(evidence) <= 300 else evidence[:299] + "…",
        at=float(failure.get("at") or time.time()),
    )


# A lease one holder at a time keeps. KEYS: the lease. ARGV: holder, ttl (ms; 0: give it
# up). Taken when free, renewed when the holder's; returns 1 when the holder has it after.
_LEASE = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# A slot (KEYS[1], a sorted set of holders scored by when their hold lapses): lapsed holds
# are dropped, then ARGV[1] takes one if fewer than ARGV[2] are held, for ARGV[3] ms. Redis's
# own clock, so API replicas' clocks need not agree. Safe to run twice (a holder holds once).
_TAKE_SLOT = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[3]), ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], tonumber(last[2]))
return 1
"""


class ListingCursor(BaseModel):
    """Where a page of the listing ended: its last rollout's creation time and id."""

    model_config = ConfigDict(frozen=True)

    created_at: float
    rollout_id: str

    def __str__(self) -> str:
        return f"{self.created_at!r}/{self.rollout_id}"

    @classmethod
    def parse(cls, text: str) -> ListingCursor:
        """The cursor :meth:`__str__` printed; ValueError for anything else."""
        created_at, sep, rollout_id = text.partition("/")
        if not sep or not rollout_id:
            raise ValueError(f"{text!r} is not a listing cursor (CREATED_AT/ROLLOUT_ID)")
        return cls(created_at=float(created_at), rollout_id=rollout_id)


class RolloutStore:
    """Async access to rollout state. One instance per process."""

    def __init__(self, redis_url: str, keys: Keys, *, role: str = "api") -> None:
        # Strings in and out: every value we keep is text (JSON or a number). Commands
        # are retried on a dropped connection (after a Redis restart every pooled
        # connection is stale once); the scripts are safe to run twice (see each).
        self.redis: aioredis.Redis = async_redis_client(
            redis_url,
            max_connections=512,
            decode_responses=True,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 4),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            client_name=keys.client_name(role),
            # A hung Redis answers nothing: the command times out, and its retry connects
            # again (behind Sentinel, to whichever primary the Sentinels name by then).
            socket_timeout=REPLY_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
        )
        # The call path's own connections (state/resp.py): its two scripts pipelined on
        # one, the waits for replies on others.
        self._call_path = AsyncConnection(redis_url, keys.client_name(role))
        self.waits = BlockingPool(redis_url, keys.client_name(role))
        self.keys = keys
        self.behind_sentinel = is_sentinel(redis_url)
        self.calls = ApiCalls(self._call_path, keys)
        self._create_script = self.redis.register_script(_CREATE)
        self._update_script = self.redis.register_script(_UPDATE)
        self._slot_script = self.redis.register_script(_TAKE_SLOT)
        self._lease_script = self.redis.register_script(_LEASE)

    @classmethod
    def connect(cls, settings: Settings, role: str = "api") -> RolloutStore:
        """The store of ``settings``' deployment, its connections named for ``role``."""
        return cls(settings.redis_url, Keys.of(settings.deployment), role=role)

    async def close(self) -> None:
        await self._call_path.close()
        await self.waits.close()
        await self.redis.aclose()

    # -- the record ------------------------------------------------------------------------

    async def get(self, rollout_id: str) -> Rollout | None:
        """The record; None when there is none, or only fields of one (no state: a record
        Redis lost, touched since by a late write), which is no record to act on."""
        raw = cast(dict[str, str], await self.redis.hgetall(self.keys.rollout(rollout_id)))
        return _decode(raw) if raw.get("state") else None

    async def epoch(self) -> str | None:
        """Behind Sentinel, the primary's replication id (``master_replid``): a replica
        promoted by a failover starts a new one, so a record made under another epoch may
        miss writes the old primary took and never replicated. None for a single Redis,
        whose restarts keep everything (AOF)."""
        if not self.behind_sentinel:
            return None
        info = await self.redis.info("replication")
        return str(info["master_replid"])

    async def create(self, rollout: Rollout) -> bool:
        """Store a new record in one step (a concurrent reader never sees half of it),
        stamped with the :meth:`epoch` it was made in; False when the id exists already
        (someone else won)."""
        if rollout.state_epoch is None and self.behind_sentinel:
            rollout = rollout.model_copy(update={"state_epoch": await self.epoch()})
        pairs = [x for kv in _encode(rollout).items() for x in kv]
        created = await self._create_script(
            keys=[
                self.keys.rollout(rollout.rollout_id),
                self.keys.live,
                self.keys.index,
            ],
            args=[
                rollout.rollout_id,
                rollout.last_activity,
                uuid.uuid4().hex,
                rollout.created_at,
                *pairs,
            ],
        )
        return bool(created)

    async def update(self, rollout_id: str, *, once: bool = False, **fields: Any) -> Rollout | None:
        """Set a few fields atomically and return the record as it then is.

        ``infra_failed`` is sticky: once set, no update moves the rollout to another state.
        ``once``: set the fields only if the rollout has no score yet (grading), so
        concurrent grade retries all end up with the one score stored first.
        """
        return await self._update(rollout_id, once=once, fields=fields, failure=None)

    async def mark_infra_failed(
        self, rollout_id: str, failure: dict[str, Any], **fields: Any
    ) -> Rollout | None:
        """Mark the rollout infra_failed with ``failure`` (cause, message, evidence, at) and
        ``fields``; in the same step, the first time, add it to :meth:`recent_failures`."""
        return await self._update(
            rollout_id,
            once=False,
            fields={**fields, "state": RolloutState.INFRA_FAILED, "infra_failure": failure},
            failure=failure,
        )

    async def _update(
        self,
        rollout_id: str,
        *,
        once: bool,
        fields: dict[str, Any],
        failure: dict[str, Any] | None,
    ) -> Rollout | None:
        current = await self.get(rollout_id)
        if current is None:
            return None
        encoded = _encode(current.model_copy(update=fields))
        pairs = [x for name in fields for x in (name, encoded[name])]
        entry = _failure_entry(current, failure).model_dump_json() if failure else ""
        raw = await self._update_script(
            keys=[
                self.keys.rollout(rollout_id),
                self.keys.live,
                self.keys.infra_failures,
            ],
            args=[rollout_id, "once" if once else "", entry, RECENT_FAILURES_MAX, *pairs],
        )
        if not raw:
            return None
        flat = [str(x) for x in raw]
        return _decode(dict(zip(flat[::2], flat[1::2], strict=True)))

    async def get_many(self, rollout_ids: list[str]) -> list[Rollout | None]:
        """The records of ``rollout_ids`` in one round trip (None where there is none)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for rollout_id in rollout_ids:
                pipe.hgetall(self.keys.rollout(rollout_id))
            raws = await pipe.execute()
        return [_decode(raw) if raw else None for raw in raws]

    async def call_counts(self, rollout_ids: list[str]) -> list[int]:
        """:meth:`call_count` of each of ``rollout_ids``, in one round trip."""
        if not rollout_ids:
            return []
        values = await self.redis.mget([self.keys.seq(i) for i in rollout_ids])
        return [int(v or 0) for v in values]

    async def created_since(self, since: float) -> list[str]:
        """Ids of the rollouts created at ``since`` or later (the listing index's)."""
        ids = await self.redis.zrangebyscore(self.keys.index, since, "+inf")
        return [str(i) for i in ids]

    async def indexed_before(
        self, cursor: ListingCursor | None, count: int
    ) -> list[tuple[str, float]]:
        """Up to ``count`` (rollout id, creation time) from the listing index, newest
        first, all older than ``cursor`` (None: from the newest). The index orders
        rollouts created at the same time by id, descending, so a page that ends inside
        such a tie goes on after it with none lost or repeated."""
        if cursor is None:
            rows = cast(
                list[tuple[str, float]],
                await self.redis.zrevrange(self.keys.index, 0, count - 1, withscores=True),
            )
            return [(str(i), float(t)) for i, t in rows]
        # The rollouts created at the cursor's time that the page before showed are the
        # ones at or above its id: fetch past as many as there are ties, then drop them.
        ties = int(await self.redis.zcount(self.keys.index, cursor.created_at, cursor.created_at))
        rows = cast(
            list[tuple[str, float]],
            await self.redis.zrevrangebyscore(
                self.keys.index,
                cursor.created_at,
                "-inf",
                start=0,
                num=count + ties,
                withscores=True,
            ),
        )
        older = [
            (str(i), float(t))
            for i, t in rows
            if float(t) < cursor.created_at or str(i) < cursor.rollout_id
        ]
        return older[:count]

    async def reindex(self, batch: int = 1000) -> int:
        """Put every record in the listing index (for a deployment whose index kept only
        its newest 10,000, as before this release did); returns how many records."""
        count = 0
        async for ids in self.every_id(batch):
            async with self.redis.pipeline(transaction=False) as pipe:
                for rollout_id in ids:
                    pipe.hget(self.keys.rollout(rollout_id), "created_at")
                times = await pipe.execute()
            entries = {i: float(t) for i, t in zip(ids, times, strict=True) if t}
            if entries:
                await self.redis.zadd(self.keys.index, entries)
            count += len(entries)
        return count

    async def mark_reaper_pass(self, at: float) -> None:
        """The reaper finished a pass at ``at`` (state/keys.Keys.reaper_pass)."""
        await self.redis.set(self.keys.reaper_pass, repr(at))

    async def hold_reaper_lease(self, holder: str, ttl_s: float) -> bool:
        """Take the deployment's reaper lease for ``holder`` when it is free, or renew it
        when ``holder`` has it; False while another holds it. It lapses ``ttl_s`` after
        its holder's last renewal."""
        held = await self._lease_script(
            keys=[self.keys.reaper_lease], args=[holder, int(ttl_s * 1000)]
        )
        return bool(held)

    async def drop_reaper_lease(self, holder: str) -> None:
        """Give the lease up, if ``holder`` has it: a standby takes it at its next try."""
        await self._lease_script(keys=[self.keys.reaper_lease], args=[holder, 0])

    async def recent_failures(self) -> list[InfraFailureEntry]:
        """The newest infrastructure failures, newest first."""
        raw = await self.redis.lrange(self.keys.infra_failures, 0, -1)
        return [InfraFailureEntry.model_validate_json(r) for r in raw]

    async def forget_live(self, rollout_id: str) -> None:
        """Take a rollout whose record is gone out of the live set."""
        await self.redis.zrem(self.keys.live, rollout_id)

    async def live_ids(self) -> list[str]:
        ids = await self.redis.zrange(self.keys.live, 0, -1)
        return [str(i) for i in ids]

    async def call_count(self, rollout_id: str) -> int:
        value = await self.redis.get(self.keys.seq(rollout_id))
        return int(value or 0)

    async def trajectory(self, rollout_id: str) -> list[TrajectoryStep]:
        raw = await self.redis.lrange(self.keys.trajectory(rollout_id), 0, -1)
        steps = [TrajectoryStep.model_validate_json(r) for r in raw]
        return sorted(steps, key=lambda s: s.seq)

    async def trajectories(self, rollout_ids: list[str]) -> list[list[TrajectoryStep]]:
        """:meth:`trajectory` of each of ``rollout_ids``, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for rollout_id in rollout_ids:
                pipe.lrange(self.keys.trajectory(rollout_id), 0, -1)
            raws = await pipe.execute()
        return [
            sorted((TrajectoryStep.model_validate_json(r) for r in raw), key=lambda s: s.seq)
            for raw in raws
        ]

    async def every_id(self, batch: int = 1000) -> AsyncIterator[list[str]]:
        """Every rollout id with a record, in batches, in no order: the whole history,
        whether or not the listing index holds it (an export or a regrade reads it; a
        SCAN, so a long history takes a round trip per ``batch`` keys of the deployment's
        rollout hashes)."""
        prefix = self.keys.rollout("")
        cursor = 0
        while True:
            cursor, keys = await self.redis.scan(
                cursor, match=f"{prefix}*", count=batch, _type="hash"
            )
            ids = [str(key)[len(prefix) :] for key in keys]
            # The run tickets and E2B process tables are hashes below a record's key.
            found = [rollout_id for rollout_id in ids if ":" not in rollout_id]
            if found:
                yield found
            if cursor == 0:
                return

    async def take_start_lease(self, rollout_id: str, ttl_s: float) -> bool:
        """The lease of the one request that acquires the rollout's sandbox (its parallel
        first calls wait for the record instead); False while another holds it."""
        return bool(
            await self.redis.set(self.keys.starting(rollout_id), "1", nx=True, ex=int(ttl_s))
        )

    async def end_start_lease(self, rollout_id: str) -> None:
        await self.redis.delete(self.keys.starting(rollout_id))

    async def take_grade_lease(self, rollout_id: str, ttl_s: float) -> bool:
        """The lease of the one grade that works in the rollout's sandbox (a grader that
        needs it); False while another holds it. It lapses after ``ttl_s``."""
        return bool(
            await self.redis.set(self.keys.grading(rollout_id), "1", nx=True, ex=int(ttl_s))
        )

    async def end_grade_lease(self, rollout_id: str) -> None:
        await self.redis.delete(self.keys.grading(rollout_id))

    async def recall_verdict(self, digest: str) -> dict[str, Any] | None:
        """The judge's verdict kept under ``digest`` (:meth:`keep_verdict`), or None."""
        raw = await self.redis.get(self.keys.verdict(digest))
        return cast(dict[str, Any], json.loads(raw)) if raw else None

    async def keep_verdict(self, digest: str, verdict: dict[str, Any], ttl_s: float) -> None:
        """Keep a judge's verdict; the first kept stands (a racing second is dropped)."""
        await self.redis.set(
            self.keys.verdict(digest), json.dumps(verdict), nx=True, ex=max(1, int(ttl_s))
        )

    async def take_grader_slot(self, name: str, limit: int, holder: str, hold_s: float) -> bool:
        """One of the deployment's ``limit`` slots ``name`` for ``holder``, lapsing after
        ``hold_s`` (so a holder that died frees it); False while all are held."""
        taken = await self._slot_script(
            keys=[self.keys.grader_slots(name)],
            args=[holder, limit, max(1, int(hold_s * 1000))],
        )
        return bool(taken)

    async def give_grader_slot(self, name: str, holder: str) -> None:
        await self.redis.zrem(self.keys.grader_slots(name), holder)

    async def take_close_lease(self, rollout_id: str, ttl_s: float) -> bool:
        """The lease of the one close that ends the rollout; False while another close of
        it is under way (its grade's and the reaper's, say). It lapses after ``ttl_s``, so
        a closer that died leaves the rollout to the reaper's next pass."""
        return bool(
            await self.redis.set(self.keys.closing(rollout_id), "1", nx=True, ex=int(ttl_s))
        )

    async def end_close_lease(self, rollout_id: str) -> None:
        await self.redis.delete(self.keys.closing(rollout_id))

    async def ping(self) -> bool:
        return bool(await self.redis.ping())


class SandboxOwner(BaseModel):
    """What the orphan sweep reads of the record that may own a sandbox."""

    state: RolloutState | None = Field(None, description="None: there is no record.")
    sandbox_id: str | None = Field(None, description="The sandbox the record names.")
    closed_at: float | None = None


# KEYS: record. ARGV: TTL, then field/value pairs. Only where there is no record: a rollout
# Redis knows again (re-created meanwhile) is not overwritten.
_TOMBSTONE = """
if redis.call('HEXISTS', KEYS[1], 'state') == 1 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
LOST_ENVIRONMENT = "(lost with Redis's state)"
"""A tombstone's environment: what the rollout ran is known only to the record Redis lost."""
TOMBSTONE_TTL_S = 7 * 86400
"""How long the record of a rollout lost with Redis's state is kept: longer than any
trainer keeps retrying a rollout."""


def write_tombstone(
    client: redis.Redis, keys: Keys, handle: SandboxHandle, evidence: dict[str, Any]
) -> bool:
    """The worker's (sync): record ``handle``'s rollout, which Redis no longer knows, as
    ``infra_failed`` with cause ``state_lost``, unless a record exists; True if written.
    Its trainer's next call or grade is then a 503 (discarded), never a fresh start on an
    empty sandbox, nor a grade of an empty trajectory."""
    now = time.time()
    failure = {
        "cause": Cause.STATE_LOST.value,
        "message": "Redis lost this rollout's record; its sandbox was ended by its host",
        "evidence": evidence,
        "at": now,
    }
    record = Rollout(
        rollout_id=handle.rollout_id,
        source=RolloutSource.RECOVERED,
        environment=LOST_ENVIRONMENT,
        image=handle.image,
        state=RolloutState.INFRA_FAILED,
        host=handle.host,
        created_at=handle.created_at.timestamp(),
        last_activity=now,
        closed_at=now,
        outcome=Outcome.INFRA_ERROR,
        infra_failure=failure,
    )
    pairs = [x for kv in _encode(record).items() for x in kv]
    written = client.eval(_TOMBSTONE, 1, keys.rollout(handle.rollout_id), TOMBSTONE_TTL_S, *pairs)
    return bool(written)


def state_mark(client: redis.Redis, keys: Keys) -> str:
    """The deployment's state mark (state/keys.Keys.state_mark), set now if it is missing."""
    # One round trip: the worker's probe asks every heartbeat interval.
    with client.pipeline(transaction=False) as pipe:
        pipe.set(keys.state_mark, uuid.uuid4().hex, nx=True)
        pipe.get(keys.state_mark)
        _, mark = pipe.execute()
    return mark.decode() if isinstance(mark, bytes) else str(mark)


def sandbox_owner(client: redis.Redis, keys: Keys, rollout_id: str) -> SandboxOwner:
    """The worker's read (sync) of the record of ``rollout_id``, for its orphan sweep."""
    state, sandbox, closed_at = (
        v.decode() if isinstance(v, bytes) else v
        for v in client.hmget(keys.rollout(rollout_id), ["state", "sandbox", "closed_at"])
    )
    owned = json.loads(sandbox) if sandbox and sandbox != "null" else None
    return SandboxOwner(
        state=RolloutState(state) if state else None,
        sandbox_id=owned.get("sandbox_id") if isinstance(owned, dict) else None,
        closed_at=float(closed_at) if closed_at else None,
    )
