"""The judge grader's parts without a judge: reading a verdict strictly, filling the input,
refusing a bad configuration at start-up naming the field, a service's failure passing
through ``multi`` as itself; and its verdict cache and deployment-wide slots on real Redis
(the server itself is in tests/e2e/test_judge.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from orchestrator.config import Settings
from orchestrator.grading import (
    GradeContext,
    Grader,
    GraderConfigError,
    GradeResult,
    GraderUnavailable,
    ItemError,
    get_grader,
    grade_context,
)
from orchestrator.grading.judge import ScoreModelGrader, parse_verdict, render, trajectory_excerpt
from orchestrator.outcomes import Outcome
from orchestrator.rollouts.grades import StoreServices
from orchestrator.state.models import TrajectoryStep
from orchestrator.state.records import RolloutStore
from tests.redis_units import own_deployment

INPUT = [{"role": "user", "content": "Row {{ item.question }}. Answer: {{ answer }}"}]
OPTIONS = {"model": "m", "base_url": "http://127.0.0.1:9/v1", "input": INPUT}


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ('{"score": 0.75, "reason": "close"}', 0.75),
        ('```json\n{"score": 1, "reason": "right"}\n```', 1.0),
        ("The answer is right.\nScore: 0.5", 0.5),
        ("**Score:** 0", 0.0),
        ("## score = 1.0", 1.0),
    ],
)
def test_a_verdict_is_read_from_json_or_one_score_line(reply: str, score: float) -> None:
    assert parse_verdict(reply, (0.0, 1.0)).score == score


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        ("", "no 'score: N' line"),
        ("I think it deserves a 0.8", "no 'score: N' line"),
        ("Score: 0.5\nActually, score: 0.9", "several scores"),
        ('{"score": "high"}', "no numeric 'score'"),
        ('{"score": true}', "no numeric 'score'"),
        ('{"score": 0.5', "does not close"),
        ('{"score": 1.5}', "outside the range"),
        ("Score: -1", "outside the range"),
        ("Score: 0.5 because it is half right", "no 'score: N' line"),
    ],
)
def test_a_reply_without_one_clear_verdict_is_refused_saying_why(reply: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_verdict(reply, (0.0, 1.0))


def test_a_judge_scale_is_its_own() -> None:
    assert parse_verdict("Score: 7", (0.0, 10.0)).score == 7.0


def _step(seq: int, output: str) -> TrajectoryStep:
    return TrajectoryStep(
        seq=seq,
        call_id=f"c{seq}",
        tool="shell",
        arguments={"command": f"echo {seq}"},
        outcome=Outcome.OK,
        exit_code=0,
        output=output,
        started_at=datetime.now(UTC),
        duration_ms=1.0,
    )


def test_the_input_shows_the_row_the_answer_and_the_trajectorys_tail() -> None:
    grader = get_grader(
        "score_model",
        {
            **OPTIONS,
            "input": [
                {
                    "role": "user",
                    "content": "{{item.question}}|{{ sample.output_text }}|{{ item }}"
                    "|{{trajectory}}",
                }
            ],
            "trajectory_steps": 2,
        },
    )
    context = GradeContext(
        answer="42",
        item={"question": "Why?", "n": 3},
        trajectory=[_step(i, f"out{i}") for i in range(1, 5)],
    )
    assert isinstance(grader, ScoreModelGrader)
    text = render(grader.options.input[0].content, context, grader.options)
    question, answer, item, trajectory = text.split("|")
    assert (question, answer, item) == ("Why?", "42", '{"question": "Why?", "n": 3}')
    assert "[3] shell" in trajectory and "out4" in trajectory and "out2" not in trajectory


def test_a_row_without_a_field_the_input_names_is_the_rows_fault() -> None:
    grader = get_grader("score_model", OPTIONS)
    with pytest.raises(ItemError) as raised:
        grade_context(grader, GradeContext(answer="42", item={}, trajectory=[]))
    assert raised.value.field == "question"


def test_the_trajectory_excerpt_keeps_its_end_within_its_bound() -> None:
    text = trajectory_excerpt([_step(1, "a" * 100), _step(2, "tail")], 10, 50)
    assert len(text) == 53 and text.startswith("...") and text.endswith("tail")
    assert trajectory_excerpt([], 10, 50) == "(no tool calls)"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"input": [{"role": "user", "content": "no answer here"}]}, "never shows the answer"),
        (
            {"input": [{"role": "user", "content": "{{ answer }} {{ sample.usage }}"}]},
            "input.0.content",
        ),
        ({"input": [{"role": "judge", "content": "{{ answer }}"}]}, "input.0.role"),
        ({"range": [1, 0]}, "range"),
        ({"request_timeout_s": 60, "timeout_s": 30}, "request_timeout_s"),
        ({"base_url": "not a url"}, "base_url"),
        ({"model": ""}, "model"),
        ({"max_concurent": 2}, "unknown option 'max_concurent'"),
        ({"api_key": "sk-in-the-config"}, "unknown option 'api_key'"),
    ],
)
def test_a_bad_judge_configuration_fails_at_start_naming_the_field(
    change: dict[str, Any], named: str
) -> None:
    with pytest.raises(GraderConfigError, match=named):
        get_grader("score_model", {**OPTIONS, **change})


def test_a_judge_unreachable_is_unavailable_with_every_attempt_as_evidence() -> None:
    # Port 9 (discard) refuses on loopback: no server at all.
    grader = get_grader(
        "score_model",
        {**OPTIONS, "max_attempts": 2, "backoff_s": 0.01, "timeout_s": 5, "request_timeout_s": 2},
    )
    with pytest.raises(GraderUnavailable) as raised:
        grade_context(grader, GradeContext(answer="42", item={"question": "q"}, trajectory=[]))
    assert raised.value.kind == "judge_unavailable"
    assert [a["attempt"] for a in raised.value.evidence["attempts"]] == [1, 2]


class _Down(Grader):
    name: ClassVar[str] = "down"

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        raise GraderUnavailable("judge_timeout", "too slow", {"attempts": [{"attempt": 1}]})


def test_a_services_failure_in_multi_is_that_failure_not_a_sub_grader_bug() -> None:
    grader = get_grader(
        "multi",
        {
            "graders": {"judge": {"name": f"{__name__}:_Down"}, "files": {"name": "file_f1"}},
            "formula": "judge + files",
        },
    )
    with pytest.raises(GraderUnavailable) as raised:
        grade_context(grader, GradeContext(answer="", item={"gold_files": ["a"]}, trajectory=[]))
    assert raised.value.kind == "judge_timeout" and raised.value.evidence


@pytest.fixture
def services(settings: Settings) -> Iterator[StoreServices]:
    """StoreServices on a deployment of the test's own, its loop in a thread of its own
    (as the API's, with the grader in a worker thread)."""
    with own_deployment(settings, "judge") as own:
        loop = asyncio.new_event_loop()
        runner = threading.Thread(target=loop.run_forever, daemon=True)
        runner.start()
        store = RolloutStore.connect(own)
        try:
            yield StoreServices(store, loop)
        finally:
            asyncio.run_coroutine_threadsafe(store.close(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            runner.join(5)
            loop.close()


def test_a_verdict_kept_is_recalled_and_the_first_kept_stands(services: StoreServices) -> None:
    assert services.recall("k") is None
    services.remember("k", {"score": 0.5}, 60)
    services.remember("k", {"score": 0.9}, 60)
    assert services.recall("k") == {"score": 0.5}


def test_slots_bound_holders_across_the_deployment_and_lapse_if_a_holder_dies(
    services: StoreServices,
) -> None:
    inside = 0
    most = 0
    lock = threading.Lock()

    def hold() -> None:
        nonlocal inside, most
        with services.slot("judge:x", 2, wait_s=10, hold_s=10) as held:
            assert held
            with lock:
                inside += 1
                most = max(most, inside)
            time.sleep(0.2)
            with lock:
                inside -= 1

    workers = [threading.Thread(target=hold) for _ in range(6)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert most == 2
    # A holder that never gives its slot back (its process died) holds it only hold_s.
    run = asyncio.run_coroutine_threadsafe
    assert run(services.store.take_grader_slot("judge:y", 1, "dead", 0.3), services.loop).result()
    with services.slot("judge:y", 1, wait_s=0.1, hold_s=5) as held:
        assert not held
    with services.slot("judge:y", 1, wait_s=5, hold_s=5) as held:
        assert held


class _Server:
    """A stand-in OpenAI-compatible server on loopback for what the real one in
    tests/e2e/test_judge.py cannot be made to do: refuse ``response_format``, answer 429
    with a Retry-After. It answers from ``script`` in order, and records each request."""

    def __init__(self, script: list[tuple[int, dict[str, str], dict[str, Any]]]) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.times: list[float] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests.append(body)
                outer.times.append(time.monotonic())
                status, headers, reply = outer.script.pop(0)
                data = json.dumps(reply).encode()
                self.send_response(status)
                for name, value in {**headers, "content-type": "application/json"}.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
        ],
    }


def test_a_server_refusing_structured_output_is_asked_again_without_it_from_then_on() -> None:
    refused = {"error": {"message": "response_format is not supported", "type": "invalid"}}
    server = _Server(
        [(400, {}, refused), (200, {}, _completion("Score: 1")), (200, {}, _completion("score: 0"))]
    )
    try:
        grader = get_grader("score_model", {**OPTIONS, "base_url": server.base_url})
        context = GradeContext(answer="42", item={"question": "q"}, trajectory=[])
        first = grade_context(grader, context)
        second = grade_context(grader, context)
    finally:
        server.close()
    assert (first.score, second.score) == (1.0, 0.0)
    assert [a.get("status") for a in first.details["attempts"]] == [400, None]
    assert ["response_format" in r for r in server.requests] == [True, False, False]


def test_a_429_is_asked_again_no_sooner_than_its_retry_after() -> None:
    busy = {"error": {"message": "slow down", "type": "rate_limit"}}
    server = _Server([(429, {"retry-after": "1"}, busy), (200, {}, _completion("Score: 0.5"))])
    try:
        grader = get_grader(
            "score_model", {**OPTIONS, "base_url": server.base_url, "backoff_s": 0.01}
        )
        result = grade_context(
            grader, GradeContext(answer="42", item={"question": "q"}, trajectory=[])
        )
    finally:
        server.close()
    assert result.score == 0.5
    assert server.times[1] - server.times[0] >= 1.0


def test_no_process_imports_the_judges_sdk_before_a_judge_is_asked() -> None:
    """The openai SDK takes 1-2 s to import here: every API, worker and reaper start paid it,
    and the suite restarts them often, until the judge imported it only when it asks."""
    probe = (
        "import sys, orchestrator.celery_main, orchestrator.api.app, orchestrator.grading; "
        "print('openai' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False", done.stderr
