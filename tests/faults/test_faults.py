"""Fault injection: real components broken while a batch of rollouts is in flight.

Each test runs a batch through the Agent RFT endpoints with the trainer emulator
(trainer.py), breaks one thing at the right moment (mostly while one rollout's call runs
``sleep 3``), then checks what the trainer must be able to rely on:

- a rollout harmed by infrastructure is never scored (its tool calls and its grade are 5xx
  until the trainer discards it), and its record says ``infra_failed``; a grader that
  raises is a 503 too, never a 0;
- a rollout whose agent broke its own sandbox is scored normally, never flagged;
- every rollout the fault did not touch scores exactly what its answer deserves;
- once the reaper has run, the deployment has no container left on the daemon;
- every call answered 200 ran exactly once (the sandboxes' ledgers), none ran twice.

Each test records its row (report.py); the table is printed at the end of the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import pytest
import requests

from tests.faults.conftest import BROKEN_GRADER_ENVIRONMENT, COMMAND_TIMEOUT_S, ENVIRONMENT
from tests.faults.infra import FaultStack
from tests.faults.report import Row, flagged, ledger_check, make_row, write_row
from tests.faults.trainer import Plan, Result, Step, Trainer, read_file, shell

pytestmark = [pytest.mark.xdist_group("faults"), pytest.mark.slow]

B = 6
MODULES = ["sessions.py", "models.py", "utils.py", "adapters.py", "auth.py", "cookies.py"]
REAP_TIMEOUT_S = 30
VICTIM = "victim"


def def_lines(module: str) -> int:
    """What ``grep -c 'def ' src/requests/<module>`` prints in the sandbox: the codebase is
    the `requests` package installed here."""
    text = (Path(requests.__file__).parent / module).read_text()
    return sum("def " in line for line in text.splitlines())


def plan(
    index: int,
    *,
    victim: bool = False,
    hostile: tuple[str, Step] | None = None,
    environment: str = ENVIRONMENT,
) -> Plan:
    """A scripted rollout: look around, count, read, (the victim's long call, or the agent's
    hostile one), count again; answer the count."""
    module = MODULES[index % len(MODULES)]
    answer = def_lines(module)
    steps: list[Step] = [
        shell("ls src/requests | head -40"),
        shell(f"grep -c 'def ' src/requests/{module}"),
    ]
    if victim:
        steps.append(shell("sleep 3; echo slept", marker=VICTIM))
    if hostile is not None:
        steps.append(hostile[1])
    steps += [
        read_file(f"src/requests/{module}"),
        shell(f"grep -n '^import' src/requests/{module} | head -5"),
        shell("git log --oneline | head -3"),
        shell(f"wc -l < src/requests/{module}"),
    ]
    item = {
        "environment": environment,
        "question": f"How many lines of src/requests/{module} contain 'def '?",
        "answer": answer,
    }
    return Plan(
        item=item,
        steps=steps,
        answer=f"The answer is {answer}.",
        agent_caused=hostile[0] if hostile else None,
        think_s=0.4,
    )


def batch(*, victim: bool = True) -> list[Plan]:
    return [plan(i, victim=victim and i == 0) for i in range(B)]


async def ledger_shows(faults: FaultStack, trace_id: str, call_id: str) -> None:
    """Wait until the call's command is running in the sandbox (its ledger line is there)."""

    def seen() -> bool:
        return call_id in (faults.read_ledger(trace_id) or [])

    assert await asyncio.to_thread(faults.wait_until, seen, timeout_s=30), (
        f"call {call_id} of {trace_id} never started"
    )


Inject = Callable[[Trainer], Awaitable[set[str]]]
"""Breaks something during the batch; returns the trace ids of its intended victims."""


def run_batch(
    faults: FaultStack, plans: Sequence[Plan], inject: Inject | None = None
) -> tuple[list[Result], set[str]]:
    trainer = Trainer(faults.stack.base_url, faults.token, faults.read_ledger)

    async def main() -> tuple[list[Result], set[str]]:
        if inject is None:
            return await trainer.run(plans), set()
        results, victims = await asyncio.gather(trainer.run(plans), inject(trainer))
        return results, victims

    return asyncio.run(main())


