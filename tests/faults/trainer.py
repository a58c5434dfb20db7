"""A trainer emulator: Agent RFT's side of the wire, as docs/agent-rft.md describes it.

It runs a batch of rollouts at once. Each rollout is a scripted agent: a few tool calls
(``shell``, ``read_file``) with a little think time between them, then a grade call with
the right answer. Like the real trainer it retries a 5xx (or a dropped connection) at most
three times with the SAME ``call_id`` and then discards the whole rollout; a grade is
retried likewise. A 4xx is shown to the model and the rollout goes on.

Every ``shell`` command first appends its ``call_id`` to ``/workspace/.ledger`` in the
rollout's sandbox, so afterwards the ledger says how many times each call really ran.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

BACKOFF_S = (0.5, 1.0, 2.0)
"""Waits before the 1st, 2nd and 3rd retry; after the 3rd failed retry: discard."""

LEDGER = "/workspace/.ledger"
LEDGER_FAILED = "[ledger write failed]"


@dataclass(frozen=True)
class Step:
    """One tool call of a scripted agent."""

    tool: str
    arguments: dict[str, Any]
    ledger: bool = False
    """A shell step: its command appends its call_id to the ledger first."""
    resets_ledger: bool = False
    """The command deletes the ledger (``rm -rf /``): only later calls can be checked."""
    marker: str | None = None
    """A fault waits for the call of this step: :meth:`Trainer.wait_marker`."""


def shell(
    command: str,
    *,
    timeout_s: float | None = None,
    resets_ledger: bool = False,
    marker: str | None = None,
) -> Step:
    arguments: dict[str, Any] = {"command": command}
    if timeout_s is not None:
        arguments["timeout_s"] = timeout_s
    return Step("shell", arguments, ledger=True, resets_ledger=resets_ledger, marker=marker)


def read_file(path: str) -> Step:
    return Step("read_file", {"path": path})


@dataclass
class Attempt:
    status: int
    """HTTP status; 0 when the connection failed."""
    code: str
    """The error body's code (``infra_error``, ``state_store_unavailable``, ...), or ''."""
    started: float
    seconds: float


@dataclass
class Call:
    call_id: str
    step: Step
    attempts: list[Attempt] = field(default_factory=list)
    output: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].status == 200

    @property
    def ledger_write_failed(self) -> bool:
        return self.output is not None and self.output.startswith(LEDGER_FAILED)


@dataclass
class Plan:
    """One rollout: its dataset row, its calls, its final answer and what that scores."""

    item: dict[str, Any]
    steps: Sequence[Step]
    answer: str
    expected_score: float = 1.0
    agent_caused: str | None = None
    """What the agent does to its own sandbox (``disk``, ``fork-bomb``, ...), if anything."""
    think_s: float = 0.3
    trace_id: str = field(default_factory=lambda: f"trace_{uuid.uuid4().hex}")


@dataclass
class Result:
    plan: Plan
    calls: list[Call] = field(default_factory=list)
    grade_attempts: list[Attempt] = field(default_factory=list)
    score: float | None = None
    discarded: str | None = None
    """Why the trainer gave up on the rollout (5xx after 3 retries), or None."""
    ledger: list[str] | None = None
    """The sandbox's ledger when the trainer was done with it; None if unreadable."""
    record: dict[str, Any] | None = None
    """The rollout's record (GET /v1/rollouts/{id}) at the end of the batch."""
    log_lines: list[str] = field(default_factory=list)
    """The stack's log lines about this rollout, when its ledger shows a call lost or run
    twice: the evidence to find out why."""

    @property
    def trace_id(self) -> str:
        return self.plan.trace_id

    @property
    def saw_5xx(self) -> bool:
        attempts = [a for c in self.calls for a in c.attempts] + self.grade_attempts
        return any(a.status == 0 or a.status >= 500 for a in attempts)

    @property
    def rejected(self) -> list[Attempt]:
        """Answers 4xx: none are expected from this well-formed agent."""
        attempts = [a for c in self.calls for a in c.attempts] + self.grade_attempts
        return [a for a in attempts if 400 <= a.status < 500]


