"""The whole stack on the Kubernetes backend: a trainer's calls go API → Redis/Celery →
worker → ``KubernetesBackend`` → the pod's exec agent over TCP at its pod IP, against the
real control plane and a real kubelet (node.py; conftest.py's ``k8s_stack``). The API,
worker and reaper have no Docker daemon to reach (``ORCH_DOCKER_HOST`` names none), so
anything on this path that still asks Docker fails here.

Checked: an Agent RFT rollout with sequential and parallel calls, graded, its pod there
while it lives and gone after; readiness from the backend's heartbeat; a pod killed under a
rollout (503, infra_failed with the pod's state as evidence); an orphan pod swept while a
pool pod still starting is spared; an unknown codebase refused with the catalogue's hint;
one ``/v1/rollouts`` lifecycle through ``RolloutClient``; a warm pool pod handed out and
replaced; the operators' commands (smoke, sandbox run/ls/gc, codebase ls, status,
rollouts ls) beside the stack; an API server outage under a running rollout (the worker
cordoned, the calls answered, the rollout graded and closed once it is back); a worker
started while the API server is away (its first sweep tried again until it finishes).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from orchestrator.client import RolloutClient
from orchestrator.config import Settings
from orchestrator.environments.examples import REQUESTS_CODEBASE
from orchestrator.queue.sweep import POOL_DELIVERY_S, pool_delivery_s
from orchestrator.sandbox.backend import SandboxHandle, SandboxSpec
from orchestrator.sandbox.k8s import pods
from orchestrator.state.keys import Keys
from orchestrator.state.pool_sizing import POOL_LABEL, pool_name
from tests.e2e.helpers import error_code, file_f1, function_call, new_trace, wait_for
from tests.k8s.conftest import (
    OUTAGE,
    POOLED,
    K8sStack,
    k8s_deployment,
    stop_k8s_deployment,
)
from tests.stacks import TOKEN

pytestmark = pytest.mark.xdist_group("real-node")

GOLD = ["src/requests/sessions.py", "src/requests/adapters.py"]


def planning_item(stack: K8sStack) -> dict[str, Any]:
    return {
        "codebase": stack.codebase,
        "prompt": "Make Session.request honour a default timeout.",
        "gold_files": GOLD,
    }


def output_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    output: str = response.json()["output"]
    return output


def pod_is_gone(stack: K8sStack, name: str) -> bool:
    return stack.cluster.read("pods", name) is None and stack.cluster.read("secrets", name) is None


def test_an_agent_rft_rollout_runs_in_a_pod_and_the_pod_goes_with_it(k8s_stack: K8sStack) -> None:
    stack = k8s_stack
    trace, item = new_trace(), planning_item(stack)
    with stack.client() as client:
        listed = output_of(
            client.post(
                "/agent-rft/tools",
                json=function_call(trace, item, "shell", {"command": "rg -l 'def send' src"}),
            )
        )
        assert {"src/requests/sessions.py", "src/requests/adapters.py"} <= set(listed.split())
        (name,) = stack.pods_of(trace)
        pod = stack.cluster.read("pods", name)
        assert pod is not None and pod["status"]["phase"] == "Running"
        # The pod runs the catalogue's image, as named (no registry prefix configured).
        assert pod["spec"]["containers"][0]["image"] == stack.image

        who = output_of(
            client.post(
                "/agent-rft/tools",
                json=function_call(trace, item, "shell", {"command": "id -u; pwd"}),
            )
        )
        assert who.split()[:2] == ["1000", "/workspace"]
        read = output_of(
            client.post(
                "/agent-rft/tools",
                json=function_call(
                    trace,
                    item,
                    "read_file",
                    {"path": "src/requests/sessions.py", "start_line": 1, "end_line": 3},
                ),
            )
        )
        assert read.splitlines()[-1].startswith("[showing lines 1-3 of ")

        async def parallel() -> list[str]:
            async with stack.async_client() as aclient:
                bodies = [
                    function_call(trace, item, "shell", {"command": f"echo parallel-{i}"})
                    for i in range(4)
                ] + [function_call(trace, item, "read_file", {"path": "README.md"})]
                replies = await asyncio.gather(
                    *(aclient.post("/agent-rft/tools", json=b) for b in bodies)
                )
                return [output_of(r) for r in replies]

        outputs = asyncio.run(parallel())
        assert [o.strip() for o in outputs[:4]] == [f"parallel-{i}" for i in range(4)]
        assert "requests" in outputs[4]
        assert stack.pods_of(trace) == [name], "one sandbox for all of the rollout's calls"

        answer = "Files to edit:\n" + "\n".join(f"- {path}" for path in GOLD)
        graded = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": answer}, "item": item, "trace_id": trace},
        )
        assert graded.status_code == 200, graded.text
        assert graded.json()["score"] == pytest.approx(file_f1(answer, item)) == 1.0
        rollout = client.get(f"/v1/rollouts/{trace}").json()
        assert (rollout["state"], rollout["tool_calls"]) == ("graded", 8)

        # The grace after grading is 2 s here: then the reaper closes it and the pod goes.
        wait_for(lambda: pod_is_gone(stack, name), timeout_s=60, what="the graded rollout's pod")
        assert client.get(f"/v1/rollouts/{trace}").json()["state"] == "closed"
    stack.cluster.settle(name)
    assert stack.cluster.docker_objects(name) == []


def test_readyz_reports_the_worker_schedulable_with_the_kubernetes_backends_health(
    k8s_stack: K8sStack,
) -> None:
    stack = k8s_stack
    trace = new_trace()
    with stack.client() as client:
        body = function_call(trace, planning_item(stack), "shell", {"command": "true"})
        output_of(client.post("/agent-rft/tools", json=body))

        def heartbeat() -> dict[str, Any]:
            response = client.get("/v1/readiness")
            assert response.status_code == 200, response.text
            ready = response.json()
            assert ready["ready"] and ready["checks"]["redis"]
            assert stack.settings.host_id in ready["checks"]["schedulable_hosts"]
            (host,) = [h for h in ready["checks"]["hosts"] if h["host"] == stack.settings.host_id]
            return dict(host)

        # The heartbeat counts this worker's pods, as the API server lists them.
        def counts_the_pods() -> bool:
            own = [h for h in stack.k8s.list_owned() if h.host == stack.settings.host_id]
            counted: int = heartbeat()["sandboxes"]
            return counted == len(own) >= 1

        wait_for(counts_the_pods, timeout_s=30, what="the heartbeat to count the rollout's pod")
        host = heartbeat()
        assert host["backend_ok"] and host["backend_ping_ms"] is not None
        # The Kubernetes backend's: an API server outage would cordon, not fail, rollouts.
        assert host["outage_loses_sandboxes"] is False
        assert host["cordon_reasons"] == [] and host["error"] is None
        closed = client.delete(f"/v1/rollouts/{trace}")
        assert closed.status_code == 200, closed.text
    assert stack.pods_of(trace) == []


def test_a_killed_pod_fails_the_rollout_as_infrastructure_with_the_pods_state(
    k8s_stack: K8sStack,
) -> None:
    stack = k8s_stack
    trace, item = new_trace(), planning_item(stack)
    with stack.client() as client:
        output_of(
            client.post(
                "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "true"})
            )
        )
        (name,) = stack.pods_of(trace)
        stack.cluster.kill(name)
        after = client.post(
            "/agent-rft/tools",
            json=function_call(trace, item, "shell", {"command": "echo after"}),
        )
        assert after.status_code == 503, after.text
        record = client.get(f"/v1/rollouts/{trace}").json()
        assert record["state"] == "infra_failed"
        failure = record["infra_failure"]
        assert failure["cause"] == "tool_call_failed"
        probe = failure["evidence"]["probe"]
        assert (probe["alive"], probe["state"], probe["exit_code"], probe["agent_caused"]) == (
            False,
            "exited",
            137,
            None,
        )
        # Never scored: the grade of an infra-failed rollout is a 503 too.
        graded = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": "\n".join(GOLD)}, "item": item, "trace_id": trace},
        )
        assert graded.status_code == 503, graded.text
    wait_for(lambda: pod_is_gone(stack, name), timeout_s=60, what="the failed rollout's pod")


def test_an_orphan_pod_is_swept_and_a_pool_pod_still_starting_is_not(
    k8s_stack: K8sStack,
) -> None:
    """A pod whose rollout's record is lost (as after a lost Redis) goes; a pool pod whose
    creation began minutes ago but is still pending (waiting for a node, say) stays, since
    its creator still waits for it."""
    stack = k8s_stack
    # Older than a Docker sandbox may take to reach its pool, not than a pod may.
    started_s_ago = POOL_DELIVERY_S + 60
    assert started_s_ago < pool_delivery_s(stack.settings)
    starting = pending_pool_pod(stack, started_s_ago=started_s_ago)
    rollout_id = new_trace()
    record = f"{Keys.of(stack.settings.deployment).prefix}rollout:{rollout_id}"
    client = redis.Redis.from_url(stack.settings.redis_url)
    try:
        # A record still creating names no sandbox: the sweeps spare its pod while it starts.
        client.hset(record, mapping={"state": "creating"})
        orphan = stack.k8s.create(SandboxSpec(image=stack.image, rollout_id=rollout_id))
        assert stack.cluster.read("pods", orphan.native_id) is not None
        client.delete(record)
    finally:
        client.close()
    wait_for(lambda: pod_is_gone(stack, orphan.native_id), timeout_s=60, what="the orphan's sweep")
    # The pass that swept the orphan listed the older pool pod too.
    assert stack.cluster.read("pods", starting.native_id) is not None
    stack.k8s.destroy(starting)
    stack.cluster.settle(orphan.native_id)
    assert stack.cluster.docker_objects(orphan.native_id) == []


def pending_pool_pod(stack: K8sStack, *, started_s_ago: float) -> SandboxHandle:
    """A pool pod made as the backend makes one, whose creation began ``started_s_ago``
    and which no node can take (it stays Pending)."""
    unschedulable = stack.settings.model_copy(update={"k8s_node_selector": {"pool": "gpu"}})
    spec = SandboxSpec(image=stack.image, rollout_id=POOL_LABEL)
    began = datetime.now(UTC) - timedelta(seconds=started_s_ago)
    identity = pods.SandboxIdentity(
        sandbox_id=f"sbx-{uuid.uuid4().hex[:12]}",
        host=stack.settings.host_id,
        created_at=began,
        expires_at=began + timedelta(seconds=spec.lifetime_s),
    )
    pod = pods.render_pod(unschedulable, spec, identity, disk_mb=256, output_mb=8)
    stack.k8s.client.create(pod)
    (handle,) = [h for h in stack.k8s.list_owned() if h.sandbox_id == identity.sandbox_id]
    return handle


def test_an_unknown_codebase_is_refused_with_the_catalogues_hint(k8s_stack: K8sStack) -> None:
    stack = k8s_stack
    trace = new_trace()
    catalogue = str(stack.settings.codebases_file)
    with stack.client() as client:
        body = function_call(trace, {"codebase": "not-published"}, "shell", {"command": "ls"})
        response = client.post("/agent-rft/tools", json=body)
        assert response.status_code == 422, response.text
        message = response.json()["error"]["message"]
        assert "orchestrator codebase publish not-published" in message
        assert catalogue in message
        assert client.get(f"/v1/rollouts/{trace}").status_code == 404
        assert error_code(client.get(f"/v1/rollouts/{trace}")) == "unknown_rollout"
    assert stack.pods_of(trace) == []


def test_the_rollout_api_lifecycle_through_the_client(k8s_stack: K8sStack) -> None:
    stack = k8s_stack
    item = planning_item(stack)
    with RolloutClient(stack.base_url, TOKEN) as client:
        with client.rollout(
            environment="codebase-planning", codebase=stack.codebase, item=item
        ) as rollout:
            (name,) = stack.pods_of(rollout.id)
            assert name.endswith(f"-{rollout.created.sandbox_id}")
            found = rollout.call("shell", {"command": "grep -rln 'class Session' src"})
            assert (found.outcome, found.exit_code) == ("ok", 0)
            assert "src/requests/sessions.py" in found.output.splitlines()
            read = rollout.call("read_file", {"path": "src/requests/adapters.py", "end_line": 2})
            assert read.outcome == "ok"
            answer = '["src/requests/sessions.py", "src/requests/adapters.py"]'
            assert rollout.grade(answer=answer).score == pytest.approx(file_f1(answer, item))
        assert rollout.closed
        assert client.get(rollout.id).state == "closed"
    wait_for(lambda: pod_is_gone(stack, name), timeout_s=30, what="the closed rollout's pod")


def orchestrator(stack: K8sStack, *args: str) -> subprocess.CompletedProcess[str]:
    """An ``orchestrator`` command as an operator runs it beside the stack (same settings,
    KUBECONFIG, no Docker daemon)."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        env={**stack.env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_operators_commands_work_without_a_docker_daemon(k8s_stack: K8sStack) -> None:
    stack = k8s_stack
    smoke = orchestrator(stack, "smoke")
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert "runc: created in" in smoke.stdout
    ran = orchestrator(stack, "sandbox", "run", stack.codebase, "--", "git log --oneline | wc -l")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert int(ran.stdout.strip()) >= 1
    listed = orchestrator(stack, "codebase", "ls")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith(stack.codebase)]
    assert f"catalogue {stack.settings.codebases_file}" in row
    for command in (("sandbox", "ls"), ("sandbox", "gc"), ("status", "--once"), ("rollouts", "ls")):
        done = orchestrator(stack, *command)
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
    # smoke and sandbox run destroyed what they made.
    assert [h for h in stack.k8s.list_owned() if h.rollout_id == ""] == []