def finish(
    faults: FaultStack,
    fault: str,
    results: list[Result],
    victims: set[str],
    started: float,
    notes: Sequence[str] = (),
    *,
    clean: bool = False,
) -> Row:
    """Let the reaper run, read the records and record the row (:func:`check` checks
    it)."""
    faults.wait_healthy()
    leaked, leaked_volumes = faults.wait_reaped(REAP_TIMEOUT_S)
    records = faults.records([r.trace_id for r in results])
    for result in results:
        result.record = records[result.trace_id]
        lost, twice, _, _ = ledger_check(result)
        if lost or twice:
            result.log_lines = faults.log_lines(result.trace_id)
    row = make_row(
        fault,
        results,
        victims=victims,
        leaked=leaked,
        leaked_volumes=leaked_volumes,
        seconds=time.monotonic() - started,
        notes=[*notes, *_unexpected(results)],
        clean=clean,
    )
    write_row(row)
    # What one fault left must not count against the next batch.
    faults.clean()
    return row


def check(row: Row, results: list[Result]) -> None:
    assert not row.problems(), f"{row.fault}: {row.problems()}\n{_dump(results)}"
    assert not any(r.rejected for r in results), _dump(results)


def _unexpected(results: list[Result]) -> list[str]:
    """Tool outputs of unharmed calls that are not what the real codebase gives."""
    wrong = []
    for result in results:
        for call in result.calls:
            command = str(call.step.arguments.get("command", ""))
            if call.ok and command.startswith("grep -c") and result.plan.agent_caused is None:
                expected = str(result.plan.item["answer"])
                if call.output is None or call.output.strip().splitlines()[-1] != expected:
                    wrong.append(f"{result.trace_id}: grep printed {call.output!r}")
    return wrong


def _dump(results: list[Result]) -> str:
    lines = []
    for r in results:
        record = r.record or {}
        lines.append(
            f"{r.trace_id} agent_caused={r.plan.agent_caused} score={r.score} "
            f"discarded={r.discarded} state={record.get('state')} "
            f"stored_score={record.get('score')} failure={record.get('infra_failure')}"
        )
        for c in r.calls:
            attempts = ", ".join(f"{a.status}{'/' + a.code if a.code else ''}" for a in c.attempts)
            lines.append(f"    {c.call_id} {c.step.tool} [{attempts}] {str(c.output)[:100]!r}")
        if r.grade_attempts:
            lines.append(f"    grade [{', '.join(str(a.status) for a in r.grade_attempts)}]")
        lines.append(f"    ledger {r.ledger}")
        lines.extend(f"    | {line}" for line in r.log_lines)
    return "\n".join(lines)


def by_id(results: list[Result]) -> dict[str, Result]:
    return {r.trace_id: r for r in results}


# -- the faults ------------------------------------------------------------------------------


def test_worker_killed_mid_call(faults: FaultStack) -> None:
    """kill -9 of the worker while a call runs; once its heartbeat has lapsed, a new worker.
    The running call's rollout is infra_failed; calls sent while no worker lived are 503s
    that fail nothing, and their retries run them exactly once."""
    started = time.monotonic()

    async def inject(trainer: Trainer) -> set[str]:
        victim, call_id = await trainer.wait_marker(VICTIM)
        await ledger_shows(faults, victim.trace_id, call_id)
        await asyncio.to_thread(faults.kill_worker)
        assert await asyncio.to_thread(faults.wait_until, faults.heartbeat_gone, timeout_s=15)
        await asyncio.to_thread(faults.start_worker)
        return {victim.trace_id}

    results, victims = run_batch(faults, batch(), inject)
    check(finish(faults, "kill -9 worker mid-call", results, victims, started), results)
    assert all(flagged(by_id(results)[v]) for v in victims), _dump(results)


def test_sandbox_killed_mid_rollout(faults: FaultStack) -> None:
    """docker kill of one rollout's sandbox while its call runs: that rollout is
    infra_failed, never scored; the others are untouched."""
    started = time.monotonic()

    async def inject(trainer: Trainer) -> set[str]:
        victim, call_id = await trainer.wait_marker(VICTIM)
        await ledger_shows(faults, victim.trace_id, call_id)
        container = faults.sandbox_of(victim.trace_id)
        assert container is not None
        await asyncio.to_thread(faults.docker.api.kill, container["Id"])
        return {victim.trace_id}

    results, victims = run_batch(faults, batch(), inject)
    check(finish(faults, "docker kill sandbox", results, victims, started), results)
    assert all(flagged(by_id(results)[v]) for v in victims), _dump(results)


