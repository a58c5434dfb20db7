"""Agent RFT end to end: a scripted agent drives real rollouts on a real codebase through
``/agent-rft/tools`` and ``/agent-rft/grade`` (docs/agent-rft.md), against the real API, worker,
Redis and sandboxes of the session's ``stack``."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest

from orchestrator.state.broker import celery_app, task_message
from orchestrator.state.calls import TicketState
from orchestrator.state.keys import Keys
from orchestrator.state.records import RolloutStore
from orchestrator.state.wire import RunOp, TaskName
from orchestrator.tools.registry import get_tool
from tests.e2e.helpers import (
    REPLY_KEYS,
    assert_no_rollout,
    file_f1,
    function_call,
    new_call_id,
    new_trace,
    sandboxes_of,
)
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")


def call(
    client: httpx.Client,
    body: dict[str, Any],
    *,
    path: str = "/agent-rft/tools",
) -> str:
    """Post one function call; check the reply's exact shape and echoes; return the output."""
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert set(reply) == REPLY_KEYS, reply
    assert reply["type"] == "function_call_output"
    assert reply["call_id"] == body["call_id"]
    assert reply["id"] == body.get("id", "")
    assert isinstance(reply["output"], str)
    output: str = reply["output"]
    return output


def test_scripted_agent_completes_a_rollout(stack: Stack, planning_item: dict[str, Any]) -> None:
    """Explore with rg/grep/find/git and read_file, name the files, get the file_f1 score."""
    trace = new_trace()
    item = planning_item
    with stack.client() as client:
        # Dispatch on the body's name, arguments as a JSON string (the documented form).
        listed = call(
            client,
            function_call(trace, item, "shell", {"command": "rg -l 'def request' src"}),
        )
        candidates = sorted(line for line in listed.splitlines() if line.endswith(".py"))
        assert "src/requests/sessions.py" in candidates
        assert "src/requests/api.py" in candidates

        grep = call(
            client,
            function_call(trace, item, "shell", {"command": "grep -rn 'def send' src/requests"}),
        )
        assert "src/requests/adapters.py:" in grep
        assert "src/requests/sessions.py:" in grep

        # Arguments as an object, to the per-tool URL (the body's name is ignored there).
        found = call(
            client,
            function_call(
                trace,
                item,
                "ignored",
                {"command": "find src -name '*.py' | sort"},
                as_string=False,
            ),
            path="/agent-rft/tools/shell",
        )
        assert "src/requests/adapters.py" in found.splitlines()

        log = call(client, function_call(trace, item, "shell", {"command": "git log --oneline"}))
        commits = log.splitlines()
        assert commits
        assert all(re.match(r"^[0-9a-f]{7,} \S", line) for line in commits), log

        # read_file with a line range: numbered lines and a footer naming the range.
        lines = call(
            client,
            function_call(
                trace,
                item,
                "read_file",
                {"path": "src/requests/sessions.py", "start_line": 2, "end_line": 4},
            ),
        )
        body_lines = lines.splitlines()
        assert body_lines[0].lstrip().startswith("2\t")
        assert body_lines[2].lstrip().startswith("4\t")
        assert body_lines[-1].startswith("[showing lines 2-4 of ")

        same = call(
            client,
            function_call(
                trace,
                item,
                "read_file",
                {"path": "/workspace/src/requests/sessions.py", "start_line": 2, "end_line": 4},
                as_string=False,
            ),
            path="/agent-rft/tools/read_file",
        )
        assert same == lines

        answer = "Files to edit:\n" + "\n".join(
            f"- {path}" for path in ("src/requests/sessions.py", "src/requests/adapters.py")
        )
        graded = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": answer}, "item": item, "trace_id": trace},
        )
        assert graded.status_code == 200, graded.text
        score = graded.json()["score"]
        assert 0.0 <= score <= 1.0
        assert score == pytest.approx(file_f1(answer, item)) == 1.0

        rollout = client.get(f"/v1/rollouts/{trace}").json()
        # The default grace_after_grade_s (0): the grade closed the rollout.
        timings = rollout["timings"]
        assert rollout["state"] == "closed" and timings["closed_at"] >= timings["graded_at"]
        assert rollout["tool_calls"] == 6
        assert rollout["score"] == score


