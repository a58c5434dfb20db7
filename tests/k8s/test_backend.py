"""``KubernetesBackend`` end to end against a real control plane (control_plane.py) and
its real node (node.py: the kubelet built from Debian's source, dockershim on the local
dockerd, each pod at an address of its own through CNI): create (pod, Secret, watch until
Ready, agent ping), commands and files through the agent at the pod IP with the token,
probes of healthy, killed and node-lost sandboxes, a command OOM-killed in a sandbox that
lives on, a dead pod's address handed to a new pod, failed starts that leave nothing
behind, destroy, listing, the leftover sweep and the heartbeat's count; a create's watch
expired (410), cut by an API server restart, or cut by an outage that outlasts its
deadline; an API server outage under a live sandbox.

What this cannot show (NetworkPolicy, RuntimeClasses other than runc) is listed in
docs/kubernetes-backend.md.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx2
import pytest
from lightkube import Client, KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret

from orchestrator.config import Settings
from orchestrator.environments.examples import ensure_requests_codebase
from orchestrator.sandbox.agent import agent_protocol as protocol
from orchestrator.sandbox.agent import client as agent
from orchestrator.sandbox.agent.client import AgentProtocolError
from orchestrator.sandbox.backend import (
    BackendUnavailable,
    SandboxError,
    SandboxHandle,
    SandboxLimits,
    SandboxSpec,
    SandboxUnavailable,
)
from orchestrator.sandbox.k8s import backend as backend_module
from orchestrator.sandbox.k8s import pods
from orchestrator.sandbox.k8s.backend import Endpoint, KubernetesBackend
from orchestrator.sandbox.k8s.watch import watch_pod
from tests.k8s.cluster import RealCluster

pytestmark = pytest.mark.xdist_group("real-node")

NAMESPACE = "orchestrator-sandboxes"


@pytest.fixture(scope="module")
def codebase_image(settings: Settings, base_image: str) -> str:
    """The `requests` codebase: the init container copies its /workspace into the pod."""
    return ensure_requests_codebase(settings)


@pytest.fixture(scope="module")
def cluster(real_cluster: RealCluster) -> RealCluster:
    """The module's cluster (tests/k8s/conftest.py)."""
    return real_cluster


def k8s_settings(settings: Settings, **overrides: Any) -> Settings:
    chosen: dict[str, Any] = {
        "deployment": settings.deployment,
        "state_dir": settings.state_dir,
        "sandbox_backend": "kubernetes",
        "host_id": "worker-a",
        # A real kubelet's start: its once-a-second status polling, the probe's first delay.
        "sandbox_start_timeout_s": 30,
        "k8s_pending_timeout_s": 60,
    }
    return Settings(**{**chosen, **overrides})


@pytest.fixture(scope="module")
def k8s(settings: Settings, cluster: RealCluster) -> Iterator[KubernetesBackend]:
    backend = KubernetesBackend(k8s_settings(settings), client=cluster.client())
    yield backend
    for handle in backend.list_owned():
        backend.destroy(handle)
    cluster.settle()


@pytest.fixture(scope="module")
def sandbox(k8s: KubernetesBackend, codebase_image: str) -> Iterator[SandboxHandle]:
    """One healthy sandbox of the `requests` codebase, shared by the tests that only read."""
    handle = k8s.create(spec(codebase_image, "k8s-shared"))
    yield handle
    k8s.destroy(handle)


@pytest.fixture()
def make(k8s: KubernetesBackend, cluster: RealCluster, base_image: str) -> Iterator[Any]:
    """Sandboxes of the base image for one test, destroyed (and checked gone) afterwards."""
    made: list[SandboxHandle] = []

    def create(rollout_id: str = "k8s", **limits: Any) -> SandboxHandle:
        handle = k8s.create(spec(base_image, rollout_id, **limits))
        made.append(handle)
        return handle

    yield create
    for handle in made:
        k8s.destroy(handle)
    cluster.settle(*(handle.native_id for handle in made))
    for handle in made:
        assert cluster.docker_objects(handle.native_id) == []


