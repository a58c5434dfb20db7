"""The tasks workers run: one handler per task of state/wire.Tasks, registered by
:func:`handles` under its name, taking the task's request model and returning its reply
model; an infrastructure fault comes back as data, with its evidence, not as a Celery
exception."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from celery.signals import setup_logging, worker_ready, worker_shutdown, worker_shutting_down

from orchestrator.images.repo_setup import SetupFailed, ensure_setup_image
from orchestrator.observability import metrics
from orchestrator.observability.logging import (
    bind_sandbox,
    capture_stray_output,
    configure_logging,
    get_logger,
    rollout_context,
)
from orchestrator.observability.metrics import serve_worker_metrics
from orchestrator.queue import worker
from orchestrator.sandbox import testrun
from orchestrator.sandbox.backend import (
    BackendUnavailable,
    ExecOp,
    ExecRan,
    FileError,
    FileRead,
    FileRefused,
    InputClosed,
    ProbeResult,
    ReadOp,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    SnapshotRefused,
)
from orchestrator.sandbox.repos import RepoError
from orchestrator.secrets import SecretUnreadable, read_secret, redact
from orchestrator.state import broker
from orchestrator.state.calls import DUPLICATE_DELIVERY, TicketState
from orchestrator.state.pool_sizing import POOL_LABEL, PoolTarget, same_spec, targets
from orchestrator.state.streams import OutputSink
from orchestrator.state.wire import (
    Accepted,
    CheckCommit,
    CommitChecked,
    Created,
    CreateSandbox,
    DestroySandbox,
    DropSnapshot,
    EarlierToolCall,
    FileOpDone,
    FileOpReply,
    FileOpRequest,
    InfraFault,
    InputNotTaken,
    InputSent,
    InputWritten,
    Measured,
    MeasureSandbox,
    Nothing,
    OpDone,
    ProbeSandbox,
    RecycleSandbox,
    ReplyT,
    RequestT,
    RunOp,
    RunTests,
    RunTestsReply,
    SandboxCreated,
    SandboxDestroyed,
    SandboxKilled,
    SandboxMeasured,
    SendInput,
    SignalExec,
    Signalled,
    SignalReply,
    SnapshotDropped,
    SnapshotMade,
    SnapshotNotTaken,
    SnapshotSandbox,
    Snapshotted,
    Task,
    Tasks,
    TestsRan,
)
from orchestrator.tools.shell import LIMIT_ERROR_KINDS

log = get_logger(__name__)


def connect_to_celery() -> None:
    """The worker's lifecycle on Celery's signals: logging set up by us, the host started
    once the worker is ready, drained on SIGTERM, retired at exit. Called by the Celery
    process's entry (celery_main.py), not at import."""
    setup_logging.connect(_on_setup_logging, weak=False)
    worker_ready.connect(_on_worker_ready, weak=False)
    worker_shutting_down.connect(_on_shutting_down, weak=False)
    worker_shutdown.connect(_on_shutdown, weak=False)


def _on_setup_logging(**_: Any) -> None:
    """Celery's own logging set-up is skipped (a receiver exists): our one root handler
    formats its lines too, and what Celery prints to stdout becomes log lines as well."""
    configure_logging()
    capture_stray_output()


def _on_worker_ready(**_: Any) -> None:
    host = worker.current()
    host.start_heartbeat()
    serve_worker_metrics(host.settings)
    log.info("worker.ready", host=host.settings.host_id, instance=host.instance)
    # What a crash or a lost Redis left behind goes now, not at the first reaper pass.
    threading.Thread(target=_sweep_at_start, name="start-sweep", daemon=True).start()


START_SWEEP_RETRY_S = 1.0
"""How soon a worker's first sweep is tried again when it could not finish."""


