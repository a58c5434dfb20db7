"""``helm install`` of the chart into a real cluster, a trainer's rollouts through its API
Service, ``helm upgrade`` and ``helm uninstall``: the real helm v4, the control plane of
control_plane.py and a real node (node.py with ``services``: the 1.20 kubelet on dockershim,
kube-proxy, the cluster DNS), the chart's images built on this machine
(scripts/service-images.sh) and present on the node.

Installed as the chart renders it (API, worker StatefulSet, reaper, Redis on a PVC, RBAC,
NetworkPolicies, PDBs, the sandbox namespace, a tenants file with one tenant, the API's
metrics port behind its headless Service), with small requests so that it fits one
2-core node beside its sandboxes. Two things differ from an install on a supported
cluster, both because this one is 1.20: the chart's ``kubeVersion`` floor (1.30) is lifted
in the test's copy of the chart, and the PDBs are served at ``policy/v1beta1`` (the chart
picks the version the cluster serves). NetworkPolicies are admitted and not enforced (no
policy engine in Debian's CNI plugins).

And the chart's Sentinel mode: three Redis pods and their Sentinels, found through the
cluster DNS by their StatefulSet names, the primary hung under a trainer's rollouts.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from lightkube import ALL_NS, ApiError
from lightkube.models.core_v1 import HostPathVolumeSource, PersistentVolumeSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import (
    ConfigMap,
    Endpoints,
    PersistentVolume,
    PersistentVolumeClaim,
    Pod,
    Secret,
    Service,
    ServiceAccount,
)
from lightkube.resources.networking_v1 import NetworkPolicy
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding
from redis.sentinel import Sentinel

from orchestrator.client import RolloutClient
from orchestrator.config import Settings
from orchestrator.environments.examples import REQUESTS_CODEBASE, ensure_requests_codebase
from orchestrator.environments.loader import default_environments_text
from orchestrator.state.pool_sizing import POOL_LABEL
from orchestrator.tenants import digest
from tests.e2e.helpers import file_f1, function_call, new_trace, wait_for
from tests.k8s.control_plane import ControlPlane
from tests.k8s.node import RealNode

# test_real_node.py says why this group.
pytestmark = pytest.mark.xdist_group("real-node")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "orchestrator"
BIN = REPO / ".venv" / "bin"
RELEASE = "orch"
NAMESPACE = "orch-system"
SANDBOXES = "orch-sandboxes"
FULLNAME = f"{RELEASE}-orchestrator"
TOKEN = "helm-token-" + uuid.uuid4().hex[:12]
# A tenant's (the tenants file holds its digest only): sees its own rollouts, not the
# operator's.
TENANT_TOKEN = "helm-tenant-" + uuid.uuid4().hex
GOLD = ["src/requests/sessions.py", "src/requests/adapters.py"]
# Every workload Ready: image start, Python imports, the worker's first heartbeat and its
# readiness probe (every 15 s). Measured about 40 s here.
READY_TIMEOUT_S = 240.0
SENTINEL_SERVICE = "orchestrator"  # the chart's redis.bundled.sentinel.service
SMALL = {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}


def service_images() -> tuple[str, str]:
    """The chart's two images on this machine's dockerd: `make test` builds them
    (scripts/service-images.sh) before the suite; run alone, the test builds what is
    missing."""
    import docker

    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    wanted = (f"orchestrator/orchestrator:{version}", "orchestrator/redis:7.0")
    client = docker.from_env()
    try:
        present = all(client.images.list(name=image) for image in wanted)
    finally:
        client.close()
    if not present:
        built = subprocess.run(
            [str(REPO / "scripts" / "service-images.sh")],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert built.returncode == 0, built.stderr[-4000:]
    return wanted


class Cluster:
    """The control plane, its node, a kubeconfig for helm and kubectl, and the chart's
    copy this cluster accepts."""

    def __init__(self, plane: ControlPlane, node: RealNode, root: Path) -> None:
        self.plane = plane
        self.node = node
        self.admin = plane.client(namespace=NAMESPACE)
        self.kubeconfig = root / "kubeconfig"
        self.kubeconfig.write_text(json.dumps(plane.kubeconfig_for("admin", NAMESPACE)))
        self.chart = root / "chart"
        shutil.copytree(CHART, self.chart)
        meta = self.chart / "Chart.yaml"
        # The one edit: this cluster is 1.20, below the chart's supported floor.
        meta.write_text(
            re.sub(r"(?m)^kubeVersion:.*$", 'kubeVersion: ">=1.20.0-0"', meta.read_text())
        )
        self.env = {
            "PATH": f"{BIN}:{os.environ['PATH']}",
            "HOME": str(root),
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(root / "helm-cache"),
            "HELM_CONFIG_HOME": str(root / "helm-config"),
            "HELM_DATA_HOME": str(root / "helm-data"),
        }

    def run(self, *command: str, timeout: float = 300) -> str:
        done = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def helm(self, *args: str, timeout: float = 300) -> str:
        try:
            return self.run(str(BIN / "helm"), *args, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None

    def describe(self) -> str:
        """What a failed wait needs: each pod's phase, conditions and container states,
        and the namespace's events."""
        lines = []
        for namespace in (NAMESPACE, SANDBOXES):
            with contextlib.suppress(ApiError):
                for pod in self.pods(namespace):
                    status = pod.status
                    if pod.metadata is None or status is None:
                        continue
                    conditions = [(c.type, c.status, c.reason) for c in status.conditions or []]
                    states = [
                        (c.name, c.ready, c.restartCount, c.state)
                        for c in status.containerStatuses or []
                    ]
                    lines.append(f"{pod.metadata.name}: {status.phase} {conditions} {states}")
                    if namespace == NAMESPACE and not all(
                        c.ready for c in status.containerStatuses or []
                    ):
                        # An unready process's own account (its last lines, and the ones
                        # before a restart).
                        for previous in ("--previous=false", "--previous=true"):
                            done = subprocess.run(
                                ["kubectl", "-n", namespace, "logs", pod.metadata.name or "",
                                 "--tail=40", previous],
                                env=self.env, capture_output=True, text=True, timeout=30,
                                check=False,
                            )  # fmt: skip
                            lines.append(done.stdout[-4000:] or done.stderr[-300:])
        events = self.run("kubectl", "get", "events", "-A", "--sort-by=.lastTimestamp")
        return "\n".join([*lines, events[-6000:]])

    def shell(self, line: str, timeout: float = 120) -> str:
        """One of NOTES.txt's command lines, as printed, in a shell."""
        return self.run("bash", "-o", "pipefail", "-c", line, timeout=timeout)

    def pods(self, namespace: str) -> list[Pod]:
        return list(self.admin.list(Pod, namespace=namespace))

    def trainer(self) -> httpx.Client:
        """An HTTP client of the API as the trainer holds one: its token, its patience."""
        return httpx.Client(
            base_url=self.api_url(),
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=httpx.Timeout(180.0),
            trust_env=False,
        )

    def redis_password(self) -> str:
        secret = self.admin.get(Secret, f"{FULLNAME}-secrets", namespace=NAMESPACE)
        return base64.b64decode((secret.data or {})["redis-password"]).decode()

    def api_url(self) -> str:
        """The API through its Service's ClusterIP (kube-proxy's rules on this host)."""
        service = self.admin.get(Service, f"{FULLNAME}-api", namespace=NAMESPACE)
        assert service.spec is not None and service.spec.ports
        return f"http://{service.spec.clusterIP}:{service.spec.ports[0].port}"

    def api_scrape_urls(self) -> list[str]:
        """The API's /metrics as the ServiceMonitor finds them: each address and port of
        its headless metrics Service's Endpoints (pod addresses, routed to from this host)."""
        found = self.admin.get(Endpoints, f"{FULLNAME}-api-metrics", namespace=NAMESPACE)
        return [
            f"http://{address.ip}:{port.port}/metrics"
            for subset in found.subsets or []
            for address in subset.addresses or []
            for port in subset.ports or []
        ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    service_images()
    with (
        ControlPlane(namespaces=(), pod_network=True) as plane,
        RealNode(plane, services=True) as node,
    ):
        made = Cluster(plane, node, tmp_path_factory.mktemp("helm"))
        try:
            yield made
        finally:
            made.admin.close()


def values(
    settings: Settings, requests_image: str, *, sentinel: bool = False, **changed: Any
) -> dict[str, Any]:
    """The release's values: small requests, the local images, ``changed`` settings;
    ``sentinel``: Redis as a primary, two replicas and a Sentinel beside each."""
    environments = yaml.safe_load(default_environments_text())
    for environment in environments["environments"]:
        if environment["name"] == "codebase-planning":
            # The reaper ends graded rollouts within a test's patience.
            environment.update(idle_timeout_s=120, grace_after_grade_s=2)
    return {
        "deployment": settings.deployment,
        "apiTokens": {"tokens": [TOKEN]},
        "tenants": {"file": {"tenants": {"team-a": {"tokens": [digest(TENANT_TOKEN)]}}}},
        "codebases": {REQUESTS_CODEBASE: requests_image},
        "environments": environments,
        "settings": {
            "log_format": "json",
            "sandbox_create_timeout_s": 120,
            # A quarter of a core each (a sandbox's requests are its limits): the node has
            # two, and the release's own pods request some.
            "sandbox_cpus": 0.25,
            "reaper_interval_s": 1.0,
            **changed,
        },
        "api": {"replicas": 1, "resources": SMALL},
        "worker": {
            "replicas": 1,
            "resources": SMALL,
            "shutdownGraceSeconds": 20,
            "terminationExtraSeconds": 10,
        },
        "reaper": {"replicas": 1, "resources": SMALL},
        "redis": {
            "bundled": {
                "image": {"repository": "orchestrator/redis", "tag": "7.0"},
                "resources": SMALL,
                "persistence": {"size": "256Mi"},
                "sentinel": {"enabled": sentinel, "resources": SMALL},
            }
        },
        "sandboxes": {"namespace": SANDBOXES, "pendingTimeoutSeconds": 90},
    }


def redis_volume(cluster: Cluster) -> str:
    """A PersistentVolume for the Redis PVC to bind (this cluster has no provisioner): a
    directory of the node's, as a local-path provisioner would make."""
    name = f"pv-redis-{uuid.uuid4().hex[:6]}"
    path = cluster.node.root / name
    path.mkdir(mode=0o777)
    path.chmod(0o777)  # Redis runs as uid 999; a hostPath volume takes no fsGroup
    cluster.admin.create(
        PersistentVolume(
            metadata=ObjectMeta(name=name),
            spec=PersistentVolumeSpec(
                capacity={"storage": "256Mi"},
                accessModes=["ReadWriteOnce"],
                persistentVolumeReclaimPolicy="Retain",
                hostPath=HostPathVolumeSource(path=str(path), type="Directory"),
            ),
        )
    )
    return name


def all_ready(cluster: Cluster, namespace: str) -> Callable[[], bool]:
    def check() -> bool:
        pods = cluster.pods(namespace)
        return bool(pods) and all(
            p.status is not None
            and p.metadata is not None
            and p.metadata.deletionTimestamp is None
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            for p in pods
        )

    return check


def sandbox_pods(cluster: Cluster) -> dict[str, str]:
    """Each sandbox pod's name and rollout label (``POOL_LABEL`` for a warm pool's)."""
    return {
        p.metadata.name: (p.metadata.labels or {}).get("orchestrator.rollout", "")
        for p in cluster.pods(SANDBOXES)
        if p.metadata and p.metadata.name
    }


def agent_rft_rollout(client: httpx.Client, item: dict[str, Any]) -> tuple[str, float]:
    """One Agent RFT rollout as the trainer runs it: tool calls, then the grade."""
    trace = new_trace()
    for command in ("rg -l 'def send' src", "id -u; pwd"):
        called = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": command})
        )
        assert called.status_code == 200, called.text
    answer = "Files to edit:\n" + "\n".join(f"- {path}" for path in GOLD)
    graded = client.post(
        "/agent-rft/grade",
        json={"sample": {"output_text": answer}, "item": item, "trace_id": trace},
    )
    assert graded.status_code == 200, graded.text
    return trace, float(graded.json()["score"])


