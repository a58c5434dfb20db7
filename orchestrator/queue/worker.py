"""This worker process as one object (:class:`Host`): the sandbox backend, the
environments, the connections, the lanes sandboxes are made and reset in, the calls running
now, and the heartbeat that tells the API this host is alive, healthy and schedulable.
Built once per process (:func:`current`, from the process's settings; a test may build its
own), and reached by the handlers (queue/handlers.py)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Generic, TypeVar, overload

from pydantic import BaseModel

from orchestrator.config import Settings, get_settings
from orchestrator.environments.loader import EnvironmentRegistry, load_environments
from orchestrator.observability import metrics
from orchestrator.observability.logging import get_logger
from orchestrator.outcomes import Cause
from orchestrator.queue.lane import GroupedLane
from orchestrator.queue.sweep import sweep_orphans
from orchestrator.sandbox.factory import HostBackend, make_backend
from orchestrator.sandbox.gc import collect_expired
from orchestrator.sandbox.repos import HostRepos
from orchestrator.state import admission, replies
from orchestrator.state.calls import WorkerCalls
from orchestrator.state.connection import SyncRedis, call_path_connection, worker_client
from orchestrator.state.errors import StateError
from orchestrator.state.heartbeat import Heartbeat, HeartbeatWriter, HostFinding
from orchestrator.state.keys import Keys
from orchestrator.state.pool_sizing import targets
from orchestrator.state.pools import PoolFiller
from orchestrator.state.records import state_mark
from orchestrator.state.snapshots import kept_snapshots
from orchestrator.state.wire import WIRE_VERSION, InfraFault, OpDone, Request, RunOp

log = get_logger(__name__)

CALLS_QUIET_S = 0.3
"""No tool call here for this long: the host's live calls have paused (a step boundary)."""
YIELD_POLL_S = 0.05

T = TypeVar("T")


class _Once(Generic[T]):
    """A member of :class:`Host` made on first use, once, whichever thread asks first (the
    Celery threads and the lanes ask at once when a worker starts under load): the backend,
    the connections, the lanes. Made lazily so that a host built in a test, or one whose
    daemon is not up yet, starts without them."""

    def __init__(self, make: Callable[[Host], T]) -> None:
        self.make = make
        self.name = make.__name__
        self.__doc__ = make.__doc__

    @overload
    def __get__(self, host: None, owner: type[Host]) -> _Once[T]: ...
    @overload
    def __get__(self, host: Host, owner: type[Host]) -> T: ...
    def __get__(self, host: Host | None, owner: type[Host]) -> _Once[T] | T:
        if host is None:
            return self
        made = host.__dict__.get(self.name)
        if made is None:
            with host._making:
                made = host.__dict__.get(self.name)
                if made is None:
                    made = self.make(host)
                    host.__dict__[self.name] = made
        return made


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


