"""Reward integrity end to end, on a stack of its own (API, worker, a reaper pass every second):

- a rollout the orchestrator ended before its grade (idle, past its lifetime, its
  environment removed) is discarded: its next call and its grade are 503s naming why;
- a rollout keeps the environment it started with, whatever the configuration says later;
- Agent RFT's wire: a null or absent ``id``, the grader reachable without a header through
  the deployment's secret path, and every call bounded by the platform's 10 minutes (here
  a 150 s bound, so the caps are visible in seconds: commands at most 40 s, a first call's
  wait for its sandbox at most 10 s).
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from orchestrator.cli.serve import api_command
from orchestrator.environments.loader import default_environments_text
from orchestrator.local import free_port
from orchestrator.state.keys import Keys
from orchestrator.tls import tls
from tests.e2e.conftest import side_stack
from tests.e2e.helpers import (
    assert_no_rollout,
    error_code,
    function_call,
    make_job,
    new_trace,
    orchestrator,
    sandboxes_of,
    wait_for,
)
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("integrity")  # its own stack: not held to the e2e group

IDLE = "integrity-idle"
SHORT_LIFE = "integrity-short-life"
PINNED = "integrity-pinned"
REMOVABLE = "integrity-removable"
GRADER_SECRET = secrets.token_urlsafe(32)
# Agent RFT's bound, scaled down: 150 s less the 30 s margin leaves 120 s a request; a call
# needs 5 s (queue) + 10 s (agent reply) + 65 s (a probe) besides its command, so commands
# are capped at 40 s, and a first call with the default 30 s command has 10 s to get its
# sandbox.
BOUND_S = 150.0
QUEUE_WAIT_S = 5.0
COMMAND_CAP_S = 40
ACQUIRE_S = 10
CAPACITY = 4
# Slow beats on purpose: a worker stopped for a few seconds keeps its heartbeat (TTL 30 s),
# as a busy worker would, so its sandbox creation is late, not lost.
HEARTBEAT_S = 10


def environments(*, pinned_changed: bool = False, removable: bool = True) -> str:
    base = next(
        e
        for e in yaml.safe_load(default_environments_text())["environments"]
        if e["name"] == "codebase-planning"
    )
    envs = [
        {**base, "name": IDLE, "idle_timeout_s": 3, "grace_after_grade_s": 2},
        {
            **base,
            "name": SHORT_LIFE,
            "max_lifetime_s": 10,
            "idle_timeout_s": 10,
            "grace_after_grade_s": 60,
        },
        {**base, "name": PINNED, "tool_call_budget": 3},
    ]
    if pinned_changed:
        envs[2] = {**base, "name": PINNED, "tools": ["read_file"], "tool_call_budget": 50}
    if removable:
        envs.append({**base, "name": REMOVABLE})
    return yaml.safe_dump({"environments": envs}, sort_keys=False)


@pytest.fixture(scope="module")
def integrity(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("integrity-stack")
    env_file = root / "environments.yaml"
    env_file.write_text(environments())
    with side_stack(
        stack,
        root,
        name="ri",
        environments_file=env_file,
        agent_rft_call_bound_s=BOUND_S,
        queue_wait_s=QUEUE_WAIT_S,
        grader_url_secret=GRADER_SECRET,
        host_max_sandboxes=CAPACITY,
        heartbeat_interval_s=float(HEARTBEAT_S),
    ) as started:
        yield started


def row(stack: Stack, environment: str) -> dict[str, Any]:
    return {
        "environment": environment,
        "codebase": stack.codebase,
        "gold_files": ["src/requests/api.py"],
    }


def grade_body(trace: str, item: dict[str, Any]) -> dict[str, Any]:
    return {"sample": {"output_text": "src/requests/api.py"}, "item": item, "trace_id": trace}


def view(stack: Stack, rollout_id: str) -> dict[str, Any]:
    with stack.client() as client:
        found: dict[str, Any] = client.get(f"/v1/rollouts/{rollout_id}").json()
        return found


def assert_discarded(stack: Stack, trace: str, item: dict[str, Any], cause: str) -> None:
    """The rollout's next call and its grade are 503s naming ``cause``; it is failed."""
    with stack.client() as client:
        late = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "ls"})
        )
        assert late.status_code == 503, late.text
        assert error_code(late) == cause and late.json()["error"]["type"] == "infra_error"
        graded = client.post("/agent-rft/grade", json=grade_body(trace, item))
        assert graded.status_code == 503, graded.text
        assert error_code(graded) == cause
    record = view(stack, trace)
    assert (record["state"], record["outcome"], record["score"]) == (
        "infra_failed",
        "infra_error",
        None,
    ), record
    assert record["infra_failure"]["cause"] == cause