@pytest.mark.timeout(900)
def test_helm_install_a_trainers_rollouts_upgrade_and_uninstall(
    cluster: Cluster, settings: Settings, base_image: str
) -> None:
    requests_image = ensure_requests_codebase(settings)
    volume = redis_volume(cluster)
    values_file = cluster.chart.parent / "values.yaml"
    values_file.write_text(yaml.safe_dump(values(settings, requests_image)))
    item = {"codebase": REQUESTS_CODEBASE, "prompt": "Find the send methods.", "gold_files": GOLD}
    try:
        # -- install -------------------------------------------------------------------------
        notes = install(cluster, values_file)
        kinds = {
            (p.metadata.labels or {}).get("app.kubernetes.io/component")
            for p in cluster.pods(NAMESPACE)
            if p.metadata
        }
        assert kinds == {"api", "worker", "reaper", "redis"}
        claim = cluster.admin.get(PersistentVolumeClaim, f"data-{FULLNAME}-redis-0")
        assert claim.status is not None and claim.status.phase == "Bound"
        assert claim.spec is not None and claim.spec.volumeName == volume

        # NOTES.txt's commands, as printed: the token, the worker's rollout, readiness.
        token_line = _line_after(notes, "TOKEN (the bearer token")
        assert cluster.shell(token_line).strip() == TOKEN
        cluster.shell(_line_starting(notes, "kubectl", "rollout status"), timeout=120)
        assert f"{FULLNAME}-api.{NAMESPACE}.svc" in notes

        # -- a trainer's rollouts through the Service ----------------------------------------
        with cluster.trainer() as client:
            ready = client.get("/readyz")
            assert ready.status_code == 200 and ready.json()["ready"], ready.text
            scores = [agent_rft_rollout(client, item) for _ in range(2)]
            expected = file_f1("\n".join(GOLD), item)
            assert [score for _, score in scores] == [pytest.approx(expected)] * 2
            assert expected == 1.0
            for trace, _ in scores:
                record = client.get(f"/v1/rollouts/{trace}").json()
                assert record["state"] in ("graded", "closed"), record
            # The tenant's token, known to the API through the mounted tenants file: the
            # operator's rollout does not exist for it.
            operators = f"/v1/rollouts/{scores[0][0]}"
            assert client.get(operators).status_code == 200
            tenant = {"Authorization": f"Bearer {TENANT_TOKEN}"}
            hidden = client.get(operators, headers=tenant)
            assert hidden.status_code == 404, hidden.text
            # /metrics on the API's Service is the operator's; the scraper's needs no token,
            # on the metrics port, reached as Prometheus reaches it.
            assert client.get("/metrics").status_code == 200
            assert client.get("/metrics", headers=tenant).status_code == 404
            anonymous = httpx.get(f"{cluster.api_url()}/metrics", timeout=30, trust_env=False)
            assert anonymous.status_code == 401, anonymous.text
            scrape_urls = cluster.api_scrape_urls()
            assert scrape_urls
            for url in scrape_urls:
                scraped = httpx.get(url, timeout=30, trust_env=False)
                assert scraped.status_code == 200, (url, scraped.text)
                assert "orchestrator_rollouts_started_total" in scraped.text

        with RolloutClient(cluster.api_url(), TOKEN) as trainer:
            with trainer.rollout(
                environment="codebase-planning", codebase=REQUESTS_CODEBASE, item=item
            ) as rollout:
                sandboxes = sandbox_pods(cluster)
                sandbox_id = rollout.created.sandbox_id
                assert sandbox_id and any(name.endswith(sandbox_id) for name in sandboxes)
                found = rollout.call("shell", {"command": "grep -rln 'class Session' src"})
                assert (found.outcome, found.exit_code) == ("ok", 0)
                answer = json.dumps(GOLD)
                assert rollout.grade(answer=answer).score == pytest.approx(file_f1(answer, item))
            # A rollout left open across the upgrade: its sandbox outlives the worker's
            # restart (the StatefulSet's pod comes back under its name, its host).
            with trainer.rollout(
                environment="codebase-planning", codebase=REQUESTS_CODEBASE, item=item
            ) as survivor:
                before = survivor.call("shell", {"command": "echo kept > /workspace/mark"})
                assert before.outcome == "ok"
                phase = time.monotonic()
                upgrade(
                    cluster,
                    values_file,
                    values(settings, requests_image, sandbox_create_timeout_s=150),
                )
                print(f"helm upgrade to every pod Ready: {time.monotonic() - phase:.1f} s")
                after = survivor.call("shell", {"command": "cat /workspace/mark"})
                assert (after.outcome, after.output.strip()) == ("ok", "kept")
            assert trainer.get(survivor.id).state == "closed"

        with cluster.trainer() as client:
            _, score = agent_rft_rollout(client, item)
            assert score == pytest.approx(1.0)
            # Every graded rollout's pod goes (closed by the reaper); what stays is the
            # warm pool the deployment keeps (a pool pod has no rollout).
            wait_for(
                lambda: all(rollout == POOL_LABEL for rollout in sandbox_pods(cluster).values()),
                timeout_s=60,
                what="the graded rollouts' pods gone",
            )
    finally:
        # -- uninstall: nothing of the release is left ----------------------------------------
        phase = time.monotonic()
        uninstall(cluster, volume)
        print(f"helm uninstall to nothing left: {time.monotonic() - phase:.1f} s")