class InFlight:
    """The calls this process is running, so a shutdown that cannot wait for them can
    still settle their tickets (as infrastructure errors) before it exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, RunOp] = {}
        self._last_end = 0.0
        self.draining = False

    @contextmanager
    def running(self, call: RunOp) -> Iterator[None]:
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

    def snapshot(self) -> list[RunOp]:
        with self._lock:
            return list(self._calls.values())


class Host:
    """This worker process and the host it serves."""

    def __init__(
        self,
        settings: Settings,
        *,
        instance: str | None = None,
        backend: HostBackend | None = None,
        pool_filler: PoolFiller | None = None,
    ) -> None:
        """``backend``, ``pool_filler``: given instead of made on first use (a test's)."""
        self.settings = settings
        self.keys = Keys.of(settings.deployment)
        # As named in the heartbeat and on the tickets it claims: a worker restarted under
        # the same host name is another instance, so the calls the old one held are known
        # to be lost although the host's heartbeat never stopped.
        self.instance = instance or uuid.uuid4().hex
        self.in_flight = InFlight()
        self.gate = CreationGate()
        # The host probe's latest finding, replaced whole (never mutated), so every reader
        # sees one finding: the heartbeat publishes it, the pool filler checks it.
        self.latest = HostFinding(error="not probed yet", cordon_reasons=["starting"])
        # The deployment's state mark (state/keys.Keys.state_mark) this host's last sweep
        # began under; None before its first. Until it is the current one, the host takes
        # no new sandboxes: a rollout Redis forgot must be failed (the sweep's tombstones)
        # before its trainer's next call could start it afresh.
        self.swept_mark: str | None = None
        # Set to have the host probed again at once (a sweep that lifts a cordon).
        self.reprobe = threading.Event()
        self._making = threading.RLock()
        if backend is not None:
            self.__dict__["backend"] = backend
        if pool_filler is not None:
            self.__dict__["pool_filler"] = pool_filler

    # -- what it holds, made on first use ------------------------------------------------

    @_Once
    def backend(self) -> HostBackend:
        return make_backend(self.settings)

    @_Once
    def repos(self) -> HostRepos:
        """This host's repositories (sandbox/repos.py), as the Docker backend keeps them."""
        return HostRepos.of(self.settings)

    @_Once
    def environments(self) -> EnvironmentRegistry:
        return load_environments(self.settings)

    @_Once
    def redis(self) -> SyncRedis:
        return worker_client(self.settings.redis_url, self.keys.client_name("worker"))

    @_Once
    def calls(self) -> WorkerCalls:
        """The calls' run tickets, claimed and finished on the call path's own lean
        connection (state/resp.py)."""
        name = self.keys.client_name("worker")
        return WorkerCalls(
            call_path_connection(self.settings.redis_url, name),
            replicas=self.settings.redis_replicas_to_wait,
        )

    @_Once
    def creations(self) -> GroupedLane:
        """The host's creation lane for rollouts' own sandboxes (queue/lane.py): at most
        ``create_concurrency`` made at once, apart from the Celery threads that run tool
        calls, a group's rollouts seated together. On two cores, 64 creations at once made
        no more sandboxes per second than a few, and starved every tool call. Submit
        through :meth:`create_for_rollout`."""
        return GroupedLane(self.settings.create_concurrency, "create")

    @_Once
    def recycles(self) -> GroupedLane:
        """The lane of recycled sandboxes' resets: apart from :attr:`creations`, since a
        reset waits for the host's calls to pause (:meth:`yield_to_calls`) and must not
        hold up a rollout's creation meanwhile; as many at once as creations."""
        return GroupedLane(self.settings.create_concurrency, "recycle")

    @_Once
    def pool_creations(self) -> ThreadPoolExecutor:
        """The pool lane: refills, each of which waits its turn at :attr:`gate`;
        ``pool_fill_concurrency`` at once (a burst's second half, served from the pool
        while it refills, measured its later calls' p99 at 1.8 s with 4 refills at once,
        against 1.1 s with no pool at all: bench/burst.py --bursts 2)."""
        return ThreadPoolExecutor(
            max_workers=self.settings.pool_fill_concurrency, thread_name_prefix="pool-fill"
        )

    @_Once
    def pool_filler(self) -> PoolFiller:
        return PoolFiller(self.settings, self.redis)

    @_Once
    def heartbeats(self) -> HeartbeatWriter:
        # A client of its own: its beats are not the calls' traffic.
        client = worker_client(self.settings.redis_url, self.keys.client_name("heartbeat"))
        return HeartbeatWriter(client, self.keys, self.settings.host_id, self.instance)

    # -- calls and replies ---------------------------------------------------------------

    def reply(self, request: Request, result: BaseModel) -> None:
        """Push a task's reply to the list its caller waits on, if one does (see
        state/replies.py)."""
        replies.push_reply(self.redis, request, result)

    def abort_in_flight(self, reason: str) -> int:
        """Settle every call still running here as an infrastructure error (the shutdown
        grace ran out): the waiting API marks their rollouts infra_failed instead of
        hanging."""
        aborted = 0
        for call in self.in_flight.snapshot():
            done = OpDone(
                outcome=InfraFault(
                    error=f"worker stopped: {reason}",
                    cause=Cause.WORKER_STOPPED,
                    evidence={"host": call.handle.host},
                )
            )
            state, _ = self.calls.finish(
                call.ticket, self.instance, done.model_dump_json(), time.time()
            )
            aborted += 1
            log.error(
                "tool.aborted",
                rollout_id=call.rollout_id,
                sandbox_id=call.handle.sandbox_id,
                call_id=call.call_id,
                ticket_state=state,
            )
        return aborted

    # -- sandboxes made, reset, given back -----------------------------------------------

    def create_for_rollout(
        self,
        fn: Callable[..., None],
        *args: Any,
        group: str | None = None,
        lane: GroupedLane | None = None,
    ) -> None:
        """Run ``fn(*args)`` (a rollout's sandbox creation, or a reset) in
        :attr:`creations` (or ``lane``), seated with ``group``'s other rollouts, and counted
        as waiting at :attr:`gate` from now until it is done (or dropped unrun by a
        shutdown)."""
        gate = self.gate
        gate.rollout_queued()

        def run() -> None:
            try:
                fn(*args)
            finally:
                gate.rollout_done()

        (lane or self.creations).submit(run, group, dropped=gate.rollout_done)

    def release_slot(self, host_id: str, transit: str = "") -> None:
        """Give back a slot of ``host_id`` (its sandbox is gone or was never made), and its
        member of the slots in transit if it had one."""
        admission.release_slot(self.redis, self.keys, host_id, transit)

    def yield_to_calls(self, work: str, pool: str | None = None) -> float:
        """Background work (``work``: a pool refill's creation, a recycled sandbox's reset)
        waits while this host runs tool calls, so they keep the CPU: until none ran for
        :data:`CALLS_QUIET_S`, or a new rollout waits for ``pool``'s recycled sandbox, or
        ``background_yield_s`` passed. Returns how long it waited."""
        limit = self.settings.background_yield_s
        started = time.monotonic()
        waited = 0.0
        in_flight = self.in_flight
        while waited < limit and in_flight.busy(CALLS_QUIET_S) and not in_flight.draining:
            if pool is not None and self.pool_filler.awaited(pool):
                break
            time.sleep(YIELD_POLL_S)
            waited = time.monotonic() - started
        metrics.BACKGROUND_YIELD_SECONDS.labels(work).observe(waited)
        return waited

    def sweep(self) -> dict[str, Any]:
        """Destroy this host's expired sandboxes and leftovers by label, every sandbox whose
        rollout is over or unknown to Redis (orphans), and snapshots no longer kept; drop
        pool entries whose sandbox is gone. What was done, counted."""
        settings = self.settings
        backend = self.backend
        mark = state_mark(self.redis, self.keys)
        swept: dict[str, Any] = collect_expired(backend).model_dump(mode="json")
        swept["orphans"] = sweep_orphans(backend, self.redis, settings)
        swept["snapshots"] = backend.sweep_snapshots(kept_snapshots(self.redis, self.keys))
        live = {h.sandbox_id for h in backend.list_owned()}
        filler = self.pool_filler
        swept["pool_entries_dropped"] = sum(
            filler.forget_missing(pool, settings.host_id, live)
            for pool in targets(self.environments, settings, filler.demand())
        )
        first = self.swept_mark is None
        self.swept_mark = mark
        if first:  # the host's first sweep lifts its cordon: said now, not a beat later
            self.reprobe.set()
        return swept

    def with_state_check(self, finding: HostFinding) -> HostFinding:
        """``finding``, cordoned while this host has not swept since it started
        (:data:`SWEEPING`) or since Redis lost the deployment's state (:data:`RECOVERING`:
        its mark is missing, or another one than the last sweep began under). Redis that
        cannot be read tells nothing: the host's health is its backend's, and the
        heartbeat's own failure says the rest."""
        if self.swept_mark is None:
            return finding.model_copy(
                update={"cordon_reasons": [*finding.cordon_reasons, SWEEPING]}
            )
        try:
            lost = state_mark(self.redis, self.keys) != self.swept_mark
        except StateError:
            return finding
        if not lost:
            return finding
        return finding.model_copy(update={"cordon_reasons": [*finding.cordon_reasons, RECOVERING]})

    def drain(self) -> None:
        """Stopping: take no new sandboxes (the heartbeat says draining), drop creations
        not started yet (their callers hear of it through the retired heartbeat instead of
        waiting for a burst's worth of sandboxes to be made first), and resets and
        refills; running calls go on."""
        self.in_flight.draining = True
        log.info("worker.draining", running=len(self.in_flight.snapshot()))
        self.creations.close()
        self.recycles.close()  # (their sandboxes, unreset, go with the host's sweep)
        self.gate.close()
        self.pool_creations.shutdown(wait=False, cancel_futures=True)

    # -- health and heartbeat ------------------------------------------------------------

    def status(self, previous: HostFinding) -> HostFinding:
        """One probe of this host: daemon, free disk, sandbox count against capacity.

        ``schedulable`` is False (the host is cordoned: no new sandboxes) while any check
        fails; ``backend_failures`` counts consecutive failed daemon probes, and the reaper
        fails the rollouts of a host whose daemon failed ``host_unhealthy_after`` in a row
        (only where an outage of the backend loses the sandboxes: not a Kubernetes API
        server's)."""
        settings = self.settings
        health = self.backend.host_health()
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
                f"memory: {memory // 2**20} MiB available, "
                f"below {settings.host_min_free_memory_mb} MiB"
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

    def schedulable(self) -> bool:
        """This host may take new sandboxes (its own finding; the API reads the heartbeat)."""
        return not self.latest.cordon_reasons and not self.in_flight.draining

    def start_heartbeat(self) -> threading.Thread:
        """Publish this host's status every ``heartbeat_interval_s`` with a TTL of three
        beats, so a dead worker's key vanishes on its own.

        Liveness and the host's health are measured apart: a daemon slowed by a burst of
        creations must not make a live worker look dead, so the beat never waits on Docker;
        a second thread probes the host and the beat publishes its latest finding."""
        interval = self.settings.heartbeat_interval_s
        # Set by a probe whose finding changes whether the host takes sandboxes: the beat
        # then publishes at once, not an interval later. A worker just started is cordoned
        # ("starting") until its first probe, and was not schedulable for a whole interval
        # after it (5 s by default; a restart in the suite's integrity tests waited 10 s).
        changed = threading.Event()

        def probe() -> None:
            while True:
                before = self.latest.cordon_reasons
                try:
                    self.latest = self.with_state_check(self.status(self.latest))
                    if RECOVERING in self.latest.cordon_reasons:
                        # Redis lost its state while this worker ran: cordoned (published
                        # at once), this host's sandboxes Redis forgot are failed and go.
                        changed.set()
                        log.warning("worker.state_lost", **self.sweep())
                        self.latest = self.with_state_check(self.status(self.latest))
                except Exception as exc:  # noqa: BLE001 - the probe must outlive any failure
                    self.latest = HostFinding(
                        backend_failures=self.latest.backend_failures + 1,
                        error=f"probe failed: {exc!r}",
                        cordon_reasons=[f"probe failed: {exc!r}"],
                    )
                if bool(before) != bool(self.latest.cordon_reasons):
                    changed.set()
                self.reprobe.wait(interval)
                self.reprobe.clear()

        def beat() -> None:
            while True:
                self.publish_heartbeat(self.latest)
                changed.wait(interval)
                changed.clear()

        threading.Thread(target=probe, name="host-probe", daemon=True).start()
        thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        thread.start()
        return thread

    def publish_heartbeat(self, finding: HostFinding) -> None:
        settings = self.settings
        reasons = list(finding.cordon_reasons)
        if self.in_flight.draining:
            reasons.append("draining: the worker is stopping")
        beat = Heartbeat(
            **finding.model_dump(exclude={"cordon_reasons"}),
            host=settings.host_id,
            instance=self.instance,
            time=time.time(),
            running_calls=len(self.in_flight.snapshot()),
            wire=WIRE_VERSION,
            draining=self.in_flight.draining,
            cordon_reasons=reasons,
            schedulable=not reasons,
        )
        ttl_s = max(1, int(settings.heartbeat_interval_s * 3))
        try:
            if not self.heartbeats.publish(beat, ttl_s=ttl_s, swept_mark=self.swept_mark):
                self.reprobe.set()  # Redis lost its state: the probe sweeps, then it beats
        except Exception as exc:  # noqa: BLE001 - a dead beat makes a live worker look dead
            log.warning("worker.heartbeat_failed", host=settings.host_id, error=repr(exc))

    def retire_heartbeat(self) -> None:
        """Say at once that this worker is gone (instead of letting the key expire), so the
        API stops waiting on it and cancels calls still queued for it."""
        try:
            self.heartbeats.retire()
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.warning("worker.retire_failed", error=repr(exc))


SWEEPING = "starting: ending what an earlier run left on this host"
"""The cordon reason of a host whose worker has not finished its first sweep."""
RECOVERING = "recovering: Redis lost its state; failing and ending the sandboxes it forgot"
"""The cordon reason of a host whose worker has not swept since Redis lost its state."""

_current: list[Host] = []
_current_lock = threading.Lock()


def current() -> Host:
    """This process's host, built from the process's settings on first use."""
    if not _current:
        with _current_lock:
            if not _current:
                _current.append(Host(get_settings()))
    return _current[0]


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
