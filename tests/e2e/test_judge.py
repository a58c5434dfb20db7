"""A model as judge (grader ``score_model``) on a real stack, against a real OpenAI-compatible
server: ``transformers serve`` running tiny steered models on the CPU (tests/judge_server.py,
tests/judge_models.py), reached through the real ``openai`` SDK. The judge's number is the
score; the judge down, too slow, answering 500 or answering nothing readable is a 503 with
evidence and never a score, and the rollout stays gradable once the judge is back; racing
grades of one rollout ask the judge once; the key is never written anywhere."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from orchestrator.config import Settings
from orchestrator.environments.loader import parse_environments
from orchestrator.grading import get_grader, grade_sample
from tests.e2e.conftest import JUDGE_KEY, JUDGED, JUDGED_LATE, JUDGED_MODELS, JudgeHome
from tests.e2e.helpers import error_code, function_call, new_trace, orchestrator, wait_for
from tests.judge_models import VERDICTS
from tests.judge_server import JudgeServer
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("judge")  # the side stack and its judge: not held to e2e

REPO = Path(__file__).resolve().parents[2]

GOLD = ["src/requests/sessions.py"]
ANSWER = json.dumps(GOLD)


def _item(side: Stack, environment: str) -> dict[str, Any]:
    return {
        "environment": environment,
        "codebase": side.codebase,
        "request": "Make Session.request honour a default timeout.",
        "gold_files": GOLD,
    }


def _grade(client: httpx.Client, trace: str, item: dict[str, Any]) -> httpx.Response:
    return client.post(
        "/agent-rft/grade",
        json={"sample": {"output_text": ANSWER}, "item": item, "trace_id": trace},
        timeout=60,
    )


def _call(client: httpx.Client, trace: str, item: dict[str, Any], command: str) -> None:
    reply = client.post(
        "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": command})
    )
    assert reply.status_code == 200, reply.text


def _metric(client: httpx.Client, name: str, **labels: str) -> float:
    """The API's value of ``name`` with exactly ``labels`` (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{") and "}" in line:
            found = line[len(name) + 1 : line.index("}")]
            if ",".join(sorted(found.split(","))) == wanted:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _close(client: httpx.Client, trace: str) -> None:
    client.delete(f"/v1/rollouts/{trace}")


def test_the_judge_scores_the_answer_and_the_grade_keeps_its_verdict(
    side: Stack, judge: JudgeServer
) -> None:
    item, trace = _item(side, JUDGED), new_trace()
    with side.client() as client:
        ok_before = _metric(
            client, "orchestrator_judge_verdicts_total", environment=JUDGED, outcome="ok"
        )
        try:
            _call(client, trace, item, "ls src/requests | head -3")
            graded = _grade(client, trace, item)
            assert graded.status_code == 200, graded.text
            body = graded.json()
            assert body["score"] == 0.75
            details = body["details"]
            assert details["reason"] == "It names the file to change and misses one."
            assert details["model"] == judge.model("fair") and details["cached"] is False
            assert len(details["attempts"]) == 1 and details["usage"]["completion_tokens"] > 0
            # A retried grade gets the stored score, the judge not asked again.
            again = _grade(client, trace, item)
            assert again.status_code == 200 and again.json() == body
            assert (
                _metric(
                    client, "orchestrator_judge_verdicts_total", environment=JUDGED, outcome="ok"
                )
                == ok_before + 1
            )
            assert (
                _metric(client, "orchestrator_judge_latency_seconds_count", environment=JUDGED) >= 1
            )
        finally:
            _close(client, trace)
    shown = orchestrator(side, "rollouts", "show", trace, "--json")
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["summary"]["score"] == 0.75
    assert record["grade_inputs"]["grader"] == "score_model"
    assert record["grade_inputs"]["answer"] == ANSWER


def test_a_verdict_written_as_a_score_line_is_read_by_the_strict_pattern(
    side: Stack, judge: JudgeServer
) -> None:
    environment = next(e for e, model in JUDGED_MODELS.items() if model == "lined")
    item, trace = _item(side, environment), new_trace()
    with side.client() as client:
        graded = _grade(client, trace, item)
        _close(client, trace)
    assert graded.status_code == 200, graded.text
    assert graded.json()["score"] == 0.5
    assert graded.json()["details"]["reason"].startswith("The answer names the right file.")