def wait_closed(stack: Stack, trace: str, timeout_s: float) -> None:
    wait_for(
        lambda: view(stack, trace)["state"] == "closed" and not sandboxes_of(stack.settings, trace),
        timeout_s=timeout_s,
        what=f"the reaper to end {trace}",
    )


# -- ended by us: discarded, never scored -----------------------------------------------------


def test_a_grade_after_an_idle_end_is_a_503(integrity: Stack) -> None:
    """The common Agent RFT case: the model thought past the idle timeout, then answered.
    The grade is all that comes, and it must not score a rollout we ended."""
    trace, item = new_trace(), row(integrity, IDLE)
    with integrity.client() as client:
        first = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "true"})
        )
        assert first.status_code == 200, first.text
        wait_closed(integrity, trace, timeout_s=15)
        assert view(integrity, trace)["ended_by"]["cause"] == "idle_reaped"
        graded = client.post("/agent-rft/grade", json=grade_body(trace, item))
        assert graded.status_code == 503, graded.text
        assert error_code(graded) == "idle_reaped"
        assert "before its grade" in graded.json()["error"]["message"]
        again = client.post("/agent-rft/grade", json=grade_body(trace, item))
        assert (again.status_code, error_code(again)) == (503, "idle_reaped")
    assert view(integrity, trace)["state"] == "infra_failed"


def test_a_rollout_past_its_lifetime_is_discarded(integrity: Stack) -> None:
    trace, item = new_trace(), row(integrity, SHORT_LIFE)
    with integrity.client() as client:
        first = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "true"})
        )
        assert first.status_code == 200, first.text
    wait_closed(integrity, trace, timeout_s=25)
    assert view(integrity, trace)["ended_by"]["cause"] == "lifetime_exceeded"
    assert_discarded(integrity, trace, item, "lifetime_exceeded")


def test_a_graded_rollout_keeps_its_score_past_its_lifetime(integrity: Stack) -> None:
    """Graded first, then ended by its lifetime: a retried grade still gets its score."""
    trace, item = new_trace(), row(integrity, SHORT_LIFE)
    with integrity.client() as client:
        assert (
            client.post(
                "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "ls"})
            ).status_code
            == 200
        )
        graded = client.post("/agent-rft/grade", json=grade_body(trace, item))
        assert graded.json()["score"] == 1.0
        wait_closed(integrity, trace, timeout_s=25)
        assert view(integrity, trace)["ended_by"] is None
        retried = client.post("/agent-rft/grade", json=grade_body(trace, item))
        assert (retried.status_code, retried.json()["score"]) == (200, 1.0)


def test_a_rollout_whose_environment_is_removed_is_discarded(
    integrity: Stack, tmp_path: Path
) -> None:
    trace, item = new_trace(), row(integrity, REMOVABLE)
    with integrity.client() as client:
        first = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "true"})
        )
        assert first.status_code == 200, first.text
    without = tmp_path / "environments.yaml"
    without.write_text(environments(removable=False))
    # The reaper (a process of its own) reads the new file.
    integrity.restart("reaper", ORCH_ENVIRONMENTS_FILE=str(without))
    try:
        wait_closed(integrity, trace, timeout_s=30)
        assert view(integrity, trace)["ended_by"]["cause"] == "environment_removed"
        assert_discarded(integrity, trace, item, "environment_removed")
    finally:
        integrity.restart("reaper")


# -- pinned ------------------------------------------------------------------------------------


def test_a_rollout_keeps_the_environment_it_started_with(integrity: Stack, tmp_path: Path) -> None:
    """Its tools and budget stay the ones it started with across a new configuration on
    the API and the worker; a rollout started after gets the new one."""
    trace, item = new_trace(), row(integrity, PINNED)
    with integrity.client() as client:
        first = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "echo one"})
        )
        assert first.json()["output"].strip() == "one"
    changed = tmp_path / "environments.yaml"
    changed.write_text(environments(pinned_changed=True))
    integrity.restart("api", "worker", ORCH_ENVIRONMENTS_FILE=str(changed))
    try:
        with integrity.client() as client:
            outputs = [
                client.post(
                    "/agent-rft/tools",
                    json=function_call(trace, item, "shell", {"command": f"echo {n}"}),
                ).json()["output"]
                for n in ("two", "three", "four")
            ]
            assert [o.strip() for o in outputs[:2]] == ["two", "three"], outputs
            assert "budget of 3 calls" in outputs[2], outputs  # its own budget, not 50
            newer, newer_item = new_trace(), row(integrity, PINNED)
            refused = client.post(
                "/agent-rft/tools",
                json=function_call(newer, newer_item, "shell", {"command": "true"}),
            )
            assert "unknown tool 'shell'" in refused.json()["output"], refused.text
            client.delete(f"/v1/rollouts/{trace}")
    finally:
        integrity.restart("api", "worker")