def _sweep_at_start() -> None:
    """The host's first sweep, tried until it finishes: the host is cordoned until then.
    On Kubernetes a release's pods start together, so a worker often starts before Redis
    answers; left to the reaper's next sweep of the host, its start took a minute or two
    longer (tests/k8s/test_helm_install.py: `helm install` to every pod Ready went from
    about 25 s to 110-140 s, and past 4 minutes once). Pinned by tests/k8s/
    test_stack_on_kubernetes.py (a worker started while the API server is away)."""
    host = worker.current()
    failures = 0
    while host.swept_mark is None and not host.in_flight.draining:
        try:
            log.info("worker.start_sweep", **host.sweep())
            return
        except Exception as exc:  # whatever failed, it is tried again
            failures += 1
            if failures == 1:
                log.exception("worker.start_sweep_failed")
            else:
                log.warning("worker.start_sweep_failed", error=str(exc), tries=failures)
            time.sleep(START_SWEEP_RETRY_S)


def _on_shutting_down(**_: Any) -> None:
    """SIGTERM: take no new sandboxes, let running calls finish within the grace period,
    then settle the rest as infrastructure errors and go (Celery's warm shutdown would
    wait for a 10-minute command)."""
    host = worker.current()
    host.drain()

    def give_up() -> None:
        deadline = time.monotonic() + host.settings.worker_shutdown_grace_s
        while host.in_flight.snapshot() and time.monotonic() < deadline:
            time.sleep(0.1)
        aborted = host.abort_in_flight("the shutdown grace period ran out")
        if aborted:
            host.retire_heartbeat()
            log.error("worker.aborted_calls", calls=aborted)
            os._exit(1)

    threading.Thread(target=give_up, name="shutdown-grace", daemon=True).start()


def _on_shutdown(**_: Any) -> None:
    host = worker.current()
    host.retire_heartbeat()
    log.info("worker.stopped", instance=host.instance)


def handles(
    task: Task[RequestT, ReplyT],
) -> Callable[[broker.Handler[RequestT, ReplyT]], broker.Handler[RequestT, ReplyT]]:
    """Register a handler of ``task``; the reply it returns goes to its caller's list."""
    return broker.handles(task, lambda request, reply: worker.current().reply(request, reply))


@handles(Tasks.CREATE_SANDBOX)
def create_sandbox(request: CreateSandbox) -> None:
    """Hand the creation to the host's creation lane and return at once: the reply goes
    to the caller's list when the sandbox is ready. Tool calls queued behind a burst of
    creations so wait for a Celery thread for microseconds, not for the creations."""
    worker.current().create_for_rollout(_create_and_reply, request, group=request.group)


def _create_and_reply(request: CreateSandbox) -> None:
    host = worker.current()
    with rollout_context(request.rollout_id, trace_id=request.trace_id):
        try:
            _set_up(request.spec)
            handle = host.backend.create(request.spec)
            bind_sandbox(handle.sandbox_id)
            created = SandboxCreated(Created(handle=handle))
        except SandboxError as exc:
            log.error("sandbox.create_failed", rollout_id=request.rollout_id, error=str(exc))
            created = SandboxCreated(InfraFault(error=str(exc)))
        except Exception as exc:
            log.exception("sandbox.create_crashed", rollout_id=request.rollout_id)
            created = SandboxCreated(InfraFault(error=f"{type(exc).__name__}: {exc}"))
        host.reply(request, created)


def _set_up(spec: SandboxSpec) -> None:
    """A repository's set-up image on this host before its sandbox is made there (built
    when another host built it first: images/repo_setup.py)."""
    wanted = spec.workspace
    if wanted is None or wanted.setup is None:
        return
    host = worker.current()
    try:
        if not host.repos.has_commit(wanted.repo, wanted.source, wanted.commit):
            raise SandboxError(f"{wanted.label} is not in its source any more")
        ensure_setup_image(host.settings, host.repos, wanted)
    except (RepoError, SetupFailed) as exc:
        raise SandboxError(f"cannot set {wanted.label} up on this host: {exc}") from exc


@handles(Tasks.RUN_OP)
def run_op(call: RunOp) -> None:
    """Run one tool call's sandbox operation, at most once: only after claiming its ticket,
    whose result then outlives this process (state/calls.py). The reply goes to the attempt
    the ticket names, which may be a retry of the one that sent this message."""
    started = time.time()
    with rollout_context(
        call.rollout_id, trace_id=call.trace_id, sandbox_id=call.handle.sandbox_id
    ):
        _run_op(call, started)