def test_sandbox_paused_mid_call(faults: FaultStack) -> None:
    """docker pause of one rollout's sandbox while its call runs (a hang): the call fails
    within the command timeout and a margin instead of hanging, and the rollout is
    infra_failed."""
    started = time.monotonic()
    # The worker gives the exec agent the command's timeout plus its reply slack (10 s);
    # a hang must end then, not at the call's outer bound or never.
    margin_s = 15

    async def inject(trainer: Trainer) -> set[str]:
        victim, call_id = await trainer.wait_marker(VICTIM)
        await ledger_shows(faults, victim.trace_id, call_id)
        container = faults.sandbox_of(victim.trace_id)
        assert container is not None
        await asyncio.to_thread(faults.docker.api.pause, container["Id"])
        return {victim.trace_id}

    results, victims = run_batch(faults, batch(), inject)
    (victim,) = (r for r in results if r.trace_id in victims)
    hung = next(c for c in victim.calls if c.step.marker == VICTIM)
    first = hung.attempts[0]
    notes = [f"the paused call answered {first.status} after {first.seconds:.1f} s"]
    check(finish(faults, "docker pause sandbox", results, victims, started, notes), results)
    assert first.status >= 500 and first.seconds <= COMMAND_TIMEOUT_S + margin_s, _dump(results)
    assert flagged(victim), _dump(results)


HOSTILE: list[tuple[str, Step]] = [
    ("disk full", shell("dd if=/dev/zero of=/workspace/fill bs=1M 2>&1 | tail -n 4")),
    (
        "memory",
        shell("python3 -c 'x = [bytearray(16 << 20) for _ in range(1 << 20)]'; echo exit=$?"),
    ),
    ("fork bomb", shell(":(){ :|:& };:", timeout_s=3)),
    ("kill -9 -1", shell("kill -9 -1; echo survived")),
    (
        "rm -rf /",
        shell("rm -rf / --no-preserve-root 2>&1 | tail -n 2; ls /workspace", resets_ledger=True),
    ),
]


def test_agent_breaks_its_own_sandbox(faults: FaultStack) -> None:
    """Agents that fill their disk, exhaust their memory, fork-bomb, kill everything they
    can and delete everything they can: all scored normally (their own doing, ordinary 200
    outputs), none flagged; one ordinary rollout beside them."""
    started = time.monotonic()
    plans = [plan(i, hostile=hostile) for i, hostile in enumerate(HOSTILE)]
    plans.append(plan(len(HOSTILE)))
    results, _ = run_batch(faults, plans)
    notes = []
    for result in results:
        for call in result.calls:
            if result.plan.agent_caused and any(call.step is h for _, h in HOSTILE):
                lines = (call.output or "").strip().splitlines() or [""]
                line = next((x for x in lines if "No space" in x), lines[-1])
                notes.append(f"{result.plan.agent_caused}: {line[:70]!r}")
    check(finish(faults, "agent-caused x5", results, set(), started, notes), results)
    assert all(r.score == r.plan.expected_score for r in results), _dump(results)
    disk = next(r for r in results if r.plan.agent_caused == "disk full")
    assert any("No space left on device" in (c.output or "") for c in disk.calls), _dump(results)