# -- Agent RFT's wire --------------------------------------------------------------------------


@pytest.mark.parametrize("fc_id", [None, "absent"])
def test_a_null_or_absent_id_is_echoed(integrity: Stack, fc_id: str | None) -> None:
    """The platform's own preflight helper sends ``"id": null``; ``call_id`` is the key."""
    trace, item = new_trace(), row(integrity, IDLE)
    body = function_call(trace, item, "shell", {"command": "echo hi"})
    if fc_id is None:
        body["id"] = None
    else:
        del body["id"]
    with integrity.client() as client:
        reply = client.post("/agent-rft/tools", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json() == {
            "type": "function_call_output",
            "call_id": body["call_id"],
            "id": None,
            "output": "hi",
        }
        client.delete(f"/v1/rollouts/{trace}")


def test_the_grader_answers_on_its_secret_path_without_a_header(integrity: Stack) -> None:
    trace, item = new_trace(), row(integrity, IDLE)
    with integrity.client() as client:
        assert (
            client.post(
                "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "ls"})
            ).status_code
            == 200
        )
    with httpx.Client(base_url=integrity.base_url, timeout=30, verify=tls()) as bare:
        graded = bare.post(f"/agent-rft/grade/{GRADER_SECRET}", json=grade_body(trace, item))
        assert (graded.status_code, graded.json()["score"]) == (200, 1.0), graded.text
        for path in ("/agent-rft/grade", f"/agent-rft/grade/{GRADER_SECRET[:-1]}x"):
            refused = bare.post(path, json=grade_body(trace, item))
            assert refused.status_code == 401, (path, refused.text)
        # The secret opens the grader and nothing else.
        tools = bare.post(
            f"/agent-rft/tools/{GRADER_SECRET}",
            json=function_call(trace, item, "shell", {"command": "ls"}),
        )
        assert tools.status_code == 401
        assert GRADER_SECRET not in bare.get("/openapi.json").text


def test_a_job_whose_grader_has_no_header_passes_its_preflight(
    integrity: Stack, tmp_path: Path
) -> None:
    """rft-config --grader-auth path writes the secret grader URL with no headers, and the
    preflight grades through it (the platform's grader would send no header either)."""
    job, rows = make_job(integrity, tmp_path, "--grader-auth", "path", "--environment", IDLE)
    grader = json.loads(job.read_text())["method"]["reinforcement"]["grader"]
    assert grader["url"] == f"{integrity.base_url}/agent-rft/grade/{GRADER_SECRET}"
    assert "headers" not in grader or grader["headers"] == {}
    ran = orchestrator(integrity, "preflight", "--job", str(job), "--dataset", str(rows))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "grader: a grade answers a numeric score" in ran.stdout


def test_agent_rft_commands_are_capped_to_fit_the_bound(integrity: Stack) -> None:
    """Agent RFT's commands may not outlast what its bound leaves; the rollout API's may."""
    trace, item = new_trace(), row(integrity, IDLE)
    with integrity.client() as client:
        too_long = client.post(
            "/agent-rft/tools",
            json=function_call(trace, item, "shell", {"command": "true", "timeout_s": 100}),
        )
        assert too_long.status_code == 200
        assert f"at most {COMMAND_CAP_S} s" in too_long.json()["output"], too_long.text
        assert client.get(f"/v1/rollouts/{trace}").status_code == 404  # nothing started
        created = client.post("/v1/rollouts", json={"environment": IDLE, "item": item})
        rollout_id = created.json()["rollout_id"]
        allowed = client.post(
            f"/v1/rollouts/{rollout_id}/tools/shell",
            json={"arguments": {"command": "echo fine", "timeout_s": 100}},
        )
        assert allowed.json()["output"] == "fine", allowed.text
        client.delete(f"/v1/rollouts/{rollout_id}")


def test_a_first_call_waits_for_capacity_only_as_long_as_the_bound_allows(
    integrity: Stack,
) -> None:
    """Every slot taken: a new rollout's first call waits what its bound leaves once its
    command's time is kept (10 s here), not admission_wait_s (180 s), and leaves nothing."""
    held: list[str] = []
    with integrity.client() as client:
        try:
            for _ in range(CAPACITY):
                # Not the idle environment: the reaper would free their slots in 3 s.
                created = client.post(
                    "/v1/rollouts", json={"environment": PINNED, "item": row(integrity, PINNED)}
                )
                assert created.status_code == 201, created.text
                held.append(created.json()["rollout_id"])
            trace = new_trace()
            started = time.monotonic()
            refused = client.post(
                "/agent-rft/tools",
                json=function_call(trace, row(integrity, IDLE), "shell", {"command": "true"}),
            )
            waited = time.monotonic() - started
            assert refused.status_code == 503, refused.text
            assert error_code(refused) == "at_capacity" and refused.headers["Retry-After"]
            assert ACQUIRE_S - 1 <= waited < ACQUIRE_S + 8, waited
            assert_no_rollout(client, integrity.settings, trace)
        finally:
            for rollout_id in held:
                client.delete(f"/v1/rollouts/{rollout_id}")


def test_a_first_call_out_of_time_leaves_its_sandbox_to_the_retry(integrity: Stack) -> None:
    """The worker stalls (stopped, its heartbeat still fresh) while it should make a new
    rollout's sandbox: at the bound's end the call is a 503 that fails nothing (`starting`),
    the sandbox is made once the worker goes on, and the same call retried runs, once."""
    trace, item = new_trace(), row(integrity, IDLE)
    call = function_call(
        trace, item, "shell", {"command": "echo ran >> /tmp/ledger; cat /tmp/ledger"}
    )
    worker = integrity.procs["worker"]
    # Just after a beat that says the host takes sandboxes (a test before may have filled
    # it, and beats are slow here), so the heartbeat outlives the stall by far.
    wait_for(
        lambda: _fresh_and_schedulable(integrity),
        timeout_s=4 * HEARTBEAT_S,
        what="a fresh heartbeat of a schedulable host",
    )
    worker.send_signal(signal.SIGSTOP)
    try:
        with integrity.client() as client:
            started = time.monotonic()
            first = client.post("/agent-rft/tools", json=call)
            waited = time.monotonic() - started
    finally:
        worker.send_signal(signal.SIGCONT)
    assert first.status_code == 503, first.text
    assert error_code(first) == "starting"
    assert waited < ACQUIRE_S + 8, waited
    with integrity.client() as client:
        retried = client.post("/agent-rft/tools", json=call)
        assert retried.status_code == 200, retried.text
        assert retried.json()["output"] == "ran"
        record = client.get(f"/v1/rollouts/{trace}").json()
        assert record["state"] == "active" and record["infra_failure"] is None
        client.delete(f"/v1/rollouts/{trace}")


def test_a_restarted_worker_takes_sandboxes_before_its_next_beat(integrity: Stack) -> None:
    """A worker starts cordoned ("starting") until its first probe, and publishes that
    probe's finding at once: before, its host took no sandbox for a whole interval after
    its start (here HEARTBEAT_S, 10 s; readyz waited for it on every restart)."""
    integrity.stop("worker")
    spawned = time.time()
    integrity.restart_worker()
    client = redis.Redis.from_url(integrity.settings.redis_url)
    try:
        raw = client.get(
            Keys.of(integrity.settings.deployment).heartbeat(integrity.settings.host_id)
        )
    finally:
        client.close()
    assert raw is not None
    beat = json.loads(raw)
    assert beat["schedulable"], beat
    # The worker's own clock: the first schedulable beat, not the beat an interval on.
    assert beat["time"] - spawned < HEARTBEAT_S, (beat["time"] - spawned, beat)


def _fresh_and_schedulable(stack: Stack) -> bool:
    import redis

    client = redis.Redis.from_url(stack.settings.redis_url)
    key = Keys.of(stack.settings.deployment).heartbeat(stack.settings.host_id)
    try:
        raw = client.get(key)
        fresh = int(client.ttl(key)) > 3 * HEARTBEAT_S - 2
    finally:
        client.close()
    return fresh and raw is not None and bool(json.loads(raw).get("schedulable"))


def test_settings_that_cannot_fit_the_bound_refuse_to_start(integrity: Stack) -> None:
    """A deployment whose fixed waits leave no room for a command does not start."""
    env = {
        **integrity.env,
        "ORCH_QUEUE_WAIT_S": "500",
        "ORCH_DEPLOYMENT": f"bad-{uuid.uuid4().hex[:6]}",
    }
    elsewhere = integrity.settings.model_copy(update={"api_port": free_port()})
    done = subprocess.run(
        api_command(elsewhere), env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "cannot fit its 150 s bound" in done.stdout + done.stderr
    assert "ORCH_QUEUE_WAIT_S" in done.stdout + done.stderr