def _run_op(call: RunOp, started: float) -> None:
    host = worker.current()
    # This delivery's own claim: a message the broker delivered twice must still run once.
    delivery = uuid.uuid4().hex
    claimed = host.calls.claim(call.ticket, call.attempt, host.instance, started, delivery)
    if claimed != TicketState.RUNNING:
        # A duplicate is the broker's doing and never expected: worth a look.
        level = log.warning if claimed == DUPLICATE_DELIVERY else log.info
        level("tool.skipped", rollout_id=call.rollout_id, call_id=call.call_id, ticket=claimed)
        return
    with host.in_flight.running(call):
        try:
            outcome = _run_claimed(call)
        except Exception as exc:  # our bug: an infra fault with its evidence, not a hang
            log.exception("tool.crashed", rollout_id=call.rollout_id, call_id=call.call_id)
            outcome = InfraFault(error=f"the worker failed to run the call: {exc!r}")
    done = OpDone(
        outcome=outcome,
        queue_ms=max(0.0, (started - call.enqueued_at) * 1000),
        exec_ms=(time.time() - started) * 1000,
    )
    # The result goes onto the ticket and to the caller's reply list in one step.
    state, _ = host.calls.finish(call.ticket, host.instance, done.model_dump_json(), time.time())
    if state != TicketState.DONE:
        log.warning("tool.result_too_late", rollout_id=call.rollout_id, ticket=state)
    # Nothing is returned: the result went to the caller with the ticket's finish, and
    # Celery would make a repr of a returned one (up to the output budget) on every call.


# Limits after which the sandbox is probed (a read refused as pids_limit included): a
# limit the agent hit must not have taken the sandbox with it unnoticed.
_PROBE_AFTER = {"timeout", "memory", "pids", "disk"}


def _run_claimed(call: RunOp) -> ExecRan | FileRead | FileRefused | SandboxKilled | InfraFault:
    host = worker.current()
    try:
        values = {name: read_secret(name, source) for name, source in call.op.secrets.items()}
    except SecretUnreadable as exc:  # the deployment's configuration: ours, named only
        return InfraFault(error=str(exc), evidence={"secret": exc.name})
    op = call.op
    if values and isinstance(op, ExecOp):
        op = op.model_copy(update={"env": {**(op.env or {}), **values}})
    ran = _run_checked(call, op, host)
    return _redacted(ran, values) if values else ran


def _redacted(
    ran: ExecRan | FileRead | FileRefused | SandboxKilled | InfraFault, values: dict[str, str]
) -> ExecRan | FileRead | FileRefused | SandboxKilled | InfraFault:
    """What an operation gave back, each secret's value taken out (docs/tenancy.md): done
    here, so no value reaches Redis, the API, a trajectory or a log."""
    if isinstance(ran, ExecRan):
        result = ran.result
        streams = {
            name: stream.model_copy(
                update={"head": redact(stream.head, values), "tail": redact(stream.tail, values)}
            )
            for name, stream in (("stdout", result.stdout), ("stderr", result.stderr))
        }
        return ExecRan(result=result.model_copy(update=streams))
    if isinstance(ran, FileRead):
        text = redact(ran.result.text, values)
        return FileRead(result=ran.result.model_copy(update={"text": text}))
    return ran


def _run_checked(
    call: RunOp, op: ExecOp | ReadOp, host: worker.Host
) -> ExecRan | FileRead | FileRefused | SandboxKilled | InfraFault:
    try:
        sink = None
        if call.stream_key is not None and isinstance(op, ExecOp):
            sink = OutputSink(host.redis, call.stream_key)
        ran = host.backend.run_op(call.handle, op, sink)
    except SandboxError as exc:
        probe = _probe(call.handle)
        if probe.agent_caused:
            # The agent's own doing took the whole sandbox down (gVisor ends the sandbox
            # at its memory limit): scored as the agent's mistake, with what is lost.
            return SandboxKilled(cause=probe.agent_caused, detail=probe.detail or probe.state)
        log.error(
            "tool.infra_error",
            rollout_id=call.rollout_id,
            sandbox_id=call.handle.sandbox_id,
            host=call.handle.host,
            error=str(exc),
            probe=probe.model_dump(mode="json"),
        )
        return InfraFault(
            error=f"{type(exc).__name__}: {exc}", evidence={"probe": probe.model_dump(mode="json")}
        )
    hit = _limits_hit(ran)
    if hit:
        probe = _probe(call.handle)
        if not (probe.alive and probe.agent_ok) and not probe.agent_caused:
            log.error(
                "tool.sandbox_unhealthy_after_limit",
                rollout_id=call.rollout_id,
                sandbox_id=call.handle.sandbox_id,
                limit=hit,
                probe=probe.model_dump(mode="json"),
            )
            return InfraFault(
                error=f"the sandbox is unhealthy after a {hit}: {probe.detail or probe.state}",
                evidence={"probe": probe.model_dump(mode="json")},
            )
    return ran


