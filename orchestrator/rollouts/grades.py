"""Grading a rollout, once: a retry (even a concurrent one) gets the score stored first;
a rollout that failed, or whose sandbox died behind the agent's back, is a 503 and never
a score; a grader that raises is a 503, never a zero. The grade that stores the score
closes the rollout too (its environment's ``grace_after_grade_s``, default 0), so its
sandbox goes back to its pool, or is destroyed, at once.

Given the start (a grade waits for the rollout's sandbox, and reads its pinned
environment) and the close (a fault found before grading fails the rollout; the score
stored, it ends the rollout).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from orchestrator.config import Settings
from orchestrator.environments.loader import ResolvedEnvironment
from orchestrator.grading import (
    GradeContext,
    Grader,
    GraderConfigError,
    GraderUnavailable,
    ItemError,
    SandboxUnusable,
    get_grader,
    grade_context,
)
from orchestrator.observability import metrics
from orchestrator.observability.logging import bind_sandbox, get_logger, in_rollout_context
from orchestrator.outcomes import Cause, Outcome
from orchestrator.rollouts.bounds import Deadline
from orchestrator.rollouts.closes import Closer
from orchestrator.rollouts.errors import (
    GradePending,
    GraderFailed,
    InfraError,
    Rejected,
    RejectedKind,
    RolloutVanished,
)
from orchestrator.rollouts.lookup import owned, present, unknown
from orchestrator.rollouts.models import new_record
from orchestrator.rollouts.starts import Starter
from orchestrator.sandbox.backend import SandboxHandle
from orchestrator.sandbox.testrun import TestRun, TestRunResult
from orchestrator.state.errors import StateError
from orchestrator.state.models import RolloutSource, RolloutState
from orchestrator.state.records import GradeInputs, Rollout, RolloutStore
from orchestrator.state.replies import QueueTimeout
from orchestrator.state.wire import InfraFault, RunTests, Tasks
from orchestrator.tenants import OPERATOR, Principal

log = get_logger(__name__)

GRADE_POLL_S = 0.2
"""How often a grade waiting for another grade of its rollout looks for the score."""


class GradeReply(BaseModel):
    score: float
    details: dict[str, Any]


class Grading:
    def __init__(
        self, settings: Settings, store: RolloutStore, starter: Starter, closer: Closer
    ) -> None:
        self.settings = settings
        self.store = store
        self.starter = starter
        self.closer = closer
        # Graders wait (on a judge, on a sandbox's tests) for as long as their bounds: in
        # the loop's default pool, 6 threads on 2 cores, a burst of grades would take every
        # thread a rollout's start needs (Starter.aresolve).
        self.threads = ThreadPoolExecutor(settings.grade_threads, thread_name_prefix="grade")

    @in_rollout_context
    async def grade(
        self,
        rollout_id: str,
        answer: str,
        item: dict[str, Any] | None,
        *,
        source: RolloutSource,
        sample: dict[str, Any] | None = None,
        caller: Principal = OPERATOR,
    ) -> GradeReply:
        """Grade once; a retry (even a concurrent one) gets the score stored first. An
        infra-failed rollout is a 503. A rejected grade (422) stores nothing. ``sample`` is
        the trainer's output as sent (Agent RFT's ``sample``), kept with the score.
        ``caller``: another tenant's rollout is unknown to it (a 404)."""
        rollout = await self.store.get(rollout_id)
        if rollout is None:
            if source != RolloutSource.AGENT_RFT or item is None:
                raise unknown(rollout_id)
            # A rollout may end without a single tool call: grade it on an empty trajectory,
            # and keep a record only once the grade succeeded.
            resolved = await self.starter.aresolve(item)
            grader = self._grader(resolved)
            context = GradeContext(
                answer=answer,
                item=item,
                trajectory=[],
                sample=sample or {},
                rollout_id=rollout_id,
                environment=resolved.environment.name,
                services=StoreServices(self.store, asyncio.get_running_loop()),
            )
            graded = await self._run_grader(grader, rollout_id, resolved, context)
            record = new_record(
                rollout_id,
                source,
                resolved,
                item,
                state=RolloutState.GRADED,
                graded_at=time.time(),
                score=graded.score,
                grade_details=graded.details,
                grade_inputs=_inputs(resolved, context),
                outcome=Outcome.OK,
                tenant=caller.tenant,
            )
            if await self.store.create(record):
                _observe(resolved, graded.score)
                return graded
            rollout = present(await self.store.get(rollout_id), rollout_id, "it was graded")
        owned(rollout, rollout_id, caller)
        deadline = Deadline.for_source(self.settings, source)
        rollout = await self.starter.wait_ready(rollout, deadline)
        bind_sandbox(rollout.sandbox.sandbox_id if rollout.sandbox else None)
        await self.closer.refuse_failed(rollout, "rollout failed")
        if rollout.score is not None:
            return GradeReply(score=rollout.score, details=rollout.grade_details or {})
        resolved = self.starter.environment_of(rollout)
        grader = self._grader(resolved)
        if not grader.uses_sandbox():
            return await self._graded(rollout, resolved, grader, answer, item, sample, None)
        if rollout.sandbox is None or rollout.closed_at is not None:
            return await self._graded(rollout, resolved, grader, answer, item, sample, None)
        # One grade at a time works in the sandbox: a retry that came while the first still
        # runs the tests (a platform's timeout is shorter than a test suite) would end the
        # first one's test processes as it staged its own, and the first would store
        # failures the agent never caused. The retry waits for the score instead.
        hold_s = grader.sandbox_time_s() + 60
        while not await self.store.take_grade_lease(rollout_id, hold_s):
            current = present(await self.store.get(rollout_id), rollout_id, "it was graded")
            await self.closer.refuse_failed(current, "rollout failed")
            if current.score is not None:
                return GradeReply(score=current.score, details=current.grade_details or {})
            if deadline.remaining() <= GRADE_POLL_S:
                raise GradePending(rollout_id)
            await asyncio.sleep(GRADE_POLL_S)
        try:
            # The lease's holder reads the record again: a grade that held it before may
            # have stored the score since this one's first read.
            current = present(await self.store.get(rollout_id), rollout_id, "it was graded")
            await self.closer.refuse_failed(current, "rollout failed")
            if current.score is not None:
                return GradeReply(score=current.score, details=current.grade_details or {})
            # Only a grader that reads the sandbox needs it alive; one that scores the
            # answer against the row and the trajectory (file_f1, numeric_match) does not.
            # Probed under the lease: a racing grade's staging ends every process of the
            # agent's user, a probe's `true` too (exit 137: seen failing a rollout whose
            # first grade then scored it).
            await self._probe_before_grading(current)
            sandbox = QueuedSandbox(self.starter, rollout.sandbox, asyncio.get_running_loop())
            # Not idle while it is judged: the reaper leaves it alone for as long as the
            # grader may work in it (the grade sets the activity again when it is done).
            await self.store.update(rollout_id, last_activity=time.time() + grader.sandbox_time_s())
            return await self._graded(rollout, resolved, grader, answer, item, sample, sandbox)
        finally:
            await self.store.end_grade_lease(rollout_id)

    async def _graded(
        self,
        rollout: Rollout,
        resolved: ResolvedEnvironment,
        grader: Grader,
        answer: str,
        item: dict[str, Any] | None,
        sample: dict[str, Any] | None,
        sandbox: QueuedSandbox | None,
    ) -> GradeReply:
        """Run the grader on ``rollout`` and store the first score (see :meth:`grade`)."""
        await self.closer.refuse_failed_over(rollout)
        rollout_id = rollout.rollout_id
        context = GradeContext(
            answer=answer,
            item=item if item is not None else rollout.item,
            trajectory=await self.store.trajectory(rollout_id),
            sample=sample or {},
            sandbox=sandbox,
            rollout_id=rollout_id,
            environment=resolved.environment.name,
            services=StoreServices(self.store, asyncio.get_running_loop()),
        )
        graded = await self._run_grader(grader, rollout_id, resolved, context)
        fields: dict[str, Any] = {
            "score": graded.score,
            "grade_details": graded.details,
            "grade_inputs": _inputs(resolved, context),
            "graded_at": time.time(),
            "outcome": Outcome.OK,
            "last_activity": time.time(),
        }
        if rollout.state != RolloutState.CLOSED:
            fields["state"] = RolloutState.GRADED
        updated = await self.store.update(rollout_id, once=True, **fields)
        if updated is None or updated.score is None:
            raise RolloutVanished(rollout_id, "it was graded")
        _observe(resolved, updated.score)
        log.info(
            "rollout.graded",
            rollout_id=rollout_id,
            score=updated.score,
            tool_calls=len(context.trajectory),
        )
        grace_s = resolved.environment.grace_after_grade_s
        if grace_s == 0 and updated.closed_at is None:  # (a trainer may have closed it)
            await self._hand_back(rollout_id)
        return GradeReply(score=updated.score, details=updated.grade_details or {})

    async def _hand_back(self, rollout_id: str) -> None:
        """Close a rollout at its grade: its sandbox goes back to its pool (recycled) or is
        destroyed now, not a reaper pass after a grace period. Nothing after the score
        needs the sandbox: a call is a 409 and a retried grade returns the score stored.
        A destroy is waited for, as any close's is, so a trainer's close after the grade
        still returns with the sandbox gone; a recycle is only sent. The score is stored
        already, so a close that fails costs the reply nothing: the reaper's next pass
        closes what is left (its grace is 0 too)."""
        try:
            await self.closer.close(rollout_id, "graded")
        except (InfraError, StateError) as exc:
            log.warning("rollout.close_at_grade_failed", rollout_id=rollout_id, error=str(exc))

    async def _probe_before_grading(self, rollout: Rollout) -> None:
        """For a grader that needs the sandbox: a sandbox that died behind the agent's
        back (not by its own doing) makes the score unsound, so the rollout is
        infra_failed rather than scored. A slow sandbox is a live one."""
        handle = rollout.sandbox
        if handle is None or rollout.closed_at is not None:
            return
        try:
            probe = await self.starter.probe(handle)
        except QueueTimeout as exc:
            raise await self.closer.fail(
                rollout.rollout_id,
                Cause.PROBE_FAILED,
                f"the sandbox could not be checked before grading: {exc}",
                {},
            ) from exc
        if (probe.alive and probe.agent_ok) or probe.agent_caused:
            return
        evidence = {"probe": probe.model_dump(mode="json")}
        message = f"the sandbox is not healthy: {probe.detail or probe.state}"
        raise await self.closer.fail(rollout.rollout_id, Cause.SANDBOX_DEAD, message, evidence)

    def _grader(self, resolved: ResolvedEnvironment) -> Grader:
        """The rollout's grader; a misconfigured one is a 503 (checked at start, so only a
        pinned environment from an older configuration can get here)."""
        config = resolved.environment.grader
        try:
            return get_grader(config.name, config.options)
        except GraderConfigError as exc:
            _failed(resolved, GraderErrorKind.MISCONFIGURED)
            raise GraderFailed(f"grader misconfigured: {exc}") from exc

    async def _run_grader(
        self,
        grader: Grader,
        rollout_id: str,
        resolved: ResolvedEnvironment,
        context: GradeContext,
    ) -> GradeReply:
        try:
            # In the grades' own threads, with the request's context (the log's ids).
            call = functools.partial(contextvars.copy_context().run, grade_context, grader, context)
            graded = await asyncio.get_running_loop().run_in_executor(self.threads, call)
        except ItemError as exc:
            raise Rejected(
                RejectedKind.INVALID,
                f"the dataset row cannot be graded: {exc}",
                code="invalid_item",
            ) from exc
        except SandboxUnusable as exc:
            # The sandbox died, or our machinery around it failed, while the grader used
            # it: the rollout is discarded with the evidence, never scored.
            raise await self.closer.fail(
                rollout_id,
                Cause.SANDBOX_DEAD,
                f"the sandbox failed while it was graded: {exc}",
                exc.evidence,
            ) from exc
        except GraderUnavailable as exc:
            # What the grader depends on (a judge model) failed: a 503 with its evidence,
            # the rollout left as it is for a retry once the service is back.
            _failed(resolved, exc.kind)
            log.warning(
                "grade.unavailable", rollout_id=rollout_id, kind=exc.kind, evidence=exc.evidence
            )
            raise GraderFailed(str(exc), code=exc.kind, evidence=exc.evidence) from exc
        except Exception as exc:  # any grader bug is a 503, never a 0
            _failed(resolved, GraderErrorKind.RAISED)
            log.exception("grade.failed", rollout_id=rollout_id)
            raise GraderFailed(f"grader {grader.name} failed: {exc!r}") from exc
        return GradeReply(
            score=graded.score,
            details={**graded.details, "tool_calls": len(context.trajectory)},
        )