@pytest.mark.parametrize(
    ("model", "why"),
    [("garbage", "no 'score: N' line"), ("overscored", "outside the range [0, 1]")],
)
def test_a_judge_answering_nothing_readable_is_a_503_never_a_score(
    side: Stack, judge: JudgeServer, model: str, why: str
) -> None:
    environment = next(e for e, m in JUDGED_MODELS.items() if m == model)
    item, trace = _item(side, environment), new_trace()
    with side.client() as client:
        before = _metric(
            client,
            "orchestrator_grader_errors_total",
            environment=environment,
            kind="judge_unparseable",
        )
        graded = _grade(client, trace, item)
        assert graded.status_code == 503, graded.text
        assert error_code(graded) == "judge_unparseable"
        error = graded.json()["error"]
        assert error["type"] == "infra_error"
        attempts = error["evidence"]["attempts"]
        assert len(attempts) == 3 and all(why in a["error"] for a in attempts), attempts
        assert all(a["reply"] for a in attempts)
        # Nothing was scored or kept: the rollout had no record, and has none.
        assert client.get(f"/v1/rollouts/{trace}").status_code == 404
        after = _metric(
            client,
            "orchestrator_grader_errors_total",
            environment=environment,
            kind="judge_unparseable",
        )
        assert after == before + 1


def test_a_judge_too_slow_is_a_503_within_its_bound_and_the_retry_scores(
    side: Stack, judge: JudgeServer
) -> None:
    item, trace = _item(side, JUDGED), new_trace()
    with side.client() as client:
        try:
            _call(client, trace, item, "true")
            judge.pause()
            try:
                started = time.monotonic()
                graded = _grade(client, trace, item)
                took = time.monotonic() - started
            finally:
                judge.resume()
            assert graded.status_code == 503, graded.text
            assert error_code(graded) == "judge_timeout"
            # The grader's own bound (timeout_s 6), not the trainer's patience.
            assert took < 15, took
            attempts = graded.json()["error"]["evidence"]["attempts"]
            assert attempts and all("no reply in" in a["error"] for a in attempts), attempts
            # Our failure, not the agent's: the rollout is intact, and scored once the
            # judge answers again.
            assert client.get(f"/v1/rollouts/{trace}").json()["state"] == "active"
            retried = _grade(client, trace, item)
            assert retried.status_code == 200, retried.text
            assert retried.json()["score"] == 0.75
        finally:
            _close(client, trace)


def test_a_judge_down_then_answering_500_is_a_503_then_asked_again(
    side: Stack, judge: JudgeServer, judge_home: JudgeHome
) -> None:
    item, trace = _item(side, JUDGED), new_trace()
    late = Path(judge.model("late"))
    with side.client() as client:
        try:
            _call(client, trace, item, "true")
            judge.stop()
            # The late model is made only after the server's first 500 for it (below).
            shutil.rmtree(late, ignore_errors=True)
            try:
                down = _grade(client, trace, item)
            finally:
                judge.start()
            assert down.status_code == 503, down.text
            assert error_code(down) == "judge_unavailable"
            attempts = down.json()["error"]["evidence"]["attempts"]
            assert len(attempts) == 3 and all("Connect" in a["error"] for a in attempts), attempts
            assert client.get(f"/v1/rollouts/{trace}").json()["state"] == "active"
            back = _grade(client, trace, item)
            assert back.status_code == 200 and back.json()["score"] == 0.75, back.text
        finally:
            _close(client, trace)

        # A 500 is asked again after the backoff: here the model is missing on the server
        # at the first attempt and there by the second.
        late_item, late_trace = _item(side, JUDGED_LATE), new_trace()
        errors_before = judge.log_path.read_text(errors="replace").count('" 500')
        result: dict[str, httpx.Response] = {}
        grading = threading.Thread(
            target=lambda: result.update(graded=_grade(client, late_trace, late_item))
        )
        grading.start()
        try:
            wait_for(
                lambda: judge.log_path.read_text(errors="replace").count('" 500') > errors_before,
                timeout_s=30,
                what="the judge server's 500 for the missing model",
            )
            shutil.copytree(Path(judge.model("fair")), late)
        finally:
            grading.join(60)
        graded = result["graded"]
        _close(client, late_trace)
    assert graded.status_code == 200, graded.text
    attempts = graded.json()["details"]["attempts"]
    assert [a.get("status") for a in attempts] == [500, None], attempts
    assert graded.json()["score"] == 0.75