def _limits_hit(ran: ExecRan | FileRead | FileRefused) -> str:
    """The limit the operation hit after which its sandbox is probed ('' none): its error
    kind (memory_limit, timeout, ...), as the API will name it."""
    if isinstance(ran, FileRefused):
        return ran.error if ran.error == "pids_limit" else ""
    if isinstance(ran, ExecRan):
        hit = [kind for kind in ran.result.limits_hit if kind in _PROBE_AFTER]
        if hit:
            return LIMIT_ERROR_KINDS[hit[0]]
    return ""


@handles(Tasks.EARLIER_TOOL_CALL)
def refuse_tool_call(call: EarlierToolCall) -> None:
    """A tool call from an API of an earlier release (the tool, not its operation), during
    an upgrade that mixes releases: cancelled unrun, so that API answers it as never run (a
    503 to retry) within a second instead of waiting out the call's bound."""
    with rollout_context(call.rollout_id):
        state = worker.current().calls.refuse(call.ticket, call.attempt)
        log.warning("tool.refused_earlier_wire", call_id=call.call_id, ticket=state)


def _probe(handle: SandboxHandle) -> ProbeResult:
    """The sandbox's probe; a backend that cannot tell is evidence too (state unknown)."""
    try:
        return worker.current().backend.probe(handle)
    except SandboxError as exc:
        return ProbeResult(alive=False, state="unknown", agent_ok=False, detail=f"probe: {exc}")


@handles(Tasks.PROBE_SANDBOX)
def probe_sandbox(request: ProbeSandbox) -> ProbeResult:
    """Is this sandbox alive and does a trivial command run (before grading)."""
    with rollout_context(request.handle.rollout_id, sandbox_id=request.handle.sandbox_id):
        return _probe(request.handle)


@handles(Tasks.RUN_TESTS)
def run_tests(request: RunTests) -> RunTestsReply:
    """A grader's tests in the rollout's sandbox (sandbox/testrun.py). A backend failure
    comes back with a probe of the sandbox as evidence: no verdict."""
    handle = request.handle
    with rollout_context(handle.rollout_id, sandbox_id=handle.sandbox_id):
        try:
            result = testrun.run_tests(worker.current().backend, handle, request.run)
        except SandboxError as exc:
            probe = _probe(handle)
            log.warning("grade.tests_failed", error=str(exc), probe=probe.state)
            return RunTestsReply(
                InfraFault(
                    error=f"{type(exc).__name__}: {exc}",
                    evidence={"probe": probe.model_dump(mode="json")},
                )
            )
        log.info(
            "grade.tests_ran",
            tests=len(request.run.tests),
            passed=sum(1 for o in result.outcomes.values() if o == testrun.TestOutcome.PASSED),
            timed_out=result.timed_out,
        )
        return RunTestsReply(TestsRan(result=result))


@handles(Tasks.FILE_OP)
def file_op(request: FileOpRequest) -> FileOpReply:
    """A filesystem operation in a sandbox, for a client that drives it (the E2B API). A
    backend failure comes back with a probe of the sandbox as evidence."""
    with rollout_context(request.handle.rollout_id, sandbox_id=request.handle.sandbox_id):
        try:
            result = worker.current().backend.file_op(
                request.handle,
                request.action,
                request.path,
                target=request.target,
                depth=request.depth,
                data=request.data,
                max_bytes=request.max_bytes,
            )
            reply = FileOpReply(FileOpDone(result=result))
        except FileError as exc:
            reply = FileOpReply(FileRefused(error=exc.kind, message=exc.message))
        except SandboxError as exc:
            probe = _probe(request.handle)
            reply = FileOpReply(
                InfraFault(
                    error=f"{type(exc).__name__}: {exc}",
                    evidence={"probe": probe.model_dump(mode="json")},
                )
            )
        return reply


