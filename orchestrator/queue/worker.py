"""Per-worker-process state: the sandbox backend, the environments, the calls running now,
and the heartbeat that tells the API this host is alive, healthy and schedulable."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from orchestrator.config import get_settings
from orchestrator.environments.loader import (
    EnvironmentRegistry,
    ResolvedEnvironment,
    load_environments,
)
from orchestrator.observability import metrics
from orchestrator.observability.logging import get_logger
from orchestrator.outcomes import Cause
from orchestrator.queue.lane import GroupedLane
from orchestrator.sandbox.factory import HostBackend, make_backend
from orchestrator.sandbox.repos import HostRepos
from orchestrator.state import admission, replies
from orchestrator.state.connection import SyncRedis, call_path_connection, worker_client
from orchestrator.state.heartbeat import Heartbeat, HeartbeatWriter, HostFinding
from orchestrator.state.keys import Keys
from orchestrator.state.pools import PoolFiller
from orchestrator.state.records import pinned_environment
from orchestrator.state.tickets import WorkerTickets
from orchestrator.state.wire import Request, ToolCall, ToolCallDone

log = get_logger(__name__)


@lru_cache(maxsize=1)
def backend() -> HostBackend:
    return make_backend(get_settings())


@lru_cache(maxsize=1)
def host_repos() -> HostRepos:
    """This host's repositories (sandbox/repos.py), as the Docker backend keeps them."""
    return HostRepos.of(get_settings())


@lru_cache(maxsize=1)
def environments() -> EnvironmentRegistry:
    return load_environments(get_settings())


@lru_cache(maxsize=1)
def redis_client() -> SyncRedis:
    return worker_client(get_settings().redis_url, keys().client_name("worker"))


@lru_cache(maxsize=1)
def keys() -> Keys:
    return Keys.of(get_settings().deployment)


def environment_of(call: ToolCall) -> ResolvedEnvironment:
    """The environment the call's rollout was pinned to when it started: this worker's
    own configuration when it is the same, else the snapshot kept in the rollout's record
    (read once per digest)."""

    def snapshot() -> str:
        return pinned_environment(redis_client(), keys(), call.rollout_id)

    return environments().pinned(
        call.environment_digest, snapshot, image=call.handle.image, codebase=None
    )


def reply(request: Request, result: BaseModel) -> None:
    """Push a task's reply to the list its caller waits on, if one does (see
    state/replies.py)."""
    replies.push_reply(redis_client(), request, result)


# This worker process, as named in the heartbeat and on the tickets it claims: a worker
# restarted under the same host name is another instance, so the calls the old one held
# are known to be lost although the host's heartbeat never stopped.
INSTANCE = uuid.uuid4().hex


@lru_cache(maxsize=1)
def tickets() -> WorkerTickets:
    connection = call_path_connection(get_settings().redis_url, keys().client_name("worker"))
    return WorkerTickets(connection)


@lru_cache(maxsize=1)
def creations() -> GroupedLane:
    """The host's creation lane for rollouts' own sandboxes (queue/lane.py): at most
    ``create_concurrency`` made at once, apart from the Celery threads that run tool calls,
    a group's rollouts seated together. On two cores, 64 creations at once made no more
    sandboxes per second than a few, and starved every tool call. Submit through
    :func:`create_for_rollout`."""
    return GroupedLane(get_settings().create_concurrency, "create")


@lru_cache(maxsize=1)
def pool_creations() -> ThreadPoolExecutor:
    """The pool lane: refills, each of which waits its turn at :func:`creation_gate`;
    ``pool_fill_concurrency`` at once (a burst's second half, served from the pool while
    it refills, measured its later calls' p99 at 1.8 s with 4 refills at once, against
    1.1 s with no pool at all: bench/burst.py --bursts 2)."""
    return ThreadPoolExecutor(
        max_workers=get_settings().pool_fill_concurrency, thread_name_prefix="pool-fill"
    )