@pytest.mark.timeout(900)
def test_helm_install_with_sentinel_serves_on_after_its_redis_primary_hangs(
    cluster: Cluster, settings: Settings, base_image: str
) -> None:
    """The chart's Sentinel mode, installed: three Redis pods (a primary and two replicas)
    with a Sentinel beside each, found by their StatefulSet names through the cluster DNS;
    the API, the worker and the reaper reach Redis through the Sentinels. The primary's
    Redis is frozen (its container paused: a hung process, or a node cut off, not a crash
    that a restart would mend before the Sentinels look): the Sentinels promote a replica,
    every client follows, and the trainer's rollouts are scored again within a bound;
    every answer meanwhile is a 200 or a 5xx (the trainer retries those), never a 4xx or
    a wrong score. Thawed, the old primary is a replica of the new one."""
    requests_image = ensure_requests_codebase(settings)
    volumes = [redis_volume(cluster) for _ in range(3)]
    values_file = cluster.chart.parent / "values-sentinel.yaml"
    values_file.write_text(yaml.safe_dump(values(settings, requests_image, sentinel=True)))
    item = {"codebase": REQUESTS_CODEBASE, "prompt": "Find the send methods.", "gold_files": GOLD}
    try:
        install(cluster, values_file)
        password = cluster.redis_password()
        primary = sentinel_primary(cluster, password)
        assert primary.startswith(f"{FULLNAME}-redis-")
        with cluster.trainer() as client:
            assert agent_rft_rollout(client, item)[1] == pytest.approx(1.0)
            frozen = cluster.node.container(primary, "redis")
            frozen.pause()
            hung = time.monotonic()
            try:
                failed: list[int] = []
                # Each try: (seconds from the hang to its start, its length, its answers).
                tries: list[str] = []
                while True:
                    assert time.monotonic() - hung < FAILOVER_BOUND_S, (
                        f"no rollout scored {FAILOVER_BOUND_S} s after the primary hung; "
                        f"answers: {failed}; tries: {tries}\n{cluster.describe()}"
                    )
                    began = time.monotonic()
                    try:
                        statuses, score = try_rollout(client, item)
                    except httpx.TransportError:
                        # The API pod unready a moment (its readiness asks Redis): the
                        # Service has no endpoint, and the trainer tries again.
                        statuses, score = [UNREACHABLE], None
                    tries.append(
                        f"+{began - hung:.1f} s for {time.monotonic() - began:.1f} s: {statuses}"
                    )
                    if score is not None:
                        assert score == pytest.approx(1.0)
                        break
                    failed.extend(statuses[-1:])
                    time.sleep(1)
                served = time.monotonic() - hung
                promoted = sentinel_primary(cluster, password)
            finally:
                frozen.unpause()
            print(
                f"primary {primary} hung: a rollout scored again after {served:.1f} s; "
                f"answers before it: {failed}; new primary {promoted}; tries: {tries}"
            )
            assert all(status >= 500 or status == UNREACHABLE for status in failed), failed
            assert promoted != primary
            # Thawed, the old primary is told by the Sentinels to follow the new one.
            wait_for(
                lambda: redis_role(cluster, primary, password) == "slave",
                timeout_s=60,
                what="the old primary a replica",
            )
            wait_for(all_ready(cluster, NAMESPACE), timeout_s=120, what="every pod Ready again")
            assert agent_rft_rollout(client, item)[1] == pytest.approx(1.0)
    finally:
        phase = time.monotonic()
        uninstall(cluster, *volumes)
        print(f"helm uninstall (Sentinel) to nothing left: {time.monotonic() - phase:.1f} s")