def test_a_warm_pod_is_handed_to_a_rollout_and_replaced(k8s_stack: K8sStack) -> None:
    """The worker keeps a pool pod ready (refill through the creation lane); a new rollout
    of the pooled environment takes it at once, it goes with that rollout, another comes."""
    stack = k8s_stack

    def warm() -> list[SandboxHandle]:
        return [h for h in stack.k8s.list_owned() if h.rollout_id == POOL_LABEL]

    ready_list = Keys.of(stack.settings.deployment).pool(
        pool_name(POOLED, REQUESTS_CODEBASE), "ready"
    )

    def one_warm_and_ready() -> bool:
        found = warm()
        if len(found) != 1:
            return False
        client = redis.Redis.from_url(stack.settings.redis_url)
        try:
            ready = [json.loads(raw)["sandbox_id"] for raw in client.lrange(ready_list, 0, -1)]
        finally:
            client.close()
        return ready == [found[0].sandbox_id]

    wait_for(one_warm_and_ready, timeout_s=60, what="the pool's warm pod")
    (pooled,) = warm()
    with RolloutClient(stack.base_url, TOKEN) as client:
        with client.rollout(environment=POOLED) as rollout:
            assert rollout.created.sandbox_id == pooled.sandbox_id
            found = rollout.call("shell", {"command": "ls src/requests/sessions.py"})
            assert (found.outcome, found.output.strip()) == ("ok", "src/requests/sessions.py")
        assert client.get(rollout.id).state == "closed"
    wait_for(lambda: pod_is_gone(stack, pooled.native_id), timeout_s=30, what="the used pod")
    wait_for(
        lambda: one_warm_and_ready() and warm()[0].sandbox_id != pooled.sandbox_id,
        timeout_s=60,
        what="a new warm pod",
    )