@pytest.mark.parametrize(
    ("sample", "answer"),
    [
        ({"output_text": "src/requests/sessions.py"}, "src/requests/sessions.py"),
        (
            {"output_json": {"files": ["src/requests/sessions.py", "src/requests/api.py"]}},
            json.dumps({"files": ["src/requests/sessions.py", "src/requests/api.py"]}),
        ),
        (
            {"choices": [{"message": {"content": "Edit `src/requests/adapters.py` and setup.py"}}]},
            "Edit `src/requests/adapters.py` and setup.py",
        ),
        (
            {"output_text": "", "output_json": ["src/requests/sessions.py"]},
            '["src/requests/sessions.py"]',
        ),
    ],
    ids=["output_text", "output_json", "choices", "blank_text_falls_through"],
)
def test_grade_reads_each_answer_shape(
    stack: Stack, planning_item: dict[str, Any], sample: dict[str, Any], answer: str
) -> None:
    trace = new_trace()
    with stack.client() as client:
        call(client, function_call(trace, planning_item, "shell", {"command": "ls src/requests"}))
        response = client.post(
            "/agent-rft/grade", json={"sample": sample, "item": planning_item, "trace_id": trace}
        )
        assert response.status_code == 200, response.text
        score = response.json()["score"]
        assert 0.0 <= score <= 1.0
        assert score == pytest.approx(file_f1(answer, planning_item))


def test_grade_is_idempotent(stack: Stack, planning_item: dict[str, Any]) -> None:
    trace = new_trace()
    with stack.client() as client:
        call(client, function_call(trace, planning_item, "shell", {"command": "true"}))
        first = client.post(
            "/agent-rft/grade",
            json={
                "sample": {"output_text": "src/requests/sessions.py"},
                "item": planning_item,
                "trace_id": trace,
            },
        )
        assert first.status_code == 200
        expected = file_f1("src/requests/sessions.py", planning_item)
        assert first.json()["score"] == pytest.approx(expected) == pytest.approx(2 / 3)
        for sample in (
            {"output_text": "src/requests/sessions.py"},
            {"output_text": "a totally different answer: src/requests/sessions.py adapters.py"},
            {},
        ):
            retry = client.post(
                "/agent-rft/grade",
                json={"sample": sample, "item": planning_item, "trace_id": trace},
            )
            assert retry.status_code == 200
            assert retry.json() == first.json()


def test_concurrent_grade_retries_agree(stack: Stack, planning_item: dict[str, Any]) -> None:
    """A grade retried while the original is still in flight gets the original's score."""
    answers = ["src/requests/sessions.py", "nothing.py"] * 6

    async def grade_all(trace: str) -> list[httpx.Response]:
        async with stack.async_client(limits=httpx.Limits(max_connections=20)) as aclient:
            return await asyncio.gather(
                *[
                    aclient.post(
                        "/agent-rft/grade",
                        json={
                            "sample": {"output_text": answer},
                            "item": planning_item,
                            "trace_id": trace,
                        },
                    )
                    for answer in answers
                ]
            )

    for _ in range(2):
        trace = new_trace()
        with stack.client() as client:
            call(client, function_call(trace, planning_item, "shell", {"command": "true"}))
        responses = asyncio.run(grade_all(trace))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        scores = {r.json()["score"] for r in responses}
        assert len(scores) == 1, scores


def test_grade_without_any_tool_call(stack: Stack, planning_item: dict[str, Any]) -> None:
    """A rollout may end without a tool call: it is scored, and no sandbox is made."""
    trace = new_trace()
    answer = "src/requests/sessions.py, src/requests/adapters.py, src/requests/models.py"
    with stack.client() as client:
        response = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": answer}, "item": planning_item, "trace_id": trace},
        )
        assert response.status_code == 200, response.text
        assert response.json()["score"] == pytest.approx(file_f1(answer, planning_item))
        assert response.json()["details"]["tool_calls"] == 0
        assert sandboxes_of(stack.settings, trace) == []
        rollout = client.get(f"/v1/rollouts/{trace}").json()
        assert rollout["sandbox_id"] is None
        assert rollout["tool_calls"] == 0
        assert client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"] == []