UNREACHABLE = 0
"""A try the API's Service did not take (no ready endpoint), as the trainer sees it."""
FAILOVER_BOUND_S = 120.0
"""The Sentinels' down-after (5 s) and election, the clients' socket timeouts and their
asking the Sentinels again, with room for this loaded machine."""


def try_rollout(client: httpx.Client, item: dict[str, Any]) -> tuple[list[int], float | None]:
    """One Agent RFT rollout, stopped at the first answer that is not a 200: every
    answer's status, and the score if it was graded."""
    trace = new_trace()
    statuses: list[int] = []
    called = client.post(
        "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "true"})
    )
    statuses.append(called.status_code)
    if called.status_code != 200:
        return statuses, None
    answer = "Files to edit:\n" + "\n".join(f"- {path}" for path in GOLD)
    graded = client.post(
        "/agent-rft/grade",
        json={"sample": {"output_text": answer}, "item": item, "trace_id": trace},
    )
    statuses.append(graded.status_code)
    if graded.status_code != 200:
        return statuses, None
    return statuses, float(graded.json()["score"])


def _redis_pods(cluster: Cluster) -> list[Pod]:
    return [
        p
        for p in cluster.pods(NAMESPACE)
        if p.metadata is not None
        and (p.metadata.labels or {}).get("app.kubernetes.io/component") == "redis"
        and p.status is not None
        and p.status.podIP
    ]