def test_racing_grades_of_one_rollout_ask_the_judge_once(side: Stack, judge: JudgeServer) -> None:
    item, trace = _item(side, JUDGED), new_trace()
    asked_before = judge.requests()
    replies: list[httpx.Response] = []
    lock = threading.Lock()

    def grade() -> None:
        with side.client() as client:
            reply = _grade(client, trace, item)
        with lock:
            replies.append(reply)

    racers = [threading.Thread(target=grade) for _ in range(4)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(60)
    with side.client() as client:
        _close(client, trace)
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    assert {r.json()["score"] for r in replies} == {0.75}
    wait_for(lambda: judge.requests() > asked_before, timeout_s=10, what="the judge's log line")
    assert judge.requests() == asked_before + 1


def _waiting_on(port: int) -> int:
    """Connections to ``port`` on loopback the kernel has taken (a paused server's too)."""
    table = Path("/proc/net/tcp").read_text().splitlines()[1:]
    # Columns: sl, local address (hex ip:port), remote address, state (01: established).
    return sum(
        1 for row in table if row.split()[1].endswith(f":{port:04X}") and row.split()[3] == "01"
    )


def test_grades_waiting_on_a_judge_hold_up_no_other_request(
    side: Stack, judge: JudgeServer
) -> None:
    """Graders run in threads of their own: ten grades waiting on a paused judge (for its
    timeout_s, 6 s) leave a rollout's start its threads, so another grade (file_f1, on a
    row it must resolve) is answered before any of them. In the loop's default pool (6
    threads here) it waited for the first of them to give up."""
    environment = next(e for e, m in JUDGED_MODELS.items() if m == "lined")
    ended: dict[str, tuple[float, int]] = {}
    lock = threading.Lock()

    def grade(trace: str, item: dict[str, Any]) -> None:
        with side.client() as client:
            reply = _grade(client, trace, item)
        with lock:
            ended[trace] = (time.monotonic(), reply.status_code)

    waiting = [new_trace() for _ in range(10)]
    judge.pause()
    try:
        graders = [
            threading.Thread(target=grade, args=(trace, _item(side, environment)))
            for trace in waiting
        ]
        for grader in graders:
            grader.start()
        wait_for(
            lambda: _waiting_on(judge.port) >= 6,
            timeout_s=30,
            what="the grades' requests reaching the paused judge",
        )
        other = new_trace()
        grade(other, _item(side, "codebase-planning"))
        for grader in graders:
            grader.join(60)
    finally:
        judge.resume()
    assert ended[other][1] == 200
    assert all(ended[trace][1] == 503 for trace in waiting), ended
    assert ended[other][0] < min(ended[trace][0] for trace in waiting), ended


def test_the_judges_key_is_written_nowhere(
    side: Stack, judge: JudgeServer, judge_home: JudgeHome
) -> None:
    """After the judge's tests above (this module's order): every log of the side stack and
    the judge server's, and every stored record, are free of the key."""
    with side.client() as client:
        graded = _grade(client, new_trace(), _item(side, JUDGED))
        assert graded.status_code == 200 and JUDGE_KEY not in graded.text
    logs = [*side.logs.rglob("*.log"), judge.log_path]
    assert logs
    for log in logs:
        assert JUDGE_KEY not in log.read_text(errors="replace"), log
    exported = side.logs.parent / "judge-export.jsonl"
    done = orchestrator(side, "export", str(exported), "--environment", JUDGED)
    assert done.returncode == 0, done.stderr
    assert exported.read_text() and JUDGE_KEY not in exported.read_text()
    exported.unlink()


def test_the_pages_example_scores_as_it_says_against_a_real_judge(
    judge: JudgeServer, settings: Settings
) -> None:
    """docs/graders.md's score_model example: its environment loads through the real
    parser and, pointed at the test's server, its row scores what the page says."""
    found = re.search(
        r"<!-- example \(judge\): [\w-]+ -->\s*```yaml\n(.*?)```\s*```json\n(.*?)```",
        (REPO / "docs" / "graders.md").read_text(),
        re.DOTALL,
    )
    assert found is not None, "docs/graders.md lost its judge example"
    environments, case = yaml.safe_load(found[1]), json.loads(found[2])
    assert case["judge_says"] == VERDICTS["fair"]
    options = environments["environments"][0]["grader"]["options"]
    options |= {"base_url": judge.base_url, "model": judge.model("fair")}
    registry = parse_environments(yaml.safe_dump(environments), settings, source="graders.md")
    (environment,) = [registry.get(n) for n in registry.names()]
    grader = get_grader(environment.grader.name, environment.grader.options)
    result = grade_sample(grader, case["sample"], case["row"], [])
    assert result.score == case["score"], result