LedgerReader = Callable[[str], list[str] | None]


class Trainer:
    """Runs batches of :class:`Plan` against one orchestrator."""

    def __init__(self, base_url: str, token: str, read_ledger: LedgerReader) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {token}"}
        self.read_ledger = read_ledger
        self._markers: dict[str, asyncio.Future[tuple[Plan, str]]] = {}

    def _marker(self, name: str) -> asyncio.Future[tuple[Plan, str]]:
        if name not in self._markers:
            self._markers[name] = asyncio.get_running_loop().create_future()
        return self._markers[name]

    async def wait_marker(self, name: str) -> tuple[Plan, str]:
        """The rollout and call id of the first call of a step marked ``name``, once it
        has been sent."""
        return await self._marker(name)

    async def run(self, plans: Sequence[Plan]) -> list[Result]:
        async with httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=90
        ) as http:
            return list(await asyncio.gather(*(self._rollout(http, plan) for plan in plans)))

    async def _rollout(self, http: httpx.AsyncClient, plan: Plan) -> Result:
        result = Result(plan)
        for step in plan.steps:
            call_id = f"call_{uuid.uuid4().hex[:16]}"
            arguments = dict(step.arguments)
            if step.ledger:
                arguments["command"] = (
                    f"{{ echo {call_id} >> {LEDGER}; }} 2>/dev/null || echo '{LEDGER_FAILED}'; "
                    + arguments["command"]
                )
            body = {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex[:12]}",
                "call_id": call_id,
                "name": step.tool,
                "arguments": json.dumps(arguments),
                "trace_id": plan.trace_id,
                "item": plan.item,
            }
            call = Call(call_id, step)
            result.calls.append(call)
            if step.marker is not None and not self._marker(step.marker).done():
                self._marker(step.marker).set_result((plan, call_id))
            response = await _post(http, "/agent-rft/tools", body, call.attempts)
            if response is None:
                result.discarded = f"tool call {call_id}: {_describe(call.attempts)}"
                break
            if response.status_code == 200:
                call.output = str(response.json().get("output"))
            await asyncio.sleep(plan.think_s)
        result.ledger = await asyncio.to_thread(self.read_ledger, plan.trace_id)
        if result.discarded is not None:
            return result
        grade = {
            "sample": {"output_text": plan.answer},
            "item": plan.item,
            "trace_id": plan.trace_id,
        }
        response = await _post(http, "/agent-rft/grade", grade, result.grade_attempts)
        if response is None:
            result.discarded = f"grade: {_describe(result.grade_attempts)}"
        elif response.status_code == 200:
            result.score = float(response.json()["score"])
        return result


async def _post(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], attempts: list[Attempt]
) -> httpx.Response | None:
    """POST with the trainer's retries; None when it gives up (the rollout is discarded)."""
    for backoff in (*BACKOFF_S, None):
        started = time.monotonic()
        try:
            response = await http.post(path, json=body)
        except httpx.TransportError:
            attempts.append(Attempt(0, "transport_error", started, time.monotonic() - started))
        else:
            attempts.append(
                Attempt(
                    response.status_code,
                    _code(response),
                    started,
                    time.monotonic() - started,
                )
            )
            if response.status_code < 500:
                return response
        if backoff is None:
            return None
        await asyncio.sleep(backoff)
    raise AssertionError("unreachable")


def _code(response: httpx.Response) -> str:
    if response.status_code == 200:
        return ""
    try:
        error = response.json().get("error") or {}
        return str(error.get("code", ""))
    except ValueError:
        return "not_json"


def _describe(attempts: list[Attempt]) -> str:
    return ", ".join(f"{a.status} {a.code}".strip() for a in attempts)