@handles(Tasks.SNAPSHOT_SANDBOX)
def snapshot_sandbox(request: SnapshotSandbox) -> SnapshotMade:
    """Keep a sandbox's filesystem state on this host (sandbox/docker/snapshots.py)."""
    with rollout_context(request.handle.rollout_id, sandbox_id=request.handle.sandbox_id):
        try:
            made = SnapshotMade(
                Snapshotted(
                    taken=worker.current().backend.snapshot(request.handle, request.snapshot_id)
                )
            )
        except SnapshotRefused as exc:
            made = SnapshotMade(SnapshotNotTaken(reason=str(exc)))
        except SandboxError as exc:
            log.error("sandbox.snapshot_failed", snapshot_id=request.snapshot_id, error=str(exc))
            made = SnapshotMade(InfraFault(error=f"{type(exc).__name__}: {exc}"))
        return made


@handles(Tasks.MEASURE_SANDBOX)
def measure_sandbox(request: MeasureSandbox) -> SandboxMeasured:
    """What a sandbox uses now (E2B's ``get_metrics``)."""
    try:
        return SandboxMeasured(Measured(usage=worker.current().backend.usage(request.handle)))
    except SandboxError as exc:
        return SandboxMeasured(InfraFault(error=f"{type(exc).__name__}: {exc}"))


@handles(Tasks.DROP_SNAPSHOT)
def drop_snapshot(request: DropSnapshot) -> SnapshotDropped:
    """Remove a snapshot's files from this host, unless a sandbox or another snapshot is
    made over it (the sweep removes it then, once it is free)."""
    try:
        return SnapshotDropped(removed=worker.current().backend.drop_snapshot(request.snapshot_id))
    except SandboxError as exc:
        return SnapshotDropped(error=str(exc))


@handles(Tasks.SEND_INPUT)
def send_input(request: SendInput) -> InputSent:
    """Write to a sandbox's running command's standard input by its exec id."""
    with rollout_context(request.handle.rollout_id, sandbox_id=request.handle.sandbox_id):
        try:
            found = worker.current().backend.send_input(
                request.handle,
                request.exec_id,
                request.data,
                close=request.close,
                resize=request.resize,
            )
            reply = InputSent(InputWritten(found=found))
        except InputClosed as exc:
            reply = InputSent(InputNotTaken(reason=str(exc)))
        except SandboxError as exc:
            reply = InputSent(InfraFault(error=f"{type(exc).__name__}: {exc}"))
        return reply


@handles(Tasks.SIGNAL_EXEC)
def signal_exec(request: SignalExec) -> SignalReply:
    """Kill (or SIGTERM) a sandbox's running command by its exec id."""
    with rollout_context(request.handle.rollout_id, sandbox_id=request.handle.sandbox_id):
        try:
            found = worker.current().backend.signal_exec(
                request.handle, request.exec_id, kill=request.kill
            )
            reply = SignalReply(Signalled(found=found))
        except SandboxError as exc:
            reply = SignalReply(InfraFault(error=f"{type(exc).__name__}: {exc}"))
        return reply


@handles(Tasks.DESTROY_SANDBOX)
def destroy_sandbox(request: DestroySandbox) -> SandboxDestroyed:
    with rollout_context(request.handle.rollout_id, sandbox_id=request.handle.sandbox_id):
        try:
            worker.current().backend.destroy(request.handle)
        except SandboxError as exc:
            return SandboxDestroyed(error=str(exc))
        log.info("sandbox.reaped", reason=request.reason)
        return SandboxDestroyed(destroyed=True)