class CreationGate:
    """Rollouts first: a pool refill starts a creation only while no rollout's own
    creation is queued or running on this host, so a burst's new rollouts never wait
    behind sandboxes made for later ones (issue 13: refills never compete with rollouts
    waiting for a sandbox)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rollouts = 0
        self._closed = False

    def rollout_queued(self) -> None:
        with self._cond:
            self._rollouts += 1

    def rollout_done(self) -> None:
        with self._cond:
            self._rollouts -= 1
            if self._rollouts <= 0:
                self._cond.notify_all()

    def pool_turn(self) -> bool:
        """Wait until no rollout's creation waits; False once the worker is stopping."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._rollouts <= 0)
            return not self._closed

    def close(self) -> None:
        """Stopping: every refill waiting for its turn gives up."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@lru_cache(maxsize=1)
def creation_gate() -> CreationGate:
    return CreationGate()


def create_for_rollout(
    fn: Callable[..., None], *args: Any, group: str | None = None, lane: GroupedLane | None = None
) -> None:
    """Run ``fn(*args)`` (a rollout's sandbox creation, or a reset) in :func:`creations`
    (or ``lane``), seated with ``group``'s other rollouts, and counted as waiting at
    :func:`creation_gate` from now until it is done (or dropped unrun by a shutdown)."""
    gate = creation_gate()
    gate.rollout_queued()

    def run() -> None:
        try:
            fn(*args)
        finally:
            gate.rollout_done()

    (lane or creations()).submit(run, group, dropped=gate.rollout_done)


@lru_cache(maxsize=1)
def recycles() -> GroupedLane:
    """The lane of recycled sandboxes' resets: apart from :func:`creations`, since a reset
    waits for the host's calls to pause (:func:`yield_to_calls`) and must not hold up a
    rollout's creation meanwhile; as many at once as creations."""
    return GroupedLane(get_settings().create_concurrency, "recycle")


@lru_cache(maxsize=1)
def pool_filler() -> PoolFiller:
    return PoolFiller(get_settings(), redis_client())


def release_slot(host_id: str, transit: str = "") -> None:
    """Give back a slot of ``host_id`` (its sandbox is gone or was never made), and its
    member of the slots in transit if it had one."""
    admission.release_slot(redis_client(), keys(), host_id, transit)


class _InFlight:
    """The calls this process is running, so a shutdown that cannot wait for them can
    still settle their tickets (as infrastructure errors) before it exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, ToolCall] = {}
        self._last_end = 0.0
        self.draining = False

    @contextmanager
    def running(self, call: ToolCall) -> Iterator[None]:
        with self._lock:
            self._calls[call.ticket] = call
        try:
            yield
        finally:
            with self._lock:
                self._calls.pop(call.ticket, None)
                self._last_end = time.monotonic()

    def busy(self, quiet_s: float) -> bool:
        """A call runs, or one ended less than ``quiet_s`` ago (its rollout thinks, and
        calls again)."""
        with self._lock:
            return bool(self._calls) or time.monotonic() - self._last_end < quiet_s

    def snapshot(self) -> list[ToolCall]:
        with self._lock:
            return list(self._calls.values())


in_flight = _InFlight()

CALLS_QUIET_S = 0.3
"""No tool call here for this long: the host's live calls have paused (a step boundary)."""
YIELD_POLL_S = 0.05


def yield_to_calls(work: str, pool: str | None = None) -> float:
    """Background work (``work``: a pool refill's creation, a recycled sandbox's reset)
    waits while this host runs tool calls, so they keep the CPU: until none ran for
    :data:`CALLS_QUIET_S`, or a new rollout waits for ``pool``'s recycled sandbox, or
    ``background_yield_s`` passed. Returns how long it waited."""
    limit = get_settings().background_yield_s
    started = time.monotonic()
    waited = 0.0
    while waited < limit and in_flight.busy(CALLS_QUIET_S) and not in_flight.draining:
        if pool is not None and pool_filler().awaited(pool):
            break
        time.sleep(YIELD_POLL_S)
        waited = time.monotonic() - started
    metrics.BACKGROUND_YIELD_SECONDS.labels(work).observe(waited)
    return waited


def host_status(previous: HostFinding) -> HostFinding:
    """One probe of this host: daemon, free disk, sandbox count against capacity.

    ``schedulable`` is False (the host is cordoned: no new sandboxes) while any check
    fails; ``backend_failures`` counts consecutive failed daemon probes, and the reaper
    fails the rollouts of a host whose daemon failed ``host_unhealthy_after`` in a row
    (only where an outage of the backend loses the sandboxes: not a Kubernetes API server's)."""
    settings = get_settings()
    health = backend().host_health()
    lost = not health.backend_ok and health.outage_loses_sandboxes
    failures = previous.backend_failures + 1 if lost else 0
    reasons: list[str] = []
    if not health.backend_ok:
        reasons.append(f"daemon: {health.error}")
    min_free = settings.host_min_free_disk_mb * 1024 * 1024
    if health.backend_ok and health.disk_free_bytes < min_free:
        reasons.append(
            f"disk: {health.disk_free_bytes // 2**20} MiB free, "
            f"below {settings.host_min_free_disk_mb} MiB"
        )
    memory = available_memory_bytes()
    min_memory = settings.host_min_free_memory_mb * 1024 * 1024
    if memory is not None and memory < min_memory:
        reasons.append(
            f"memory: {memory // 2**20} MiB available, below {settings.host_min_free_memory_mb} MiB"
        )
    if health.sandboxes >= settings.host_max_sandboxes:
        reasons.append(f"full: {health.sandboxes} of {settings.host_max_sandboxes} sandboxes")
    return HostFinding(
        **health.model_dump(),
        mem_available_bytes=memory,
        backend_failures=failures,
        capacity=settings.host_max_sandboxes,
        cordon_reasons=reasons,
    )


def available_memory_bytes() -> int | None:
    """MemAvailable of this host (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:  # noqa: PTH123 - one small read
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# The host probe's latest finding, replaced whole (never mutated), so every reader sees
# one finding: the heartbeat publishes it, the pool filler checks it before creating.
_latest: list[HostFinding] = [HostFinding(error="not probed yet", cordon_reasons=["starting"])]


def host_schedulable() -> bool:
    """This host may take new sandboxes (its own finding; the API reads the heartbeat)."""
    return not _latest[0].cordon_reasons and not in_flight.draining


@lru_cache(maxsize=1)
def heartbeats() -> HeartbeatWriter:
    # A client of its own: its beats are not the calls' traffic.
    client = worker_client(get_settings().redis_url, keys().client_name("heartbeat"))
    return HeartbeatWriter(client, keys(), get_settings().host_id, INSTANCE)


def start_heartbeat() -> threading.Thread:
    """Publish this host's status every ``heartbeat_interval_s`` with a TTL of three beats,
    so a dead worker's key vanishes on its own.

    Liveness and the host's health are measured apart: a daemon slowed by a burst of
    creations must not make a live worker look dead, so the beat never waits on Docker; a
    second thread probes the host and the beat publishes its latest finding."""
    settings = get_settings()
    latest = _latest
    # Set by a probe whose finding changes whether the host takes sandboxes: the beat then
    # publishes at once, not an interval later. A worker just started is cordoned
    # ("starting") until its first probe, and was not schedulable for a whole interval
    # after it (5 s by default; a restart in the suite's integrity tests waited 10 s).
    changed = threading.Event()

    def probe() -> None:
        while True:
            before = latest[0].cordon_reasons
            try:
                latest[0] = host_status(latest[0])
            except Exception as exc:  # noqa: BLE001 - the probe must outlive any failure
                latest[0] = HostFinding(
                    backend_failures=latest[0].backend_failures + 1,
                    error=f"probe failed: {exc!r}",
                    cordon_reasons=[f"probe failed: {exc!r}"],
                )
            if bool(before) != bool(latest[0].cordon_reasons):
                changed.set()
            time.sleep(settings.heartbeat_interval_s)

    def beat() -> None:
        while True:
            publish_heartbeat(latest[0])
            changed.wait(settings.heartbeat_interval_s)
            changed.clear()

    threading.Thread(target=probe, name="host-probe", daemon=True).start()
    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread


def publish_heartbeat(finding: HostFinding) -> None:
    settings = get_settings()
    reasons = list(finding.cordon_reasons)
    if in_flight.draining:
        reasons.append("draining: the worker is stopping")
    beat = Heartbeat(
        **finding.model_dump(exclude={"cordon_reasons"}),
        host=settings.host_id,
        instance=INSTANCE,
        time=time.time(),
        running_calls=len(in_flight.snapshot()),
        draining=in_flight.draining,
        cordon_reasons=reasons,
        schedulable=not reasons,
    )
    try:
        heartbeats().publish(beat, ttl_s=max(1, int(settings.heartbeat_interval_s * 3)))
    except Exception as exc:  # noqa: BLE001 - a dead beat makes a live worker look dead
        log.warning("worker.heartbeat_failed", host=settings.host_id, error=repr(exc))


def retire_heartbeat() -> None:
    """Say at once that this worker is gone (instead of letting the key expire), so the
    API stops waiting on it and cancels calls still queued for it."""
    try:
        heartbeats().retire()
    except Exception as exc:  # noqa: BLE001 - shutting down anyway
        log.warning("worker.retire_failed", error=repr(exc))


def abort_in_flight(reason: str) -> int:
    """Settle every call still running here as an infrastructure error (the shutdown grace
    ran out): the waiting API marks their rollouts infra_failed instead of hanging."""
    aborted = 0
    for call in in_flight.snapshot():
        done = ToolCallDone(
            infra_error=f"worker stopped: {reason}",
            cause=Cause.WORKER_STOPPED,
            evidence={"host": call.handle.host},
        )
        state, _ = tickets().finish(call.ticket, INSTANCE, done.model_dump_json(), time.time())
        aborted += 1
        log.error(
            "tool.aborted",
            rollout_id=call.rollout_id,
            sandbox_id=call.handle.sandbox_id,
            call_id=call.call_id,
            ticket_state=state,
        )
    return aborted