def sentinel_primary(cluster: Cluster, password: str) -> str:
    """The pod the Sentinels name as the primary (asked at their pod IPs), by its name."""
    addresses = [
        (p.status.podIP, 26379) for p in _redis_pods(cluster) if p.status and p.status.podIP
    ]
    sentinels = Sentinel(addresses, sentinel_kwargs={"password": password, "socket_timeout": 3})
    try:
        host, _ = sentinels.discover_master(SENTINEL_SERVICE)
    finally:
        for sentinel in sentinels.sentinels:
            sentinel.close()
    return str(host).split(".")[0]


def redis_role(cluster: Cluster, pod_name: str, password: str) -> str:
    (pod,) = [p for p in _redis_pods(cluster) if p.metadata and p.metadata.name == pod_name]
    assert pod.status is not None and pod.status.podIP is not None
    client = redis.Redis(host=pod.status.podIP, port=6379, password=password, socket_timeout=3)
    try:
        return str(client.info("replication")["role"])
    except redis.RedisError:
        return ""
    finally:
        client.close()


def install(cluster: Cluster, values_file: Path) -> str:
    """``helm install --wait``, then every pod of the release Ready; NOTES.txt as printed."""
    started = time.monotonic()
    notes = cluster.helm(
        "install", RELEASE, str(cluster.chart), "--namespace", NAMESPACE,
        "--create-namespace", "--values", str(values_file), "--wait", "--timeout", "5m",
        timeout=READY_TIMEOUT_S + 120,
    )  # fmt: skip
    wait_for(all_ready(cluster, NAMESPACE), timeout_s=READY_TIMEOUT_S, what="every pod Ready")
    print(f"helm install to every pod Ready: {time.monotonic() - started:.1f} s")
    return notes