def spec(image: str, rollout_id: str, **limits: Any) -> SandboxSpec:
    # A fraction of a core: the node offers the machine's real two, and a pod's CPU is
    # requested as well as limited (Guaranteed QoS: pods.py).
    return SandboxSpec(
        image=image,
        rollout_id=rollout_id,
        limits=SandboxLimits(**{"memory_mb": 512, "disk_mb": 256, "cpus": 0.25, **limits}),
    )


def pod_ip(cluster: RealCluster, handle: SandboxHandle) -> str:
    pod = cluster.read("pods", handle.native_id)
    assert pod is not None
    ip: str = pod["status"]["podIP"]
    return ip


def phase_is(phase: str) -> Any:
    return lambda pod: pod.get("status", {}).get("phase") == phase


def _after_the_create(cluster: RealCluster, sandbox: SandboxHandle) -> int:
    """How many requests the worker had made, once the create's watch of the pod is among
    them. The audit log has a request once it completed, and a watch completes when its
    stream is closed, which can be after the create returned (seen: the create's watch
    counted as the call's in a fresh-clone run). A create that found the pod ready at once
    opened no watch: then the count after a bounded wait."""
    watch = f"fieldSelector=metadata.name%3D{sandbox.native_id}"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if any(watch in uri and "watch=true" in uri for _, uri in cluster.requests):
            break
        time.sleep(0.05)
    return len(cluster.requests)


def test_a_sandbox_runs_commands_and_reads_the_codebase(
    k8s: KubernetesBackend, cluster: RealCluster, sandbox: SandboxHandle
) -> None:
    before = _after_the_create(cluster, sandbox)
    result = k8s.exec(
        sandbox,
        "id -u; pwd; echo note > note.txt; git log --oneline | wc -l; touch /etc/x 2>&1",
        timeout_s=30,
        output_budget_bytes=4096,
    )
    assert result.exit_code != 0  # the read-only root refused the last command
    lines = result.stdout.head.splitlines()
    assert lines[:2] == ["1000", "/workspace"]
    assert int(lines[2]) >= 1  # the init container copied the codebase, .git included
    assert "Read-only file system" in lines[3]
    found = k8s.read_file(sandbox, "src/requests/sessions.py", max_bytes=1 << 20)
    assert "class Session" in found.text
    note = k8s.read_file(sandbox, "note.txt", max_bytes=64)
    assert note.text == "note\n"
    # Tool calls go to the agent at the pod IP, never through the API server (no exec,
    # attach or proxy). A reply slower than the agent client's first watch interval (1 s:
    # a cold first `git log` on a loaded machine) reads the pod's status once a while,
    # to stop waiting for a pod that is gone; that is the only request a call may make.
    status_read = ("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{sandbox.native_id}")
    assert [r for r in cluster.requests[before:] if r != status_read] == []