@handles(Tasks.RECYCLE_SANDBOX)
def recycle_sandbox(request: RecycleSandbox) -> Accepted:
    """Reset a sandbox whose rollout ended cleanly and put it in its pool, or destroy it
    (rollouts/recycling.py says when). In the recycle lane, counted as one of the rollouts'
    creations at the creation gate: the sandbox it makes is one a rollout of the next
    burst takes, so it goes before refills (which would make new ones beside it). (In the
    pool lane, one at a time and behind every cold create, a second burst found 33 of its
    256 rollouts' sandboxes reset in time, and 504 sandboxes ran at once.) The reset waits
    for the host's calls to pause, unless a new rollout waits for it (yield_to_calls)."""
    host = worker.current()
    host.create_for_rollout(_recycle, request, lane=host.recycles)
    return Accepted()


class RecycleResult(StrEnum):
    """How a recycling ended (the ``result`` of orchestrator_sandboxes_recycled_total):
    back in its pool, or destroyed, and why."""

    RECYCLED = "recycled"
    SPEC_CHANGED = "spec_changed"  # its pool is gone or takes another spec now
    POOL_FULL = "pool_full"
    LIMIT_HIT = "limit_hit"  # an OOM kill, its process limit, a full /workspace
    AUDIT_FAILED = "audit_failed"  # reset, but not the same as a fresh sandbox
    RESET_FAILED = "reset_failed"


def _recycle(request: RecycleSandbox) -> None:
    host = worker.current()
    handle = request.handle
    with rollout_context(handle.rollout_id, sandbox_id=handle.sandbox_id):
        settings = host.settings
        filler = host.pool_filler
        backend = host.backend
        pool = next(
            (
                p
                for p in targets(host.environments, settings, filler.demand())
                if p.name == request.pool
            ),
            None,
        )
        reserved = False
        report = None
        result, why = RecycleResult.RECYCLED, ""
        try:
            # A limit the sandbox hit is said before a full pool: it is what the sandbox
            # did (whether a refill landed first is timing), and the audit's reason.
            hit = [] if pool is None else backend.limits_hit(handle)
            if pool is None or not same_spec(pool.spec, request.spec):
                result, why = RecycleResult.SPEC_CHANGED, "its pool takes no sandbox of its spec"
            elif hit:
                result, why = RecycleResult.LIMIT_HIT, f"it hit {', '.join(hit)}"
            elif not filler.reserve(pool, 1):
                result, why = RecycleResult.POOL_FULL, "its pool is full"
            else:
                reserved = True
                host.yield_to_calls("reset", request.pool)
                report = backend.reset(handle, request.spec)
                if not report.clean:
                    found = "; ".join(report.differences)[:500]
                    result, why = RecycleResult.AUDIT_FAILED, f"its audit found {found}"
        except Exception as exc:  # noqa: BLE001 - whatever failed, it ends pooled or destroyed
            result, why = (
                RecycleResult.RESET_FAILED,
                f"its reset failed: {type(exc).__name__}: {exc}",
            )
        metrics.SANDBOXES_RECYCLED.labels(result).inc()
        if result == RecycleResult.RECYCLED and pool is not None and report is not None:
            recycled = handle.model_copy(
                update={
                    "rollout_id": POOL_LABEL,
                    "reuse_count": handle.reuse_count + 1,
                    "reset_digest": report.digest,
                }
            )
            filler.deliver(pool, recycled, request.transit)
            filler.recycled(request.pool, handle.sandbox_id)  # after: a waiter finds it ready
            log.info("sandbox.recycled", pool=pool.name, reuses=recycled.reuse_count, ms=report.ms)
            return
        filler.recycled(request.pool, handle.sandbox_id)  # its waiters make cold ones now
        # A reset or an audit that fails is not what a normal run does: worth a warning.
        abnormal = result in (RecycleResult.AUDIT_FAILED, RecycleResult.RESET_FAILED)
        (log.warning if abnormal else log.info)(
            "sandbox.not_recycled", result=result, why=why, reason=request.reason
        )
        try:
            backend.destroy(handle)
        except SandboxError as exc:
            # The host's sweep destroys it (its rollout is closed, it is in no pool).
            log.warning("sandbox.destroy_failed", error=str(exc))
        if reserved and pool is not None:
            filler.deliver(pool, None)
        host.release_slot(handle.host, request.transit)


@handles(Tasks.SWEEP_HOST)
def sweep_host(_request: Nothing) -> None:
    """Destroy this host's expired sandboxes and leftovers by label, and every sandbox
    whose rollout is over or unknown to Redis (orphans)."""
    swept = worker.current().sweep()
    # A line per sweep only when it removed something.
    if any(value for name, value in swept.items() if name != "examined"):
        log.info("worker.swept", **swept)