def upgrade(cluster: Cluster, values_file: Path, changed: dict[str, Any]) -> None:
    """``helm upgrade`` with a changed setting: the ConfigMap's checksum rolls the API, the
    worker and the reaper; Redis (its own pod template unchanged) stays."""
    old = {p.metadata.name: p.metadata.uid for p in cluster.pods(NAMESPACE) if p.metadata}
    values_file.write_text(yaml.safe_dump(changed))
    cluster.helm(
        "upgrade", RELEASE, str(cluster.chart), "--namespace", NAMESPACE,
        "--values", str(values_file), "--wait", "--timeout", "4m",
        timeout=READY_TIMEOUT_S + 60,
    )  # fmt: skip
    wait_for(all_ready(cluster, NAMESPACE), timeout_s=READY_TIMEOUT_S, what="upgraded pods Ready")
    config = cluster.admin.get(ConfigMap, f"{FULLNAME}-config", namespace=NAMESPACE)
    assert (config.data or {}).get("ORCH_SANDBOX_CREATE_TIMEOUT_S") == "150"
    now = {p.metadata.name: p.metadata.uid for p in cluster.pods(NAMESPACE) if p.metadata}
    redis = f"{FULLNAME}-redis-0"
    assert old.get(redis) == now[redis], "Redis is not restarted by a settings change"
    rolled = set(now) - {redis}
    assert len(rolled) == 3 and all(old.get(name) != now[name] for name in rolled), (old, now)