def test_the_pod_is_what_the_backend_rendered_and_owns_its_secret(
    k8s: KubernetesBackend,
    cluster: RealCluster,
    sandbox: SandboxHandle,
) -> None:
    pod = cluster.read("pods", sandbox.native_id)
    secret = cluster.read("secrets", sandbox.native_id)
    assert pod is not None and secret is not None
    for key, value in pods.selector(k8s.settings).items():
        assert pod["metadata"]["labels"][key] == value
        assert secret["metadata"]["labels"][key] == value
    owner = secret["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "Pod",
        sandbox.native_id,
        pod["metadata"]["uid"],
    )
    ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert pod["status"]["phase"] == "Running" and ready["Ready"] == "True"
    # The kubelet ran the container as the pod says: the agent as root with only what it
    # needs to run commands as uid 1000 and kill them, read-only, no new privileges.
    container = cluster.main_container(sandbox.native_id)
    container.reload()
    attrs = container.attrs
    host = attrs["HostConfig"]
    assert attrs["Config"]["User"] == "0:0"
    assert host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"]
    assert sorted(host["CapAdd"]) == ["KILL", "SETGID", "SETPCAP", "SETUID"]
    whoami = k8s.exec(sandbox, "id -u; id -G", timeout_s=10, output_budget_bytes=256)
    assert whoami.stdout.head.split() == ["1000", "1000"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["Memory"] == 512 * 2**20
    # An address of its own on the node's pod network, in its pause container's namespace.
    assert cluster.node.subnet is not None
    assert ipaddress.ip_address(pod["status"]["podIP"]) in cluster.node.subnet
    assert host["NetworkMode"].startswith("container:")


def test_the_garbage_collector_takes_the_secret_with_its_pod(
    cluster: RealCluster, make: Any
) -> None:
    """The agent token's Secret is owned by its pod: deleted without the backend (as by an
    operator's ``kubectl delete pod``), the pod takes it along through the real garbage
    collector of kube-controller-manager."""
    handle = make(rollout_id="k8s-gc")
    secret = cluster.read("secrets", handle.native_id)
    assert secret is not None and secret["metadata"]["ownerReferences"][0]["kind"] == "Pod"
    cluster.api.request(
        "DELETE",
        f"/api/v1/namespaces/{NAMESPACE}/pods/{handle.native_id}",
        {"gracePeriodSeconds": 0},
    )
    cluster.wait_gone("secrets", handle.native_id)
    cluster.wait_gone("pods", handle.native_id)


def test_the_agent_refuses_requests_without_the_sandbox_token(
    k8s: KubernetesBackend, cluster: RealCluster, sandbox: SandboxHandle
) -> None:
    ip = pod_ip(cluster, sandbox)
    port = k8s.settings.k8s_agent_port
    touch = protocol.exec_request("touch /workspace/pwned", 10, 256, "/")
    with pytest.raises(AgentProtocolError, match="Unauthorized"):
        agent.call_tcp(ip, port, "not-the-token", touch, 10)
    with socket.create_connection((ip, port), timeout=10) as sock:
        sock.sendall(json.dumps(touch).encode() + b"\n")
        reply = json.loads(sock.makefile("rb").readline())
    assert reply == {"ok": False, "kind": protocol.Refusal.UNAUTHORIZED, "error": "bad token"}
    check = k8s.exec(
        sandbox, "test -e pwned && echo yes || echo no", timeout_s=10, output_budget_bytes=64
    )
    assert check.stdout.head == "no\n"


def test_a_healthy_sandbox_probes_healthy(k8s: KubernetesBackend, sandbox: SandboxHandle) -> None:
    probe = k8s.probe(sandbox)
    assert (probe.alive, probe.agent_ok, probe.state, probe.agent_caused) == (
        True,
        True,
        "running",
        None,
    )


def test_another_worker_reaches_the_sandbox_through_the_api(
    settings: Settings, cluster: RealCluster, k8s: KubernetesBackend, sandbox: SandboxHandle
) -> None:
    """A worker that did not create the sandbox reads its IP and token from the API, and the
    heartbeat of each worker counts only its own sandboxes."""
    other = KubernetesBackend(k8s_settings(settings, host_id="worker-b"), client=cluster.client())
    result = other.exec(sandbox, "echo hi", timeout_s=10, output_budget_bytes=64)
    assert result.stdout.head == "hi\n"
    assert sandbox.sandbox_id in {h.sandbox_id for h in other.list_owned()}
    mine = [h for h in k8s.list_owned() if h.host == "worker-a"]
    assert k8s.host_health().sandboxes == len(mine) >= 1
    assert k8s.host_health().backend_ok
    health = other.host_health()
    assert health.backend_ok and health.sandboxes == 0


def test_list_owned_reads_back_every_label_and_destroy_is_idempotent(
    k8s: KubernetesBackend, cluster: RealCluster, make: Any, base_image: str
) -> None:
    odd = "trace_" + "x" * 70 + "/odd"  # not label-safe: kept as an annotation
    first = make(rollout_id="k8s-one")
    second = make(rollout_id=odd)
    listed = {h.sandbox_id: h for h in k8s.list_owned()}
    assert listed[first.sandbox_id].rollout_id == "k8s-one"
    assert listed[second.sandbox_id].rollout_id == odd
    for handle in (first, second):
        found = listed[handle.sandbox_id]
        assert (found.host, found.runtime, found.image, found.native_id) == (
            "worker-a",
            "runc",
            base_image,
            handle.native_id,
        )
        assert (found.created_at, found.expires_at) == (handle.created_at, handle.expires_at)
    k8s.destroy(first)
    k8s.destroy(first)  # idempotent: a 404 is success
    assert first.sandbox_id not in {h.sandbox_id for h in k8s.list_owned()}
    assert cluster.read("pods", first.native_id) is None
    assert cluster.read("secrets", first.native_id) is None
    cluster.settle(first.native_id)
    assert cluster.docker_objects(first.native_id) == []
    gone = k8s.probe(first)
    assert (gone.alive, gone.state) == (False, "missing")
    assert k8s.probe(second).alive


def test_a_killed_sandbox_probes_as_exited_not_by_the_agent(
    k8s: KubernetesBackend, cluster: RealCluster, make: Any
) -> None:
    handle = make()
    cluster.kill(handle.native_id)
    probe = k8s.probe(handle)
    assert (probe.alive, probe.state, probe.exit_code, probe.oom_killed, probe.agent_caused) == (
        False,
        "exited",
        137,
        False,
        None,
    )
    assert "reason=Error" in probe.detail
    # Not to the dead pod's IP (free for other pods): its status says why.
    with pytest.raises(SandboxUnavailable, match="no agent to reach: exited"):
        k8s.exec(handle, "true", timeout_s=5, output_budget_bytes=64)


def test_a_reused_pod_ip_is_not_taken_for_the_sandbox(
    k8s: KubernetesBackend, cluster: RealCluster, make: Any
) -> None:
    """Pod IPs are reused: a worker remembering a dead pod's IP may reach another sandbox's
    agent, which refuses the token. That is "unreachable" with the pod's state, and the
    worker reads the address again."""
    first, second = make(), make()
    token = k8s._endpoint(first).token
    # As if first's old IP now belonged to second's pod, while this worker remembers it.
    k8s._remember(first.sandbox_id, Endpoint(pod_ip(cluster, second), token))
    with pytest.raises(SandboxUnavailable, match=r"Unauthorized.*sandbox state: running"):
        k8s.exec(first, "true", timeout_s=5, output_budget_bytes=64)
    again = k8s.exec(first, "echo again", timeout_s=5, output_budget_bytes=64)
    assert again.stdout.head == "again\n"


def test_a_killed_pods_ip_handed_to_a_new_pod_reaches_nothing_of_the_old_sandbox(
    k8s: KubernetesBackend, cluster: RealCluster, make: Any
) -> None:
    """The pod dies, the network hands its IP to a new pod, and a worker still remembers
    the old address: the new pod's agent refuses the old token, so no command of the dead
    sandbox runs in another, and the failure carries the dead pod's state."""
    dead = make(rollout_id="k8s-dead")
    old_ip = pod_ip(cluster, dead)
    cluster.kill(dead.native_id)
    cluster.wait_for_pod(dead.native_id, phase_is("Failed"))
    cluster.hand_out(old_ip)
    heir = make(rollout_id="k8s-heir")
    assert pod_ip(cluster, heir) == old_ip
    with pytest.raises(SandboxUnavailable, match=r"Unauthorized.*sandbox state: exited"):
        k8s.exec(dead, "touch /workspace/from-the-dead", timeout_s=5, output_budget_bytes=64)
    check = "test -e /workspace/from-the-dead && echo yes || echo no"
    assert k8s.exec(heir, check, timeout_s=5, output_budget_bytes=64).stdout.head == "no\n"
    # The worker forgot the address; the pod's status says there is no agent to reach.
    with pytest.raises(SandboxUnavailable, match="no agent to reach: exited"):
        k8s.exec(dead, "true", timeout_s=5, output_budget_bytes=64)


def test_an_oom_kill_takes_the_command_and_the_sandbox_lives(
    k8s: KubernetesBackend, make: Any
) -> None:
    """A command past the sandbox's memory: the kernel's OOM killer takes the command (the
    agent makes its commands the first to go), which the call reports as the memory limit
    hit, and the sandbox lives on. A kubelet that kills a container's every process at
    once (``memory.oom.group``: Kubernetes >= 1.28 on cgroup v2; this node is 1.20 on
    cgroup v1) ends the pod instead, OOMKilled: test_states.py reads such a pod."""
    handle = make(memory_mb=128)
    hog = k8s.exec(
        handle, "python3 -c 'x = bytearray(400 << 20)'", timeout_s=30, output_budget_bytes=1024
    )
    assert hog.exit_code != 0 and "memory" in hog.limits_hit, hog
    probe = k8s.probe(handle)
    assert (probe.alive, probe.agent_ok, probe.state) == (True, True, "running")
    after = k8s.exec(handle, "echo alive", timeout_s=10, output_budget_bytes=64)
    assert after.stdout.head == "alive\n"


def test_a_lost_node_is_an_infrastructure_fault(
    k8s: KubernetesBackend, cluster: RealCluster, make: Any
) -> None:
    handle = make()
    with cluster.node_lost(handle.native_id):
        probe = k8s.probe(handle)
    assert (probe.alive, probe.state, probe.agent_caused) == (False, "node_lost", None)
    assert "DisruptionTarget" in probe.detail


def test_an_image_that_cannot_be_pulled_fails_the_create_and_leaves_nothing(
    k8s: KubernetesBackend, cluster: RealCluster
) -> None:
    # Settled first: an earlier test's pod may still be leaving the node, and what the
    # settle below removes of it must not read as this create's doing (seen: its pause
    # container listed before, gone after).
    cluster.settle()
    pods_before, secrets_before = cluster.names("pods"), cluster.names("secrets")
    objects_before = set(cluster.docker_objects())
    with pytest.raises(SandboxError) as failed:
        k8s.create(spec("orchestrator/no-such-image:k8s", "k8s-pull"))
    message = str(failed.value)
    assert "image_pull_failed" in message and "ImagePullBackOff" in message
    assert "events:" in message and "Failed to pull image" in message
    cluster.settle()
    assert cluster.names("pods") == pods_before
    assert cluster.names("secrets") == secrets_before
    assert set(cluster.docker_objects()) == objects_before


def test_a_pod_that_never_gets_ready_times_out_and_leaves_nothing(
    settings: Settings, cluster: RealCluster, base_image: str
) -> None:
    pending = KubernetesBackend(
        k8s_settings(settings, k8s_pending_timeout_s=1.5, k8s_node_selector={"pool": "gpu"}),
        client=cluster.client(),
    )
    pods_before, secrets_before = cluster.names("pods"), cluster.names("secrets")
    with pytest.raises(SandboxError) as failed:
        pending.create(spec(base_image, "k8s-pending"))
    message = str(failed.value)
    assert "unschedulable" in message and "not Ready within 1.5 s" in message
    assert "FailedScheduling" in message
    cluster.settle()
    assert cluster.names("pods") == pods_before
    assert cluster.names("secrets") == secrets_before


def test_create_survives_an_expired_watch(
    k8s: KubernetesBackend,
    cluster: RealCluster,
    make: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """etcd compacts its history between the create and the watch: the API server answers
    the watch from the create's resourceVersion with 410 Gone, and the backend starts again
    from a fresh read of the pod."""
    compactions: list[int] = []

    def watch_after_a_compaction(*args: Any, **kw: Any) -> Any:
        if not compactions:
            compactions.append(cluster.plane.compact())
        return watch_pod(*args, **kw)

    monkeypatch.setattr(backend_module, "watch_pod", watch_after_a_compaction)
    handle = make(rollout_id="k8s-expired")
    assert compactions
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/{handle.native_id}"
    assert any(method == "GET" and uri == path for method, uri in cluster.requests)
    assert k8s.exec(handle, "echo up", timeout_s=10, output_budget_bytes=64).stdout.head == "up\n"


def test_create_survives_a_watch_cut_by_an_api_server_restart(
    k8s: KubernetesBackend,
    cluster: RealCluster,
    make: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The API server restarts while the create watches its pod: the stream is cut (the
    server died mid-response), the pod runs on, and the backend reads it again once the
    API server answers, within its pending timeout. The kubelet, a client of the same
    API server, keeps its pods and reports through the restart too."""
    cuts: list[httpx2.HTTPError] = []
    restarted: list[float] = []

    def watch_cut_by_a_restart(*args: Any, **kw: Any) -> Iterator[tuple[str, Any]]:
        events = watch_pod(*args, **kw)
        if restarted:
            yield from events
            return
        # The watch is open and streaming: the API server sent the pod's first change
        # (the scheduler's binding; it cannot be Ready yet). Then the restart, before the
        # backend sees anything of this watch.
        first = next(events)
        cluster.plane.stop_apiserver()
        cluster.plane.start_apiserver()
        restarted.append(time.monotonic())
        yield first
        try:
            # What the stream held when the server died is dropped, as bytes in flight are
            # when a connection breaks: the backend cannot have seen the pod Ready from this
            # watch (so the test does not race the kubelet), only by reading it again.
            for _ in events:
                pass
        except httpx2.HTTPError as exc:
            cuts.append(exc)
            raise
        pytest.fail("the API server's restart did not cut the watch")

    monkeypatch.setattr(backend_module, "watch_pod", watch_cut_by_a_restart)
    started = time.monotonic()
    handle = make(rollout_id="k8s-restarted")
    took = time.monotonic() - started
    (cut,) = cuts
    assert isinstance(cut, httpx2.TransportError), repr(cut)  # cut, not refused
    assert took < k8s.settings.k8s_pending_timeout_s
    # After the cut the backend read the pod, and watched on from that read.
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/{handle.native_id}"
    assert ("GET", path) in cluster.requests
    assert k8s.exec(handle, "echo up", timeout_s=10, output_budget_bytes=64).stdout.head == "up\n"
    assert k8s.probe(handle).agent_ok
    # The kubelet came through the restart: its watch sees new pods, its status updates
    # reach the API server (a killed pod ends as Failed there).
    after = make(rollout_id="k8s-after-restart")
    cluster.kill(after.native_id)
    cluster.wait_for_pod(after.native_id, phase_is("Failed"))
    assert k8s.exec(handle, "echo still", timeout_s=10, output_budget_bytes=64).stdout.head == (
        "still\n"
    )


def test_a_create_whose_api_server_stays_away_past_its_deadline_is_backend_unavailable(
    settings: Settings,
    cluster: RealCluster,
    base_image: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The API server stops under the create's watch and is still away at the pending
    deadline: the backend retried until then, and the create fails as BackendUnavailable
    (the API server's fault, not the pod's). Its pod, which the create could not delete
    without the API server, is found by its labels once the API server is back."""
    impatient = KubernetesBackend(
        k8s_settings(settings, k8s_pending_timeout_s=4), client=cluster.client()
    )
    stopped: list[float] = []

    def watch_cut_by_an_outage(*args: Any, **kw: Any) -> Iterator[tuple[str, Any]]:
        events = watch_pod(*args, **kw)
        first = next(events)  # open and streaming, as in the restart's test above
        cluster.plane.stop_apiserver()
        stopped.append(time.monotonic())
        yield first
        for _ in events:  # what was in flight is dropped; the cut is raised
            pass
        pytest.fail("the API server's stop did not cut the watch")

    monkeypatch.setattr(backend_module, "watch_pod", watch_cut_by_an_outage)
    try:
        started = time.monotonic()
        with pytest.raises(
            BackendUnavailable, match="kubernetes API unreachable while trying to watch"
        ):
            impatient.create(spec(base_image, "k8s-api-away"))
        # Not at the cut: at the deadline, having retried until then.
        assert stopped and time.monotonic() - started >= impatient.settings.k8s_pending_timeout_s
    finally:
        # Whatever failed above, the module's later tests get their API server back.
        if not cluster.plane.apiserver.alive():
            cluster.plane.start_apiserver()
    (left,) = [h for h in impatient.list_owned() if h.rollout_id == "k8s-api-away"]
    impatient.destroy(left)
    cluster.settle(left.native_id)
    assert cluster.docker_objects(left.native_id) == []


def test_sweep_leftovers_removes_only_settled_orphan_secrets(
    settings: Settings, cluster: RealCluster, sandbox: SandboxHandle
) -> None:
    """A Secret whose pod never came: left while its pod may be on its way (younger than
    twice the start timeout, by the API server's own creationTimestamp), swept after."""
    sweeper = KubernetesBackend(
        k8s_settings(settings, sandbox_start_timeout_s=1), client=cluster.client()
    )
    orphan = pods.pod_name(sweeper.settings, "sbx-orphan00000")
    meta = ObjectMeta(name=orphan, labels=dict(pods.selector(sweeper.settings)))
    made = sweeper.client.create(Secret(metadata=meta, type="Opaque", data={}), namespace=NAMESPACE)
    assert sweeper.sweep_leftovers() == 0  # young: its pod may be on its way
    assert cluster.read("secrets", orphan) is not None
    # The API server stamps creation to the second; wait until it is past the settle age.
    assert made.metadata is not None and made.metadata.creationTimestamp is not None
    settled_at = made.metadata.creationTimestamp + timedelta(seconds=3)
    time.sleep(max(0.0, (settled_at - datetime.now(UTC)).total_seconds()))
    assert sweeper.sweep_leftovers() == 1
    assert cluster.read("secrets", orphan) is None
    assert cluster.read("secrets", sandbox.native_id) is not None  # its pod lives


def test_the_backend_finds_the_api_server_through_kubeconfig(
    settings: Settings,
    cluster: RealCluster,
    sandbox: SandboxHandle,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As a worker outside the cluster builds it: no client given, KUBECONFIG set."""
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(cluster.kubeconfig()))  # JSON is YAML
    monkeypatch.setenv("KUBECONFIG", str(path))
    backend = KubernetesBackend(k8s_settings(settings))
    assert sandbox.sandbox_id in {h.sandbox_id for h in backend.list_owned()}
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(BackendUnavailable, match="no Kubernetes configuration"):
        KubernetesBackend(k8s_settings(settings))


def test_an_api_server_that_refuses_is_reported_not_raised_by_the_heartbeat(
    settings: Settings, cluster: RealCluster, sandbox: SandboxHandle
) -> None:
    config = cluster.kubeconfig()
    config["users"][0]["user"]["token"] = "wrong"
    refused = KubernetesBackend(
        k8s_settings(settings), client=Client(config=KubeConfig.from_dict(config), trust_env=False)
    )
    health = refused.host_health()
    assert not health.backend_ok and "401 Unauthorized" in (health.error or "")
    with pytest.raises(SandboxError, match="kubernetes refused to read sandbox pod: 401"):
        refused.probe(sandbox)


def test_an_api_server_outage_cordons_the_worker_and_its_sandboxes_run_on(
    k8s: KubernetesBackend,
    cluster: RealCluster,
    sandbox: SandboxHandle,
    make: Any,
    base_image: str,
) -> None:
    """The real API server stops: the heartbeat reports it unreachable (the worker is
    cordoned) without failing its rollouts, the sandbox's agent still answers (tool calls
    never go through the API server), a create fails as BackendUnavailable. Once it is
    back, the same backend object works again."""
    # Remembered from create: the call path needs nothing from the API server.
    assert sandbox.sandbox_id in k8s._endpoints
    pods_before = cluster.names("pods")
    cluster.plane.stop_apiserver()
    try:
        health = k8s.host_health()
        assert not health.backend_ok
        assert "kubernetes API unreachable" in (health.error or ""), health.error
        # Pods run on without the API server: the worker is cordoned, its rollouts kept.
        assert not health.outage_loses_sandboxes
        ran = k8s.exec(sandbox, "echo still here", timeout_s=10, output_budget_bytes=64)
        assert ran.stdout.head == "still here\n"
        assert k8s.read_file(sandbox, "src/requests/__init__.py", max_bytes=1 << 16).text
        with pytest.raises(BackendUnavailable, match="kubernetes API unreachable"):
            k8s.create(spec(base_image, "k8s-outage"))
    finally:
        # Whatever failed above, the module's later tests get their API server back.
        cluster.plane.start_apiserver()
    assert cluster.names("pods") == pods_before  # the failed create made nothing
    health = k8s.host_health()
    assert health.backend_ok and health.error is None and health.sandboxes >= 1
    after = make(rollout_id="k8s-after-outage")
    assert k8s.exec(after, "echo back", timeout_s=10, output_budget_bytes=64).stdout.head == (
        "back\n"
    )
    assert k8s.probe(sandbox).agent_ok


def test_a_failed_workspace_seed_fails_the_create_with_its_evidence(
    k8s: KubernetesBackend, cluster: RealCluster
) -> None:
    """An image without /workspace: the init container's copy fails, so does the pod."""
    pods_before, secrets_before = cluster.names("pods"), cluster.names("secrets")
    with pytest.raises(SandboxError) as failed:
        k8s.create(spec("debian:bookworm-slim", "k8s-seed"))
    message = str(failed.value)
    assert "(exited)" in message
    assert "init container workspace-seed failed: exit=1 reason=Error" in message
    cluster.settle()
    assert cluster.names("pods") == pods_before
    assert cluster.names("secrets") == secrets_before