@handles(Tasks.CHECK_COMMIT)
def check_commit(request: CheckCommit) -> CommitChecked:
    """Whether a repository has a commit, fetching it on this host when the store lacks
    it, and the commit's set-up image (built here when missing); with ``materialise``, the
    commit's layer built here too (sandbox/repos.py). A commit the source lacks, and a
    set-up that does not build, are answers; a source or store that fails is an error."""
    wanted = request.workspace
    repos = worker.current().repos
    settings = worker.current().settings
    host = settings.host_id
    try:
        if not repos.has_commit(wanted.repo, wanted.source, wanted.commit):
            return CommitChecked(found=False, host=host)
        image = ""
        if wanted.setup is not None:
            image, _ = ensure_setup_image(settings, repos, wanted)
        built = False
        if request.materialise:
            built = repos.materialise(wanted.repo, wanted.source, wanted.commit).built
    except SetupFailed as exc:
        log.warning("repo.setup_failed", repo=wanted.repo, commit=wanted.commit, error=str(exc))
        return CommitChecked(found=True, host=host, setup_error=str(exc))
    except (RepoError, BackendUnavailable, OSError) as exc:
        log.warning("repo.check_failed", repo=wanted.repo, commit=wanted.commit, error=str(exc))
        return CommitChecked(host=host, error=str(exc))
    return CommitChecked(
        found=True,
        built=built,
        host=host,
        setup_image=image,
        committed_at=repos.committed_at(wanted.repo, wanted.commit),
    )


@handles(Tasks.REFILL_POOLS)
def refill_pools(_request: Nothing) -> None:
    """Top every warm pool up to its size now (state/pools.py: demand-sized) with sandboxes
    on this host, within this host's capacity; drop pool sandboxes too close to their
    expiry, and those past their pool's size (its demand fell). The creations wait while
    any rollout's creation is waiting (queue/worker.py's pool lane)."""
    host = worker.current()
    if not host.schedulable():
        return
    settings = host.settings
    filler = host.pool_filler
    jobs: list[PoolTarget] = []
    dropped = 0
    for pool in targets(host.environments, settings, filler.demand()):
        stale = [
            (handle, "pool sandbox near its expiry")
            for handle in filler.prune(pool, min_left_s=pool.spec.lifetime_s / 2)
        ] + [(handle, "pool past its size") for handle in filler.trim(pool)]
        for handle, reason in stale:
            dropped += 1
            payload = DestroySandbox(handle=handle, reason=reason)
            broker.celery_app().send_task(
                Tasks.DESTROY_SANDBOX.name.value,
                args=[payload.model_dump(mode="json")],
                queue=host.keys.host_queue(handle.host),
                ignore_result=True,
            )
            host.release_slot(handle.host)
        size = filler.refill_size(pool)
        jobs += [pool] * filler.reserve(pool, size, size)
    if not jobs:
        if dropped:
            log.info("pool.refilled", created=0, wanted=0, dropped=dropped)
        return
    # Through the pool lane: never while a rollout's own sandbox waits to be made.
    created = sum(
        future.result() for future in [host.pool_creations.submit(_fill_one, p) for p in jobs]
    )
    log.info("pool.refilled", created=created, wanted=len(jobs), dropped=dropped)


def _fill_one(pool: PoolTarget) -> bool:
    host = worker.current()
    filler = host.pool_filler
    if not host.gate.pool_turn():
        filler.deliver(pool, None)  # stopping: the reservation is freed
        return False
    host.yield_to_calls("refill")
    transit = filler.take_slot(f"create:{uuid.uuid4().hex}")
    if transit is None:
        filler.deliver(pool, None)
        return False
    try:
        _set_up(pool.spec)
        handle = host.backend.create(pool.spec)
    except SandboxError as exc:
        log.warning("pool.create_failed", pool=pool.name, error=str(exc))
        host.release_slot(host.settings.host_id)
        filler.deliver(pool, None, transit)
        return False
    filler.deliver(pool, handle, transit)
    return True