def test_parallel_tool_calls_of_one_rollout(stack: Stack, planning_item: dict[str, Any]) -> None:
    """Eight calls at once, mid-rollout, all succeed in the rollout's one sandbox. (Parallel
    FIRST calls are test_concurrent_first_calls_*.)"""
    trace = new_trace()
    with stack.client() as client:
        call(client, function_call(trace, planning_item, "shell", {"command": "true"}))
    bodies = [
        function_call(trace, planning_item, "shell", {"command": f"echo call-{i}; hostname"})
        for i in range(8)
    ]

    async def run() -> list[httpx.Response]:
        async with stack.async_client() as aclient:
            return await asyncio.gather(*[aclient.post("/agent-rft/tools", json=b) for b in bodies])

    responses = asyncio.run(run())
    hosts = set()
    for i, (body, response) in enumerate(zip(bodies, responses, strict=True)):
        assert response.status_code == 200, response.text
        reply = response.json()
        assert reply["call_id"] == body["call_id"]
        assert reply["id"] == body["id"]
        first, host = reply["output"].splitlines()
        assert first == f"call-{i}"
        hosts.add(host)
    assert len(hosts) == 1
    assert len(sandboxes_of(stack.settings, trace)) == 1
    with stack.client() as client:
        steps = client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"]
        assert sorted(s["seq"] for s in steps) == list(range(1, 10))
        assert {s["call_id"] for s in steps[1:]} == {b["call_id"] for b in bodies}
        client.delete(f"/v1/rollouts/{trace}")


async def _first_calls(stack: Stack, item: dict[str, Any], n: int) -> tuple[str, list[Any]]:
    trace = new_trace()
    bodies = [function_call(trace, item, "shell", {"command": "hostname"}) for _ in range(n)]
    async with stack.async_client(limits=httpx.Limits(max_connections=n)) as aclient:
        responses = await asyncio.gather(
            *[aclient.post("/agent-rft/tools", json=b) for b in bodies]
        )
    return trace, list(responses)