def test_grader_raises(faults: FaultStack) -> None:
    """A grader that raises: its grade is a 503 (retried, then the rollout discarded), never
    a 0, and no score is stored; rollouts of a working grader beside them are scored."""
    started = time.monotonic()
    plans = [plan(i, environment=BROKEN_GRADER_ENVIRONMENT) for i in range(B // 2)]
    plans += [plan(i) for i in range(B // 2, B)]
    results, _ = run_batch(faults, plans)
    broken = {p.trace_id for p in plans[: B // 2]}
    check(finish(faults, "grader raises", results, broken, started), results)
    for result in results:
        if result.trace_id in broken:
            # Four 503s (the first try and three retries), the grader's failure among them
            # (a Redis hiccup left by an earlier fault may answer one of them instead).
            assert [a.status for a in result.grade_attempts] == [503] * 4, _dump(results)
            assert "grader_failed" in {a.code for a in result.grade_attempts}, _dump(results)
            assert result.discarded and result.score is None, _dump(results)
            assert (result.record or {}).get("score") is None, _dump(results)


def test_dockerd_stopped_and_started(faults: FaultStack) -> None:
    """The daemon stops (its sandboxes with it) while the batch runs, then starts again: the
    rollouts it took down are infra_failed, never scored; a fresh batch then succeeds."""
    started = time.monotonic()

    async def inject(trainer: Trainer) -> set[str]:
        victim, call_id = await trainer.wait_marker(VICTIM)
        await ledger_shows(faults, victim.trace_id, call_id)
        await asyncio.to_thread(faults.daemon.stop)
        await asyncio.sleep(1)
        await asyncio.to_thread(faults.daemon.start)
        await asyncio.to_thread(faults.reconnect_docker)
        return {victim.trace_id}

    results, victims = run_batch(faults, batch(), inject)
    row = finish(faults, "dockerd stop+start", results, victims, started)

    started = time.monotonic()
    fresh, _ = run_batch(faults, batch(victim=False))
    fresh_row = finish(faults, "  then a fresh batch", fresh, set(), started, clean=True)
    check(row, results)
    assert all(flagged(by_id(results)[v]) for v in victims), _dump(results)
    check(fresh_row, fresh)
    assert fresh_row.unaffected_right == B, _dump(fresh)


def test_redis_restarted_mid_batch(faults: FaultStack) -> None:
    """Redis killed and started again (same port, same AOF) while calls are in flight: the
    API answers 503 meanwhile; retries get each call's result, no call runs twice, and no
    rollout is lost to it."""
    started = time.monotonic()

    async def inject(trainer: Trainer) -> set[str]:
        victim, call_id = await trainer.wait_marker(VICTIM)
        await ledger_shows(faults, victim.trace_id, call_id)
        await asyncio.to_thread(faults.redis.kill)
        await asyncio.sleep(1)
        await asyncio.to_thread(faults.redis.start)
        return set()  # nothing is harmed for good: Redis keeps everything (AOF)

    results, victims = run_batch(faults, batch(), inject)
    row = finish(faults, "redis restart", results, victims, started)

    # Redis has been back for a while: nothing may fail any more.
    started = time.monotonic()
    fresh, _ = run_batch(faults, batch(victim=False))
    fresh_row = finish(faults, "  then a fresh batch", fresh, set(), started, clean=True)
    check(row, results)
    assert row.flagged == 0 and row.unaffected_right + _recovered(results) == B, _dump(results)
    check(fresh_row, fresh)
    assert fresh_row.unaffected_right == B, _dump(fresh)


def test_redis_state_lost_mid_batch(faults: FaultStack) -> None:
    """Redis killed and started again empty (no replica, its files gone) while calls are in
    flight. Every rollout in flight is discarded, none scored: its record is gone, and the
    worker, finding Redis without the deployment's state mark, takes no new sandboxes until
    it has failed each rollout whose sandbox it still holds (a record of its own, cause
    ``state_lost``) and ended the sandbox; so the trainer's next call is a 503, never a
    fresh start on an empty sandbox. Nothing is left running; a fresh batch afterwards is
    untouched."""
    killed: dict[str, float] = {}
    started = time.monotonic()

    async def inject(trainer: Trainer) -> set[str]:
        victim, call_id = await trainer.wait_marker(VICTIM)
        await ledger_shows(faults, victim.trace_id, call_id)
        killed["at"] = time.monotonic()
        await asyncio.to_thread(faults.redis.wipe)
        await asyncio.to_thread(faults.redis.start)
        return set()  # known once the batch is over: every rollout not graded by then

    results, _ = run_batch(faults, batch(), inject)
    victims = {
        r.trace_id
        for r in results
        if not any(
            a.status == 200 and a.started + a.seconds < killed["at"] for a in r.grade_attempts
        )
    }
    row = finish(faults, "redis state lost (no replica)", results, victims, started)
    check(row, results)
    assert victims, _dump(results)
    for result in results:
        if result.trace_id in victims:
            assert result.score is None and result.discarded, _dump(results)
            cause = ((result.record or {}).get("infra_failure") or {}).get("cause")
            assert cause == "state_lost", _dump(results)

    started = time.monotonic()
    fresh, _ = run_batch(faults, batch(victim=False))
    fresh_row = finish(faults, "  then a fresh batch", fresh, set(), started, clean=True)
    check(fresh_row, fresh)
    assert fresh_row.unaffected_right == B, _dump(fresh)


def _recovered(results: list[Result]) -> int:
    return sum(1 for r in results if r.saw_5xx and r.score == r.plan.expected_score)