class QueuedSandbox:
    """A rollout's sandbox for a grader that needs it (grading.SandboxAccess), reached
    through its host's worker. The grader runs in a thread (Grading.threads), the queue
    on the event loop: each operation is handed to the loop and waited for."""

    def __init__(
        self, starter: Starter, handle: SandboxHandle, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.starter = starter
        self.handle = handle
        self.loop = loop

    def run_tests(self, run: TestRun) -> TestRunResult:
        """:func:`orchestrator.sandbox.testrun.run_tests` on the sandbox's host."""
        return asyncio.run_coroutine_threadsafe(self._run_tests(run), self.loop).result()

    async def _run_tests(self, run: TestRun) -> TestRunResult:
        handle = self.handle
        try:
            reply = await self.starter.queue.call(
                Tasks.RUN_TESTS,
                RunTests(handle=handle, run=run),
                host=handle.host,
                # The run's budget, and its set-up: ending the agent's processes, staging.
                timeout_s=run.timeout_s + 60 + self.starter.settings.queue_wait_s,
            )
        except QueueTimeout as exc:
            raise SandboxUnusable(f"no worker ran the tests: {exc}") from exc
        if isinstance(reply.root, InfraFault):
            raise SandboxUnusable(reply.root.error, reply.root.evidence)
        return reply.root.result


class StoreServices:
    """The deployment's verdict cache and grader slots (grading.GradeServices), kept in
    the rollout store. The grader runs in a thread (Grading.threads), the store on the
    event loop: each operation is handed to the loop and waited for."""

    POLL_S = (0.05, 0.5)
    """How soon a grade waiting for a slot asks again: at first, and at most (the wait
    grows by half each time, so a burst's waiters do not flood the loop and Redis)."""

    def __init__(self, store: RolloutStore, loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.loop = loop

    def _run(self, coroutine: Any) -> Any:
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()
        except StateError as exc:
            raise GraderUnavailable(
                "state_store_unavailable", f"the state store (Redis) is unavailable: {exc!r}"
            ) from exc

    def recall(self, key: str) -> dict[str, Any] | None:
        return self._run(self.store.recall_verdict(key))  # type: ignore[no-any-return]

    def remember(self, key: str, verdict: dict[str, Any], ttl_s: float) -> None:
        self._run(self.store.keep_verdict(key, verdict, ttl_s))

    @contextmanager
    def slot(self, name: str, limit: int, wait_s: float, hold_s: float) -> Iterator[bool]:
        holder = uuid.uuid4().hex
        until = time.monotonic() + wait_s
        held = bool(self._run(self.store.take_grader_slot(name, limit, holder, hold_s)))
        delay, most = self.POLL_S
        while not held and time.monotonic() < until:
            time.sleep(min(delay, max(0.0, until - time.monotonic())))
            held = bool(self._run(self.store.take_grader_slot(name, limit, holder, hold_s)))
            delay = min(delay * 1.5, most)
        try:
            yield held
        finally:
            if held:
                self._run(self.store.give_grader_slot(name, holder))


class GraderErrorKind(StrEnum):
    """Why a grade failed on our side (the ``kind`` of orchestrator_grader_errors_total)."""

    MISCONFIGURED = "misconfigured"  # the pinned grader configuration no longer builds
    RAISED = "raised"  # the grader raised, or returned something not a GradeResult


def _failed(resolved: ResolvedEnvironment, kind: str) -> None:
    metrics.GRADER_ERRORS.labels(resolved.environment.name, kind).inc()


def _observe(resolved: ResolvedEnvironment, score: float) -> None:
    metrics.ROLLOUTS_GRADED.inc()
    metrics.GRADE_SCORE.labels(resolved.environment.name).observe(score)


def _inputs(resolved: ResolvedEnvironment, context: GradeContext) -> GradeInputs:
    config = resolved.environment.grader
    return GradeInputs(
        answer=context.answer,
        sample=dict(context.sample),
        grader=config.name,
        grader_digest=config.digest,
        environment_digest=resolved.environment.digest,
    )
