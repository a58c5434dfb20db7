"""Heartbeats: how a worker host tells the API it is alive, healthy and schedulable.

A worker publishes a :class:`Heartbeat` every ``heartbeat_interval_s`` with a TTL of three
beats (queue/worker.py), so a dead worker's key vanishes on its own; a stopping one
retires its own at once. The API reads them to pick a host for a new sandbox
(state/admission.py), to stop waiting on a call whose worker is gone (rollouts/dispatch.py)
and to fail the rollouts of a host that is lost or unhealthy (rollouts/reaper.py).

``backend_ok``, ``backend_ping_ms`` and ``backend_failures`` are the host's sandbox backend,
whichever it is (a Docker daemon or a Kubernetes API server). They were ``docker_*`` until
2026-12: a heartbeat is still read under the old names (a worker not upgraded yet) and is
still written with them too (an API not upgraded yet), for one release.
"""

from __future__ import annotations

import threading

import redis
import redis.asyncio as aioredis
from pydantic import AliasChoices, Field, computed_field

from orchestrator.config import Settings
from orchestrator.sandbox.backend import HostHealth
from orchestrator.state.connection import redis_client
from orchestrator.state.keys import Keys


class HostFinding(HostHealth):
    """One probe of a worker host: its backend's health, plus what the worker adds."""

    backend_ok: bool = Field(False, validation_alias=AliasChoices("backend_ok", "docker_ok"))
    backend_ping_ms: float | None = Field(
        None, validation_alias=AliasChoices("backend_ping_ms", "docker_ping_ms")
    )
    disk_free_bytes: int = 0
    sandboxes: int = 0
    mem_available_bytes: int | None = None
    backend_failures: int = Field(
        0,
        validation_alias=AliasChoices("backend_failures", "docker_failures"),
        description="Consecutive failed backend probes where an outage loses sandboxes.",
    )
    capacity: int | None = Field(None, description="Sandboxes this host may hold.")
    cordon_reasons: list[str] = Field(
        default_factory=list, description="Why it takes no new sandbox now; empty: it does."
    )


class Heartbeat(HostFinding):
    """A host's heartbeat as published: its latest finding, and who is beating."""

    host: str
    instance: str = Field(
        description="The worker process beating: a worker restarted under the same host name "
        "is another instance, so the calls the old one held are known to be lost."
    )
    time: float = Field(description="time.time() when it was sent.")
    running_calls: int = 0
    wire: int = Field(
        0,
        description="The queue's wire the worker speaks (state/wire.WIRE_VERSION; 0: a "
        "worker of a release before it had one). A call is sent only to a worker of its own.",
    )
    draining: bool = False
    schedulable: bool = False

    # The old names, written for readers not upgraded yet (see the module's docstring).
    @computed_field  # type: ignore[prop-decorator]
    @property
    def docker_ok(self) -> bool:
        return self.backend_ok

    @computed_field  # type: ignore[prop-decorator]
    @property
    def docker_failures(self) -> int:
        return self.backend_failures

    @computed_field  # type: ignore[prop-decorator]
    @property
    def docker_ping_ms(self) -> float | None:
        return self.backend_ping_ms


class Heartbeats:
    """The API's reading of heartbeats (async)."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._redis = client
        self._keys = keys

    async def alive(self, host_id: str) -> bool:
        return bool(await self._redis.exists(self._keys.heartbeat(host_id)))

    async def get(self, host_id: str) -> Heartbeat | None:
        """The host's latest heartbeat, None when it has none (it stopped, or is lost)."""
        raw = await self._redis.get(self._keys.heartbeat(host_id))
        return Heartbeat.model_validate_json(raw) if raw else None

    async def known_hosts(self) -> list[str]:
        """Every host that ever beat in this deployment, sorted."""
        return sorted(str(h) for h in await self._redis.smembers(self._keys.hosts))

    async def live(self) -> list[Heartbeat]:
        """The heartbeats of the hosts beating now, in host order (two round trips)."""
        hosts = await self.known_hosts()
        if not hosts:
            return []
        raws = await self._redis.mget([self._keys.heartbeat(h) for h in hosts])
        return [Heartbeat.model_validate_json(raw) for raw in raws if raw]

    async def silent_since(self, host_id: str, now: float) -> float:
        """When the reaper first found ``host_id`` silent (``now`` if it is the first time);
        kept in Redis, so the clock survives a restart of beat."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hsetnx(self._keys.silent_since, host_id, now)
            pipe.hget(self._keys.silent_since, host_id)
            _, since = await pipe.execute()
        return float(since or now)

    async def heard_from(self, host_id: str) -> None:
        """``host_id`` beats again: its silence, if any, is forgotten."""
        await self._redis.hdel(self._keys.silent_since, host_id)


def is_beating(settings: Settings, timeout_s: float = 3.0) -> bool:
    """Whether this host's worker is beating now (a pod's exec probe: one EXISTS, bounded);
    :class:`~orchestrator.state.errors.StateError` when Redis cannot be reached."""
    client = redis_client(
        settings.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    try:
        return bool(client.exists(Keys.of(settings.deployment).heartbeat(settings.host_id)))
    finally:
        client.close()


# Only delete the heartbeat if it is still ours: a new instance may have started already.
_RETIRE = """
local raw = redis.call('GET', KEYS[1])
if raw and string.find(raw, ARGV[1], 1, true) then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""


# KEYS: heartbeat, hosts, state mark. ARGV: beat JSON, TTL, host, the state mark the host's
# last sweep began under ('' before its first). A host is not heard from while Redis holds
# another mark (or none: Redis lost its state): the beat it computed before it could know
# must not make it look schedulable to rollouts Redis forgot.
_PUBLISH = """
if ARGV[4] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[4] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
return 1
"""


class HeartbeatWriter:
    """The worker's side (sync, from its heartbeat thread): publish, then retire."""

    def __init__(self, client: redis.Redis, keys: Keys, host_id: str, instance: str) -> None:
        self._redis = client
        self._keys = keys
        self._host = host_id
        self._instance = instance
        self._retire = client.register_script(_RETIRE)
        self._publish = client.register_script(_PUBLISH)
        # Under the lock, so a beat computed before the retirement cannot land after it.
        self._lock = threading.Lock()
        self._retired = threading.Event()

    def publish(self, beat: Heartbeat, ttl_s: int, swept_mark: str | None = None) -> bool:
        """Publish ``beat``; False when it was not: retired, or Redis no longer holds
        ``swept_mark``, the state mark the host's last sweep began under (it lost its
        state since: the host must sweep again first)."""
        with self._lock:
            if self._retired.is_set():
                return False  # no beat after the retirement: the key stays gone
            keys = [self._keys.heartbeat(self._host), self._keys.hosts, self._keys.state_mark]
            args: list[str | int] = [beat.model_dump_json(), ttl_s, self._host, swept_mark or ""]
            return bool(self._publish(keys=keys, args=args))

    def retire(self) -> None:
        """Say at once that this worker is gone (instead of letting the key expire), so the
        API stops waiting on it and cancels calls still queued for it."""
        with self._lock:
            self._retired.set()
            self._retire(keys=[self._keys.heartbeat(self._host)], args=[self._instance])