class Trainer(threading.Thread):
    """A trainer calling on one rollout, one call after another (a short pause between,
    its think time), until stopped: every reply kept with when it came and whether it was
    the command's own output."""

    PAUSE_S = 0.25

    def __init__(self, stack: K8sStack, trace: str, item: dict[str, Any]) -> None:
        super().__init__(name="trainer", daemon=True)
        self.stack, self.trace, self.item = stack, trace, item
        self.replies: list[tuple[float, bool, str]] = []  # (monotonic time, answered, reply)
        self.stopping = threading.Event()

    def run(self) -> None:
        with self.stack.client() as client:
            for n in itertools.count():
                if self.stopping.is_set():
                    return
                body = function_call(self.trace, self.item, "shell", {"command": f"echo call-{n}"})
                try:
                    response = client.post("/agent-rft/tools", json=body)
                    reply = f"{response.status_code} {response.text}"
                    answered = response.status_code == 200 and (
                        response.json()["output"].strip() == f"call-{n}"
                    )
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    reply, answered = repr(exc), False
                self.replies.append((time.monotonic(), answered, reply))
                self.stopping.wait(self.PAUSE_S)

    def answered_between(self, start: float, end: float) -> int:
        return sum(1 for at, answered, _ in self.replies if answered and start <= at <= end)

    def failures(self) -> list[str]:
        return [reply for _, answered, reply in self.replies if not answered]

    def __enter__(self) -> Trainer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.join(120)