def test_concurrent_first_calls_create_one_sandbox(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    trace, responses = asyncio.run(_first_calls(stack, planning_item, 20))
    answered = [r for r in responses if r.status_code == 200]
    assert answered, [r.text for r in responses]
    # Whatever else happens, one trace never gets two sandboxes.
    sandboxes = sandboxes_of(stack.settings, trace)
    assert len(sandboxes) == 1
    with stack.client() as client:
        rollout = client.get(f"/v1/rollouts/{trace}").json()
        assert rollout["sandbox_id"] == sandboxes[0]
        # Every call that ran saw the same machine (its hostname), the rollout's sandbox.
        assert len({r.json()["output"] for r in answered}) == 1
        steps = client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"]
        assert len(steps) == len(answered)
        client.delete(f"/v1/rollouts/{trace}")


def test_concurrent_first_calls_all_succeed(stack: Stack, planning_item: dict[str, Any]) -> None:
    for _ in range(3):
        trace, responses = asyncio.run(_first_calls(stack, planning_item, 20))
        with stack.client() as client:
            client.delete(f"/v1/rollouts/{trace}")
        assert [r.status_code for r in responses] == [200] * 20, [
            r.text for r in responses if r.status_code != 200
        ][:1]


def test_retried_call_returns_stored_output_without_rerunning(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    trace = new_trace()
    count = {"command": "echo x >> /tmp/count; wc -l < /tmp/count"}
    with stack.client() as client:
        original = function_call(trace, planning_item, "shell", count)
        assert call(client, original).strip() == "1"
        # Same call_id (a retry, even with a new response id): the stored output.
        retry = {**original, "id": "fc_retry"}
        assert call(client, retry).strip() == "1"
        # A concurrent burst of retries of a new call: it still runs once.
        burst = function_call(trace, planning_item, "shell", count)

        async def retries() -> list[httpx.Response]:
            async with stack.async_client() as aclient:
                return await asyncio.gather(
                    *[aclient.post("/agent-rft/tools", json=burst) for _ in range(5)]
                )

        outputs = {r.json()["output"].strip() for r in asyncio.run(retries())}
        assert outputs == {"2"}
        later = call(
            client, function_call(trace, planning_item, "shell", {"command": "wc -l < /tmp/count"})
        )
        assert later.strip() == "2"
        steps = client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"]
        assert [s["call_id"] for s in steps] == [
            original["call_id"],
            burst["call_id"],
            steps[2]["call_id"],
        ]
        client.delete(f"/v1/rollouts/{trace}")


def test_a_message_delivered_twice_runs_once(stack: Stack, planning_item: dict[str, Any]) -> None:
    """A broker that delivers a call's task message twice (kombu promises no exactly-once)
    still runs the call once: the second delivery, pushed to the real worker while the first
    runs, finds the call claimed by another delivery and is skipped (state/calls.py)."""
    trace = new_trace()
    runs = {"command": "echo x >> /tmp/runs; sleep 4; wc -l < /tmp/runs"}
    slow = function_call(trace, planning_item, "shell", runs)
    settings = stack.settings
    keys = Keys.of(settings.deployment)

    async def deliver_again() -> None:
        store = RolloutStore.connect(settings, role="test")
        try:
            deadline = time.monotonic() + 30
            ticket = await store.calls.read(trace, slow["call_id"])
            while ticket.state != TicketState.RUNNING:
                assert time.monotonic() < deadline, f"the call never ran: {ticket}"
                await asyncio.sleep(0.02)
                ticket = await store.calls.read(trace, slow["call_id"])
            rollout = await store.get(trace)
            assert rollout is not None and rollout.sandbox is not None
            shell = get_tool("shell")
            args = shell.parse(runs, settings)
            again = RunOp(
                rollout_id=trace,
                call_id=slow["call_id"],
                ticket=keys.ticket(trace, slow["call_id"]),
                attempt=ticket.attempt,
                handle=rollout.sandbox,
                op=shell.operation(args, settings),
                enqueued_at=time.time(),
            )
            queue = keys.host_queue(rollout.sandbox.host)
            message = task_message(
                celery_app(), TaskName.RUN_OP, again.model_dump_json(),
                queue=queue, expires_s=60,
            )  # fmt: skip
            await store.redis.lpush(queue, message)
            while message in await store.redis.lrange(queue, 0, -1):
                assert time.monotonic() < deadline, "the worker never took the second delivery"
                await asyncio.sleep(0.02)
            taken = await store.calls.read(trace, slow["call_id"])
            # Taken while the first delivery still ran: the case a claim must tell apart.
            assert taken.state == TicketState.RUNNING, taken
        finally:
            await store.close()

    async def both() -> str:
        async with stack.async_client() as aclient:
            first, _ = await asyncio.gather(
                aclient.post("/agent-rft/tools", json=slow), deliver_again()
            )
        assert first.status_code == 200, first.text
        output: str = first.json()["output"]
        return output

    with stack.client() as client:
        try:
            call(client, function_call(trace, planning_item, "shell", {"command": "true"}))
            assert asyncio.run(both()).strip() == "1"
            check = function_call(trace, planning_item, "shell", {"command": "wc -l < /tmp/runs"})
            assert call(client, check).strip() == "1", "the call ran twice"
        finally:
            client.delete(f"/v1/rollouts/{trace}")


def test_rollout_and_trajectory_visible(stack: Stack, planning_item: dict[str, Any]) -> None:
    trace = new_trace()
    with stack.client() as client:
        first = function_call(
            trace, planning_item, "shell", {"command": "ls src/requests | head -3"}
        )
        out1 = call(client, first)
        second = function_call(
            trace, planning_item, "shell", {"command": "exit 3"}, as_string=False
        )
        out2 = call(client, second)
        third = function_call(trace, planning_item, "read_file", {"path": "README.md"})
        out3 = call(client, third)

        rollout = client.get(f"/v1/rollouts/{trace}")
        assert rollout.status_code == 200
        view = rollout.json()
        assert view["rollout_id"] == trace
        assert view["source"] == "agent_rft"
        assert view["state"] == "active"
        assert view["environment"] == "codebase-planning"
        assert view["codebase"] == stack.codebase
        assert view["tool_calls"] == 3
        assert view["sandbox_id"] == sandboxes_of(stack.settings, trace)[0]
        assert view["timings"]["sandbox_ready_ms"] > 0

        steps = client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"]
        assert [s["seq"] for s in steps] == [1, 2, 3]
        assert [s["tool"] for s in steps] == ["shell", "shell", "read_file"]
        assert [s["call_id"] for s in steps] == [b["call_id"] for b in (first, second, third)]
        # Arguments as sent: a JSON string stays a string, an object an object.
        assert steps[0]["arguments"] == first["arguments"]
        assert isinstance(steps[0]["arguments"], str)
        assert steps[1]["arguments"] == {"command": "exit 3"}
        assert [s["output"] for s in steps] == [out1, out2, out3]
        assert [s["outcome"] for s in steps] == ["ok", "ok", "ok"]
        assert [s["exit_code"] for s in steps] == [0, 3, None]
        assert out2.endswith("[exit code 3]")
        for step in steps:
            assert step["duration_ms"] > 0
            assert step["queue_ms"] is not None and step["exec_ms"] is not None
            assert step["started_at"]
        client.delete(f"/v1/rollouts/{trace}")


def test_agent_mistakes_are_200_with_an_explanation(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    trace = new_trace()
    with stack.client() as client:
        assert "[exit code 2]" in call(
            client, function_call(trace, planning_item, "shell", {"command": "ls /nonexistent"})
        )
        unknown = call(client, function_call(trace, planning_item, "browse", {"url": "x"}))
        assert "unknown tool 'browse'" in unknown
        assert "read_file" in unknown and "shell" in unknown
        bad_json = call(
            client,
            {**function_call(trace, planning_item, "shell", {}), "arguments": '{"command": "ls"'},
        )
        assert "not valid JSON" in bad_json
        wrong_type = call(client, function_call(trace, planning_item, "shell", {"command": 5}))
        assert "command" in wrong_type and "string" in wrong_type
        extra = call(client, function_call(trace, planning_item, "shell", {"cmd": "ls"}))
        assert "unknown argument" in extra
        missing = call(
            client, function_call(trace, planning_item, "read_file", {"path": "src/nope.py"})
        )
        assert "no such file" in missing
        directory = call(
            client, function_call(trace, planning_item, "read_file", {"path": "src/requests"})
        )
        assert "directory" in directory
        outside = call(
            client, function_call(trace, planning_item, "read_file", {"path": "/etc/passwd"})
        )
        assert "outside /workspace" in outside
        past_end = call(
            client,
            function_call(
                trace, planning_item, "read_file", {"path": "README.md", "start_line": 999}
            ),
        )
        assert "999" in past_end
        steps = client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"]
        # Argument errors never reach the sandbox and are not recorded; the rest are.
        assert [(s["tool"], s["outcome"], s["error_kind"]) for s in steps] == [
            ("shell", "ok", None),
            ("read_file", "agent_error", "not_found"),
            ("read_file", "agent_error", "is_directory"),
            ("read_file", "agent_error", "out_of_range"),
        ]
        client.delete(f"/v1/rollouts/{trace}")


def test_unknown_first_call_creates_nothing(stack: Stack, planning_item: dict[str, Any]) -> None:
    """An agent mistake on a trace's first call answers 200 and starts no rollout."""
    trace = new_trace()
    with stack.client() as client:
        out = call(client, function_call(trace, planning_item, "no_such_tool", {}))
        assert "unknown tool" in out
        out = call(client, function_call(trace, planning_item, "read_file", {"path": 7}))
        assert "path" in out
        assert_no_rollout(client, stack.settings, trace)


def test_call_ids_are_per_rollout(stack: Stack, planning_item: dict[str, Any]) -> None:
    """The idempotency key is (trace_id, call_id): one call_id in two traces runs twice."""
    shared = new_call_id()
    traces = [new_trace(), new_trace()]
    with stack.client() as client:
        outputs = [
            call(
                client,
                function_call(t, planning_item, "shell", {"command": f"echo {t}"}, call_id=shared),
            )
            for t in traces
        ]
        assert outputs == traces
        for t in traces:
            client.delete(f"/v1/rollouts/{t}")
