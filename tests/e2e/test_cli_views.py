"""The operators' views against a real stack: `orchestrator status` (one frame and JSON),
`orchestrator rollouts ls` with its filters, and `orchestrator rollouts show` of a graded
rollout and of one whose sandbox was killed under it. The CLI runs as a subprocess with
the stack's environment, the way an operator runs it next to a deployment."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import docker
import httpx
import pytest

from orchestrator.state.keys import Keys
from orchestrator.state.models import TrajectoryStep
from orchestrator.views.models import RolloutDetail, RolloutSummary, StatusSnapshot
from orchestrator.views.scrape import call_stats, fetch
from tests.e2e.helpers import cli, file_f1, function_call, new_trace
from tests.stacks import TOKEN, Stack

pytestmark = pytest.mark.xdist_group("e2e")

GREP = "grep -rln 'class Session' src"
ANSWER = "Files to edit:\n- src/requests/sessions.py"


@dataclass(frozen=True)
class Rollouts:
    graded: str
    score: float
    failed: str


def _call(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    return client.post("/agent-rft/tools", json=body)


@pytest.fixture(scope="module")
def rollouts(stack: Stack, client: docker.DockerClient) -> Iterator[Rollouts]:
    """One rollout graded after two calls; one infra-failed: its sandbox killed, then called."""
    item = {
        "codebase": stack.codebase,
        "prompt": "Make Session.request honour a default timeout.",
        "gold_files": ["src/requests/sessions.py", "src/requests/adapters.py"],
    }
    graded, failed = new_trace(), new_trace()
    with stack.client() as api:
        for name, args in (("shell", {"command": GREP}), ("read_file", {"path": "README.md"})):
            reply = _call(api, function_call(graded, item, name, args))
            assert reply.status_code == 200, reply.text
        grade = api.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": ANSWER}, "item": item, "trace_id": graded},
        )
        assert grade.status_code == 200, grade.text
        score = grade.json()["score"]
        assert score == pytest.approx(file_f1(ANSWER, item))

        first = _call(api, function_call(failed, item, "shell", {"command": "true"}))
        assert first.status_code == 200, first.text
        (container,) = client.containers.list(filters={"label": f"orchestrator.rollout={failed}"})
        container.kill()
        broken = _call(api, function_call(failed, item, "shell", {"command": "echo hi"}))
        assert broken.status_code == 503, broken.text
        try:
            yield Rollouts(graded=graded, score=score, failed=failed)
        finally:
            for trace in (graded, failed):
                api.delete(f"/v1/rollouts/{trace}")


def test_status_json_shows_hosts_sandboxes_queues_and_failures(
    stack: Stack, rollouts: Rollouts
) -> None:
    snapshot = StatusSnapshot.model_validate_json(
        cli(stack, "status", "--json", "--interval", "0.5").stdout
    )
    assert snapshot.redis_ok and snapshot.deployment == stack.settings.deployment
    (host,) = [h for h in snapshot.hosts if h.host == stack.settings.host_id]
    assert host.alive and host.healthy and host.schedulable and host.cordon_reasons == []
    assert host.capacity == stack.settings.host_max_sandboxes
    assert host.slots_used >= 1 and host.live_rollouts >= 1
    assert host.heartbeat_age_s is not None
    # The daemons' CPU weight is off by default: the worker leaves them as they are.
    assert stack.settings.docker_daemon_cpu_weight == 0 and host.daemon_cpu is None
    queues = {q.queue: q.depth for q in snapshot.queues}
    assert Keys.of(stack.settings.deployment).shared_queue in queues
    assert Keys.of(stack.settings.deployment).host_queue(stack.settings.host_id) in queues
    assert snapshot.admission is not None and snapshot.admission.slots_total >= 1
    # The infra-failed one; the graded one closed at its grade (grace_after_grade_s 0).
    assert snapshot.live_rollouts >= 1
    assert snapshot.sandboxes.rollouts_by_state.get("infra_failed", 0) >= 1
    failure = next(f for f in snapshot.recent_failures if f.rollout_id == rollouts.failed)
    assert failure.trace_id == rollouts.failed
    assert failure.host == stack.settings.host_id
    assert failure.cause and failure.message and failure.evidence
    assert snapshot.calls is not None and snapshot.calls.error is None
    assert snapshot.calls.calls_since_start >= 3  # the graded rollout's two, the first of the other
    assert [p.phase for p in snapshot.calls.latency] == ["queue", "exec", "total"]


def test_status_once_prints_one_readable_frame(stack: Stack, rollouts: Rollouts) -> None:
    out = cli(stack, "status", "--once", "--interval", "0.5").stdout
    assert f"deployment {stack.settings.deployment}" in out
    assert stack.settings.host_id in out
    assert Keys.of(stack.settings.deployment).host_queue(stack.settings.host_id) in out
    assert "tool-call latency" in out and "infra-error ratio" in out
    assert "as is" in out  # the daemons' CPU weight, off by default
    assert "recent infra failures" in out
    assert rollouts.failed in out


def test_call_stats_count_a_call_between_two_scrapes(stack: Stack, rollouts: Rollouts) -> None:
    before = fetch(stack.base_url, token=TOKEN)
    item = {"codebase": stack.codebase}
    trace = new_trace()
    with stack.client() as api:
        reply = _call(api, function_call(trace, item, "shell", {"command": "echo one"}))
        assert reply.status_code == 200, reply.text
        after = fetch(stack.base_url, token=TOKEN)
        api.delete(f"/v1/rollouts/{trace}")
    stats = call_stats(stack.base_url, before, after)
    assert stats.calls == 1 and stats.by_outcome.get("ok") == 1
    assert stats.infra_error_ratio == 0.0
    assert stats.window_s > 0 and stats.rate_per_s > 0
    phases = {p.phase: p for p in stats.latency}
    assert phases["total"].count == 1
    assert phases["total"].p50_ms is not None and phases["total"].p99_ms is not None
    assert phases["total"].p50_ms <= phases["total"].p99_ms


def _ls(stack: Stack, *args: str) -> list[RolloutSummary]:
    raw = json.loads(cli(stack, "rollouts", "ls", "--json", *args).stdout)
    return [RolloutSummary.model_validate(r) for r in raw]


def test_rollouts_ls_lists_and_filters(stack: Stack, rollouts: Rollouts) -> None:
    listed = {r.rollout_id: r for r in _ls(stack, "--limit", "1000")}
    graded, failed = listed[rollouts.graded], listed[rollouts.failed]
    assert graded.trace_id == rollouts.graded and graded.source == "agent_rft"
    assert graded.calls == 2 and graded.score == rollouts.score
    assert graded.environment == "codebase-planning" and graded.codebase == stack.codebase
    assert failed.outcome == "infra_error" and failed.score is None
    assert failed.infra_cause is not None

    failed_only = {r.rollout_id for r in _ls(stack, "--state", "infra_failed", "--limit", "1000")}
    assert rollouts.failed in failed_only and rollouts.graded not in failed_only
    ok_only = {r.rollout_id for r in _ls(stack, "--outcome", "ok", "--limit", "1000")}
    assert rollouts.graded in ok_only and rollouts.failed not in ok_only
    assert len(_ls(stack, "--limit", "1")) == 1

    table = cli(stack, "rollouts", "ls", "--limit", "1000").stdout
    assert rollouts.graded in table and rollouts.failed in table and "infra_error" in table

    refused = cli(stack, "rollouts", "ls", "--state", "nonsense", check=False)
    assert refused.returncode == 2

    # A page at a time: a full page ends with the next one's --before.
    first = cli(stack, "rollouts", "ls", "--json", "--limit", "1")
    (newest,) = [RolloutSummary.model_validate(r) for r in json.loads(first.stdout)]
    (more,) = [line for line in first.stderr.splitlines() if line.startswith("older: --before ")]
    (older,) = _ls(stack, "--limit", "1", "--before", more.removeprefix("older: --before "))
    assert (older.created_at, older.rollout_id) < (newest.created_at, newest.rollout_id)
    bad = cli(stack, "rollouts", "ls", "--before", "yesterday/", check=False)
    assert bad.returncode == 2 and "--before" in bad.stderr


def test_rollouts_show_a_graded_trajectory(stack: Stack, rollouts: Rollouts) -> None:
    detail = RolloutDetail.model_validate_json(
        cli(stack, "rollouts", "show", rollouts.graded, "--json").stdout
    )
    assert detail.summary.score == rollouts.score and detail.summary.outcome == "ok"
    steps: list[TrajectoryStep] = detail.trajectory
    assert [(s.seq, s.tool, s.outcome) for s in steps] == [
        (1, "shell", "ok"),
        (2, "read_file", "ok"),
    ]
    assert "src/requests/sessions.py" in steps[0].output

    out = cli(stack, "rollouts", "show", rollouts.graded).stdout
    assert rollouts.graded in out
    assert "#1 shell" in out and "#2 read_file" in out
    assert GREP in out and '"path": "README.md"' in out
    assert "src/requests/sessions.py" in out
    assert f"{rollouts.score:.4g}" in out and "grade details" in out


def test_rollouts_show_an_infra_failure_with_its_evidence(stack: Stack, rollouts: Rollouts) -> None:
    detail = RolloutDetail.model_validate_json(
        cli(stack, "rollouts", "show", rollouts.failed, "--json").stdout
    )
    assert detail.summary.state == "infra_failed" and detail.summary.outcome == "infra_error"
    failure = detail.infra_failure
    assert failure is not None and failure["cause"] and failure["evidence"]
    assert [s.tool for s in detail.trajectory] == ["shell"]  # the failed call stored nothing

    out = cli(stack, "rollouts", "show", rollouts.failed).stdout
    assert "infrastructure failure" in out and failure["cause"] in out
    assert "evidence" in out
    first_key = next(iter(failure["evidence"]))
    assert first_key in out


def test_rollouts_show_of_an_unknown_id_is_an_error(stack: Stack) -> None:
    done = cli(stack, "rollouts", "show", "trace_nope", check=False)
    assert done.returncode == 1
    assert "no rollout 'trace_nope'" in done.stderr