def test_an_api_server_outage_cordons_the_worker_and_its_rollout_calls_on(
    k8s_stack: K8sStack,
) -> None:
    """The API server stops while a rollout runs: the worker's heartbeat cordons it
    (unschedulable, with the reason), the rollout's calls keep being answered (they go to
    the pod's agent, never through the API server) and it is not failed. Once the API
    server is back, the worker is schedulable again, the rollout is graded and closed as
    usual, and its pod goes."""
    stack = k8s_stack
    plane = stack.cluster.plane
    host = stack.settings.host_id
    trace = new_trace()
    item = {**planning_item(stack), "environment": OUTAGE}
    with stack.client() as client:

        def readyz() -> tuple[int, dict[str, Any]]:
            response = client.get("/v1/readiness")
            return response.status_code, response.json()

        def schedulable() -> bool:
            code, ready = readyz()
            return code == 200 and host in ready["checks"]["schedulable_hosts"]

        def cordoned() -> bool:
            reasons = readyz()[1]["checks"]["cordoned_hosts"].get(host, [])
            return any("kubernetes API unreachable" in reason for reason in reasons)

        first = function_call(trace, item, "shell", {"command": "echo before"})
        assert output_of(client.post("/agent-rft/tools", json=first)).strip() == "before"
        (name,) = stack.pods_of(trace)
        wait_for(schedulable, timeout_s=30, what="the worker schedulable before the outage")
        with Trainer(stack, trace, item) as trainer:
            plane.stop_apiserver()
            stopped = time.monotonic()
            try:
                wait_for(cordoned, timeout_s=30, what="the worker cordoned by its heartbeat")
                code, ready = readyz()
                # The one worker is cordoned: nowhere to start a sandbox, so not ready.
                assert code == 503 and not ready["ready"] and ready["checks"]["redis"]
                (beat,) = [h for h in ready["checks"]["hosts"] if h["host"] == host]
                assert beat["schedulable"] is False and beat["backend_ok"] is False
                # An outage that keeps the pods: it never counts towards failing the host.
                assert beat["outage_loses_sandboxes"] is False and beat["backend_failures"] == 0
                # The operators' status view says the same.
                shown = orchestrator(stack, "status", "--json", "--interval", "0.5")
                assert shown.returncode == 0, shown.stdout + shown.stderr
                (view,) = [h for h in json.loads(shown.stdout)["hosts"] if h["host"] == host]
                assert view["alive"] and not view["schedulable"] and not view["healthy"]
                assert any("kubernetes API unreachable" in r for r in view["cordon_reasons"])
                assert view["live_rollouts"] >= 1
                # The trainer's calls are answered all along (some of them now, cordoned).
                mark = time.monotonic()
                wait_for(
                    lambda: trainer.answered_between(mark, time.monotonic()) >= 3,
                    timeout_s=30,
                    what="calls answered while the API server is down",
                )
                record = client.get(f"/v1/rollouts/{trace}").json()
                assert record["state"] == "active" and record.get("infra_failure") is None
            finally:
                # Whatever failed above, the module's later tests get their API server back.
                plane.start_apiserver()
            restarted = time.monotonic()
            wait_for(schedulable, timeout_s=30, what="the worker schedulable again")
            mark = time.monotonic()
            wait_for(
                lambda: trainer.answered_between(mark, time.monotonic()) >= 2,
                timeout_s=30,
                what="calls answered after the API server is back",
            )
        assert trainer.failures() == []
        # Calls were answered while the API server was away: from its end to its /readyz.
        assert trainer.answered_between(stopped, restarted) >= 5
        record = client.get(f"/v1/rollouts/{trace}").json()
        assert record["state"] == "active" and record["tool_calls"] == len(trainer.replies) + 1

        answer = "Files to edit:\n" + "\n".join(f"- {path}" for path in GOLD)
        graded = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": answer}, "item": item, "trace_id": trace},
        )
        assert graded.status_code == 200, graded.text
        assert graded.json()["score"] == pytest.approx(1.0)
        # The grace after grading is 2 s here: then the reaper closes it and the pod goes,
        # deleted through the API server that is back.
        wait_for(lambda: pod_is_gone(stack, name), timeout_s=60, what="the graded rollout's pod")
        assert client.get(f"/v1/rollouts/{trace}").json()["state"] == "closed"
    stack.cluster.settle(name)
    assert stack.cluster.docker_objects(name) == []