def uninstall(cluster: Cluster, *volumes: str) -> None:
    cluster.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "3m")
    # The StatefulSet's claim outlives it (Kubernetes keeps a StatefulSet's PVCs):
    # docs/kubernetes.md's uninstall deletes it, as here.
    cluster.shell(
        f"kubectl -n {NAMESPACE} delete pvc -l app.kubernetes.io/instance={RELEASE} --wait"
    )

    leftovers: dict[str, Any] = {}

    def nothing_left() -> bool:
        left = [
            p.metadata.name
            for p in cluster.admin.list(Pod, namespace=ALL_NS)
            if p.metadata and p.metadata.namespace in (NAMESPACE, SANDBOXES)
        ]
        secrets = [
            f"{s.metadata.namespace}/{s.metadata.name}"
            for namespace in (NAMESPACE, SANDBOXES)
            for s in cluster.admin.list(Secret, namespace=namespace)
            if s.metadata and s.type != "kubernetes.io/service-account-token"
        ]
        claims = list(cluster.admin.list(PersistentVolumeClaim, namespace=NAMESPACE))
        kept = [
            f"{kind.__name__}/{name}"
            for kind in (Service, ConfigMap, StatefulSet, Deployment, Job, ServiceAccount)
            for namespace in (NAMESPACE, SANDBOXES)
            for name in _names(cluster.admin.list(kind, namespace=namespace))
            if name not in ("kube-root-ca.crt", "default")
        ]
        kept += [
            f"{kind.__name__}/{name}"
            for kind in (Role, RoleBinding, NetworkPolicy)
            for name in _names(cluster.admin.list(kind, namespace=SANDBOXES))
        ]
        leftovers.update(pods=left, secrets=secrets, claims=_names(claims), objects=kept)
        return not any(leftovers.values())

    try:
        wait_for(nothing_left, timeout_s=120, what="the release gone")
    except AssertionError as exc:
        raise AssertionError(f"left after helm uninstall: {leftovers}") from exc
    cluster.node.settle()
    assert [c.name for c in cluster.node.containers()] == []
    for volume in volumes:
        with contextlib.suppress(ApiError):
            cluster.admin.delete(PersistentVolume, volume)


def _names(objects: Any) -> list[str]:
    return [o.metadata.name for o in objects if o.metadata is not None]


def _line_after(notes: str, heading: str) -> str:
    """The command printed under ``heading`` in NOTES.txt (its continuation lines joined)."""
    lines = notes.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    command: list[str] = []
    for line in lines[start + 1 :]:
        if not line.strip():
            if command:
                break
            continue
        command.append(line.strip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(command)


def _line_starting(notes: str, *words: str) -> str:
    for line in notes.splitlines():
        stripped = line.strip()
        if stripped.startswith(words[0]) and all(w in stripped for w in words):
            return stripped
    raise AssertionError(f"no line with {words} in NOTES:\n{notes}")