def test_a_worker_started_while_the_api_server_is_away_is_schedulable_soon_after_it_is_back(
    k8s_stack: K8sStack, settings: Settings, tmp_path: Path
) -> None:
    """A worker's first sweep lifts its "starting" cordon. On Kubernetes a release's pods
    start together, so a worker may start before the API server answers it: that sweep
    fails, and is tried again every second (queue/handlers.py) until it finishes. This
    deployment runs no reaper, whose sweep of the host would otherwise lift the cordon
    too: without the retry its worker stays cordoned for good."""
    plane = k8s_stack.cluster.plane
    stack = k8s_deployment(settings, k8s_stack.cluster, k8s_stack.image, tmp_path, "k8s-start")
    worker_log = tmp_path / "worker.log"
    try:
        plane.stop_apiserver()
        try:
            stack.start_role("worker")
            stack.start_role("api")
            wait_for(
                lambda: (
                    worker_log.exists() and "worker.start_sweep_failed" in worker_log.read_text()
                ),
                timeout_s=60,
                what="the worker's first sweep to fail while the API server is away",
            )
        finally:
            restarted = time.monotonic()
            plane.start_apiserver()
        stack.wait_ready(timeout_s=30)
        print(f"stack ready {time.monotonic() - restarted:.1f} s after the API server's start")
        events = [
            json.loads(line).get("event")
            for line in worker_log.read_text().splitlines()
            if line.startswith("{")
        ]
        assert events.index("worker.start_sweep_failed") < events.index("worker.start_sweep")
    finally:
        stop_k8s_deployment(stack)
