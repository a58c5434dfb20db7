"""A test kubelet: the one part of a node the real control plane of control_plane.py lacks,
written here as a real client of the real API server.

It authenticates as its node (``system:node:test-node``, so the Node authorizer and the
NodeRestriction admission plugin judge each of its requests as they judge a kubelet's),
registers its Node, watches the pods the real scheduler binds to it, and runs each as real
Docker containers on the local daemon, reporting through ``pods/status``:

- the pod's image, command, uid/gid and ``fsGroup``, read-only root, capabilities dropped,
  no new privileges, memory and CPU limits; the Secret's keys as read-only files where the
  pod mounts them (read through the API as the node, which the Node authorizer allows only
  for pods bound to it); ``emptyDir`` volumes as Docker volumes (tmpfs for
  ``medium: Memory``); the init container run first, on the shared workspace volume;
  readiness as a TCP connect to the probe's port, as the kubelet's ``tcpSocket`` probe;
- a deletion as a kubelet does it: the API server sets ``deletionTimestamp``, the kubelet
  stops the containers and confirms with a delete of grace 0 (uid precondition).

Not a kubelet, and said so:

- no registry: an image missing from the local daemon fails as a pull does (``ErrImagePull``,
  then ``ImagePullBackOff``); only the ``runc`` handler (a RuntimeClass of another handler is
  admitted by the API server, then run as runc);
- no CNI and no NetworkPolicy: the main container shares the host's network (Docker's host
  networking), so every connection to a pod stays on loopback, where tests may send traffic
  (never to a bridge address, which CI may not route). Each pod gets an address of its own
  in 127.0.0.0/8 (``loopback.claim``); the kubelet rewrites the agent's
  ``--listen tcp:0.0.0.0:PORT`` to it, reports it as ``status.podIP`` and probes it there;
  ``hand_out`` gives a chosen address to the next pod, as a CNI reuses a terminated pod's
  IP. So the sandbox is not network-isolated in these tests (it can reach the host's
  loopback; the init container has no network) and no test may rely on it being so;
- no evictions (a disk-backed emptyDir past its ``sizeLimit`` included: the real node's
  kubelet evicts, in the modules of group ``real-node``), no ``activeDeadlineSeconds``;
  each pod capped at ``POD_PIDS_LIMIT`` processes, as a kubelet's ``podPidsLimit``; on
  cgroup v1 (no ``memory.oom.group``) an OOM kill in a
  container kills the whole container, as Kubernetes >= 1.28 does on cgroup v2;
- a lost node is played per pod (``lose_node``): the kubelet stops reporting for it, and the
  test does, as an administrator, what the node lifecycle controller's taint manager would.

Every Docker container and volume it makes carries the labels the suite's leak check reads
(``orchestrator.managed``, ``orchestrator.deployment`` = ``docker_deployment``), and it
removes them when a pod goes and when it is closed.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import itertools
import json
import os
import shutil
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import docker
import httpx
from docker.errors import ImageNotFound, NotFound
from docker.models.containers import Container
from docker.types import Mount
from lightkube import Client

from orchestrator.sandbox import labels
from tests.k8s import loopback
from tests.k8s.control_plane import NODE_NAME, ControlPlane
from tests.k8s.rbac import RELEASE_NAMESPACE, SANDBOX_NAMESPACE, apply_worker_rbac

Obj = dict[str, Any]
MountKind = Literal["bind", "volume"]

NODE_IP = "127.0.0.1"
NODE_LABELS = {"kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux"}
# What the node offers the scheduler: room for every pod a test makes (the containers'
# own limits are what bounds them on this machine).
NODE_CAPACITY = {"cpu": "64", "memory": "256Gi", "pods": "1000", "ephemeral-storage": "500Gi"}
POD_UID_LABEL = "test-kubelet.pod-uid"
POD_NAME_LABEL = "test-kubelet.pod"
PROBE_PERIOD_S = 0.2
POD_PIDS_LIMIT = 1024
"""Each pod's processes: the real node's default ``podPidsLimit`` too (node.py)."""
PULL_BACKOFF_S = 0.5
SECRET_MISSING_EVENT_S = 2.0
WATCH_TIMEOUT_S = 30
# A status update the API server could not take (away, or up and not serving yet, as while
# it restarts) is sent again after this long, as a kubelet's status manager does.
STATUS_RETRY_S = 0.2
SERVER_NOT_READY = frozenset({429, 500, 503})
_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9}


def timestamp(at: datetime | None = None) -> str:
    """RFC 3339 in seconds, as the API server writes its timestamps."""
    return (at or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def quantity(text: str) -> float:
    """A Kubernetes quantity ("512Mi", "500m", "2") as a number."""
    for suffix, factor in _QUANTITY.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(text)


class ApiError(Exception):
    """The API server refused a request (its Status code and message)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Api:
    """A small JSON client of the API server over TLS with a client certificate: what the
    kubelet and the tests' own reads need, on plain dicts."""

    def __init__(self, plane: ControlPlane, user: str) -> None:
        pki = plane.pki
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / f"{user}.crt"), str(pki / f"{user}.key"))
        self.http = httpx.Client(
            base_url=plane.url, verify=context, timeout=httpx.Timeout(10.0), trust_env=False
        )

    def request(self, method: str, path: str, body: Obj | None = None, **params: Any) -> Obj:
        response = self.http.request(
            method, path, json=body, params={k: v for k, v in params.items() if v is not None}
        )
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise ApiError(response.status_code, message)
        found: Obj = response.json()
        return found

    def get(self, path: str) -> Obj | None:
        try:
            return self.request("GET", path)
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def watch(self, path: str, **params: Any) -> Iterator[Obj]:
        """One watch request's events, until the server closes it."""
        query = {"watch": "true", "timeoutSeconds": WATCH_TIMEOUT_S, **params}
        timeout = httpx.Timeout(10.0, read=WATCH_TIMEOUT_S + 10)
        with self.http.stream("GET", path, params=query, timeout=timeout) as response:
            if response.status_code >= 400:
                raise ApiError(response.status_code, response.read().decode(errors="replace"))
            for line in response.iter_lines():
                if line.strip():
                    yield json.loads(line)

    def close(self) -> None:
        self.http.close()


def pod_path(namespace: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")


@dataclass
class PodRun:
    """One pod on the node: the kubelet's thread and what it knows."""

    namespace: str
    name: str
    uid: str
    deleted: threading.Event = field(default_factory=threading.Event)
    node_lost: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    main: Container | None = None


class TestCluster:
    """A cluster of one node: a real control plane of its own (``plane``) and the test
    kubelet of its node (its registration, its pods' lives), with what tests look at
    behind the backend's back (through the real API server, as an administrator)."""

    __test__ = False  # not a test class, whatever pytest thinks of the name

    def __init__(
        self,
        docker_client: docker.DockerClient,
        *,
        docker_deployment: str,
        runtime_classes: tuple[str, ...] = (),
        namespaces: tuple[str, ...] = (RELEASE_NAMESPACE, SANDBOX_NAMESPACE),
    ) -> None:
        self.plane = plane = ControlPlane(namespaces=namespaces).start()
        self.docker = docker_client
        self.docker_deployment = docker_deployment
        self.api = Api(plane, "node")  # the kubelet's own identity
        self.admin = Api(plane, "admin")  # the tests', and the controllers' they play
        self.runs: dict[str, PodRun] = {}
        self.runs_lock = threading.Lock()
        self.next_addresses: list[str] = []  # under runs_lock
        self.closed = threading.Event()
        self.scratch = Path(tempfile.mkdtemp(prefix="orch-test-kubelet-"))
        try:
            self._register(runtime_classes)
            self.worker_user, self.worker_token = apply_worker_rbac(self.admin)
        except BaseException:
            plane.close()
            raise
        self._watching = threading.Thread(target=self._watch_pods, name="kubelet", daemon=True)
        self._watching.start()

    # -- clients ---------------------------------------------------------------------------

    def kubeconfig(self, namespace: str = SANDBOX_NAMESPACE) -> Obj:
        """A kubeconfig of this API server as the chart's worker (its ServiceAccount's
        token, bound by the chart's Role: rbac.py)."""
        return self.plane.kubeconfig_for("worker", namespace, token=self.worker_token)

    def client(self, namespace: str = SANDBOX_NAMESPACE) -> Client:
        """A lightkube client of this API server, as the chart's worker."""
        return self.plane.client("worker", namespace, token=self.worker_token)

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, request URI) of every request the worker made that the API server
        completed (its audit log), in the HTTP method names a client sends."""
        methods = {"get": "GET", "list": "GET", "watch": "GET", "create": "POST"}
        methods |= {"update": "PUT", "patch": "PATCH", "delete": "DELETE"}
        return [
            (methods.get(verb, verb.upper()), uri)
            for user, verb, uri in self.plane.requests()
            if user == self.worker_user
        ]

    # -- looking behind the backend's back -------------------------------------------------

    def read(self, plural: str, name: str, namespace: str = SANDBOX_NAMESPACE) -> Obj | None:
        return self.admin.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")

    def names(self, plural: str, namespace: str = SANDBOX_NAMESPACE) -> set[str]:
        found = self.admin.request("GET", f"/api/v1/namespaces/{namespace}/{plural}")
        return {obj["metadata"]["name"] for obj in found.get("items") or []}

    def wait_gone(
        self, plural: str, name: str, namespace: str = SANDBOX_NAMESPACE, timeout_s: float = 30
    ) -> None:
        """Until the object is gone from the API (a garbage collector's or kubelet's work
        is asynchronous); AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.read(plural, name, namespace) is not None:
            assert time.monotonic() < deadline, f"{plural}/{name} still there"
            time.sleep(0.1)

    def docker_objects(self, pod_name: str | None = None) -> list[str]:
        """Containers and volumes the kubelet made (of one pod, or all) that still exist."""
        selector = [f"{labels.DEPLOYMENT}={self.docker_deployment}"]
        if pod_name is not None:
            selector.append(f"{POD_NAME_LABEL}={pod_name}")
        found = [
            f"container {c.name}"
            for c in self.docker.containers.list(all=True, filters={"label": selector})
        ]
        volumes = self.docker.volumes.list(filters={"label": selector})
        return found + [f"volume {v.name}" for v in volumes]

    def main_container(self, pod_name: str) -> Container:
        with self.runs_lock:
            run = next(r for r in self.runs.values() if r.name == pod_name)
        assert run.main is not None, f"pod {pod_name} has no running container"
        return run.main

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait until the kubelet has torn down every pod that is gone from the API;
        AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        # Gone by the API, not by what the kubelet has seen: a delete the caller just made
        # may not have reached the kubelet's watch yet, and its pod must be waited for too.
        listed = self.admin.request("GET", "/api/v1/pods")
        live = {pod["metadata"]["uid"] for pod in listed.get("items") or []}
        with self.runs_lock:
            gone = [r for r in self.runs.values() if r.deleted.is_set() or r.uid not in live]
        for run in gone:
            if run.thread is not None:
                run.thread.join(max(0.0, deadline - time.monotonic()))
                assert not run.thread.is_alive(), f"the kubelet still tears down pod {run.name}"

    def wait_for_pod(self, name: str, check: Callable[[Obj], bool], timeout_s: float = 30.0) -> Obj:
        """The pod once ``check`` holds for it (raises AssertionError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pod = self.read("pods", name)
            if pod is not None and check(pod):
                return pod
            assert time.monotonic() < deadline, f"pod {name} never got there: {pod}"
            time.sleep(0.05)

    # -- faults ----------------------------------------------------------------------------

    def kill(self, pod_name: str) -> None:
        """SIGKILL the pod's main container, as a runtime or a person on the node would."""
        self.main_container(pod_name).kill()

    def lose_node(self, pod_name: str) -> None:
        """The node stops answering for this pod: its containers freeze (its IP accepts
        connections that nobody answers), its kubelet stops reporting, and the control plane
        does what the taint manager does after the toleration (played here, as an
        administrator, through the API): Ready=False, DisruptionTarget, a graceful deletion
        that the lost kubelet never confirms."""
        with self.runs_lock:
            run = next(r for r in self.runs.values() if r.name == pod_name)
        run.node_lost.set()
        if run.main is not None:
            run.main.pause()

        def lost(pod: Obj) -> None:
            conditions = [c for c in pod["status"].get("conditions", []) if c["type"] != "Ready"]
            conditions += [
                _condition("Ready", "False", "NodeNotReady", "the node stopped reporting"),
                _condition(
                    "DisruptionTarget",
                    "True",
                    "DeletionByTaintManager",
                    "Taint manager: deleting due to NoExecute taint",
                ),
            ]
            pod["status"]["conditions"] = conditions

        update_status(self.admin, run.namespace, run.name, run.uid, lost)
        self.admin.request(
            "DELETE",
            pod_path(run.namespace, run.name),
            {"gracePeriodSeconds": 1, "preconditions": {"uid": run.uid}},
        )

    def hand_out(self, address: str) -> None:
        """The next pod to start gets ``address`` as its IP, as a CNI hands a terminated
        pod's address to a new pod (its kubelet fails the pod if the address is still held)."""
        with self.runs_lock:
            self.next_addresses.append(address)

    def expire_watches(self) -> None:
        """etcd compacts its history: a watch from any resourceVersion read before now gets
        410 Gone from the API server."""
        self.plane.compact()

    # -- the node --------------------------------------------------------------------------

    def _register(self, runtime_classes: tuple[str, ...]) -> None:
        """The Node as a kubelet registers it (as the node), Ready; then, as the node
        lifecycle controller would once it reports Ready, its not-ready taint lifted."""
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": NODE_NAME, "labels": NODE_LABELS},
        }
        with contextlib.suppress(ApiError):  # a second kubelet of the same plane
            self.api.request("POST", "/api/v1/nodes", node)
        now = timestamp()

        def ready(found: Obj) -> None:
            found["status"] = {
                "capacity": NODE_CAPACITY,
                "allocatable": NODE_CAPACITY,
                "addresses": [
                    {"type": "InternalIP", "address": NODE_IP},
                    {"type": "Hostname", "address": NODE_NAME},
                ],
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": "v1.20.2",
                    "kubeProxyVersion": "v1.20.2",
                    "containerRuntimeVersion": "docker://local",
                    "bootID": "",
                    "kernelVersion": os.uname().release,
                    "machineID": "",
                    "osImage": "test kubelet",
                    "systemUUID": "",
                },
            }

        _read_modify_write(self.api, f"/api/v1/nodes/{NODE_NAME}", ready, "status")

        def untainted(found: Obj) -> None:
            found["spec"]["taints"] = []

        _read_modify_write(self.admin, f"/api/v1/nodes/{NODE_NAME}", untainted)
        for handler in runtime_classes:
            body = {
                "apiVersion": "node.k8s.io/v1",
                "kind": "RuntimeClass",
                "metadata": {"name": handler},
                "handler": handler,
            }
            with contextlib.suppress(ApiError):
                self.admin.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", body)

    def _watch_pods(self) -> None:
        """Every pod bound to this node: start its run when it appears, tell it when the
        API server marks it for deletion or it is gone."""
        version: str | None = None
        bound: dict[str, Any] = {"fieldSelector": f"spec.nodeName={NODE_NAME}"}
        while not self.closed.is_set():
            try:
                if version is None:
                    listed = self.api.request("GET", "/api/v1/pods", **bound)
                    version = listed["metadata"]["resourceVersion"]
                    items = listed.get("items") or []
                    for pod in items:
                        self._seen("ADDED", pod)
                    # A pod deleted while the watch was down (a restart, a 410) sent no
                    # DELETED event to this kubelet: gone from the list is gone.
                    self._forget_missing({pod["metadata"]["uid"] for pod in items})
                for event in self.api.watch("/api/v1/pods", resourceVersion=version, **bound):
                    if event["type"] == "ERROR":
                        version = None  # 410 (a compaction): list again
                        break
                    pod = event["object"]
                    version = pod["metadata"]["resourceVersion"]
                    self._seen(event["type"], pod)
            except (httpx.HTTPError, ApiError):
                # The API server is down or restarting: a kubelet retries, keeps its pods.
                if self.closed.wait(0.5):
                    return
                version = None

    def _forget_missing(self, listed: set[str]) -> None:
        with self.runs_lock:
            missing = [run for uid, run in self.runs.items() if uid not in listed]
        for run in missing:
            run.deleted.set()

    def _seen(self, kind: str, pod: Obj) -> None:
        meta = pod["metadata"]
        with self.runs_lock:
            run = self.runs.get(meta["uid"])
            if run is None and kind != "DELETED" and not meta.get("deletionTimestamp"):
                run = PodRun(meta["namespace"], meta["name"], meta["uid"])
                run.thread = threading.Thread(
                    target=_Kubelet(self, run, pod).run,
                    name=f"kubelet-{meta['name']}",
                    daemon=True,
                )
                self.runs[run.uid] = run
                run.thread.start()
                return
        if run is None:
            return
        if kind == "DELETED" or (meta.get("deletionTimestamp") and not run.node_lost.is_set()):
            run.deleted.set()  # the kubelet kills the containers, then confirms the deletion

    def event(self, pod: Obj, reason: str, message: str, kind: str = "Normal") -> None:
        meta = pod["metadata"]
        now = timestamp()
        body = {
            # Named as the recorders name events: in time order.
            "metadata": {"name": f"{meta['name']}.{time.time_ns():x}"},
            "involvedObject": {
                "kind": "Pod",
                "apiVersion": "v1",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": NODE_NAME},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        with contextlib.suppress(ApiError, httpx.HTTPError):
            self.api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/events", body)

    def close(self) -> None:
        """Stop the kubelet (every pod's containers and volumes are removed), then the
        control plane."""
        self.closed.set()
        with self.runs_lock:
            runs = list(self.runs.values())
        for run in runs:
            run.deleted.set()
        for run in runs:
            if run.thread is not None:
                run.thread.join(60)
        _remove_labelled(self.docker, [f"{labels.DEPLOYMENT}={self.docker_deployment}"])
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.plane.close()  # which also ends the kubelet's watch
        self._watching.join(WATCH_TIMEOUT_S + 15)
        self.api.close()
        self.admin.close()

    def __enter__(self) -> TestCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_modify_write(
    api: Api, path: str, change: Callable[[Obj], None], subresource: str = ""
) -> Obj | None:
    """GET the object, change it, PUT it (or its ``subresource``, which a kubelet may
    write but not read) with the read's resourceVersion; again on a conflict (409). None
    when the object is gone."""
    while True:
        found = api.get(path)
        if found is None:
            return None
        change(found)
        try:
            return api.request("PUT", f"{path}/{subresource}" if subresource else path, found)
        except ApiError as exc:
            if exc.code != 409:
                raise


def update_status(
    api: Api, namespace: str, name: str, uid: str, change: Callable[[Obj], None]
) -> Obj | None:
    """Apply ``change`` to the pod's status if it is still the pod with ``uid``."""

    def mine(pod: Obj) -> None:
        if pod["metadata"]["uid"] != uid:
            raise _NotMine
        pod.setdefault("status", {})
        change(pod)

    with contextlib.suppress(_NotMine):
        return _read_modify_write(api, pod_path(namespace, name), mine, "status")
    return None


class _NotMine(Exception):
    """The pod of that name is another one now (same name, new uid)."""


def _all(obj: Obj) -> bool:
    return True


def _owned_by(obj: Obj, uid: str) -> bool:
    return any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])


def _condition(
    kind: str, status: str, reason: str | None = None, message: str | None = None
) -> Obj:
    found: Obj = {
        "type": kind,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": timestamp(),
    }
    if reason:
        found["reason"] = reason
    if message:
        found["message"] = message
    return found


def _remove_labelled(client: docker.DockerClient, selector: list[str]) -> None:
    for container in client.containers.list(all=True, filters={"label": selector}):
        with contextlib.suppress(NotFound):
            if container.status == "paused":
                container.unpause()  # a frozen container may ignore the kill
            container.remove(force=True, v=True)
    for volume in client.volumes.list(filters={"label": selector}):
        with contextlib.suppress(NotFound):
            volume.remove(force=True)


def _oom_kills(container_id: str) -> int:
    """The OOM-kill counter of a container's memory cgroup (v1 or v2, cgroupfs or systemd
    driver); 0 when none is found."""
    candidates = [
        (Path(f"/sys/fs/cgroup/memory/docker/{container_id}/memory.oom_control"), "oom_kill"),
        (
            Path(
                f"/sys/fs/cgroup/memory/system.slice/docker-{container_id}.scope/memory.oom_control"
            ),
            "oom_kill",
        ),
        (Path(f"/sys/fs/cgroup/docker/{container_id}/memory.events"), "oom_kill"),
        (
            Path(f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.events"),
            "oom_kill",
        ),
    ]
    for path, key in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


class _Kubelet:
    """Runs one pod: schedule, wait for its Secret, check its images, make its volumes, run
    its init containers then its container, probe it, report; tear down when it goes."""

    def __init__(self, cluster: TestCluster, run: PodRun, pod: Obj) -> None:
        self.cluster = cluster
        self.run_ = run
        self.pod = pod
        self.spec: Obj = pod["spec"]
        self.labels = {
            labels.MANAGED: "true",
            labels.DEPLOYMENT: cluster.docker_deployment,
            POD_NAME_LABEL: run.name,
            POD_UID_LABEL: run.uid,
        }
        # Volume name -> (Docker source, mount type, read-only).
        self.volumes: dict[str, tuple[str, MountKind, bool]] = {}
        self.started = timestamp()
        self.address: str | None = None  # the pod IP on loopback, while the pod holds it

    # status helpers

    def publish(self, change: Callable[[Obj], None]) -> None:
        run = self.run_
        while not run.node_lost.is_set():  # a lost node's kubelet reports nothing
            try:
                update_status(self.cluster.api, run.namespace, run.name, run.uid, change)
                return
            except httpx.HTTPError:
                # The API server is away (restarting): a kubelet reports again later.
                pass
            except ApiError as exc:
                if exc.code in (404, 409):
                    return  # gone, or a deleted pod whose status is final
                if exc.code not in SERVER_NOT_READY:
                    raise
                # Up but not serving yet (its storage or caches still starting): again later.
            if run.deleted.wait(STATUS_RETRY_S):
                return

    def set_status(self, **fields: Any) -> None:
        def change(pod: Obj) -> None:
            pod.setdefault("status", {}).update(copy.deepcopy(fields))

        self.publish(change)

    def event(self, reason: str, message: str, kind: str = "Normal") -> None:
        self.cluster.event(self.pod, reason, message, kind)

    def conditions(self, *, initialized: bool, ready: bool, reason: str | None = None) -> list[Obj]:
        why = None if ready else (reason or "ContainersNotReady")
        return [
            _condition("PodReadyToStartContainers", "True"),
            _condition(
                "Initialized",
                "True" if initialized else "False",
                None if initialized else "ContainersNotInitialized",
            ),
            _condition("Ready", "True" if ready else "False", why),
            _condition("ContainersReady", "True" if ready else "False", why),
            _condition("PodScheduled", "True"),
        ]

    @staticmethod
    def container_status(
        container: Obj, state: Obj, *, ready: bool = False, container_id: str | None = None
    ) -> Obj:
        found: Obj = {
            "name": container["name"],
            "image": container["image"],
            "imageID": "",
            "ready": ready,
            "restartCount": 0,
            "started": "running" in state,
            "state": state,
        }
        if container_id:
            found["containerID"] = f"docker://{container_id}"
        return found

    def initializing(self) -> Obj:
        """Statuses of a scheduled pod whose containers have not started yet."""
        return {
            "initContainerStatuses": [
                self.container_status(c, {"waiting": {"reason": "PodInitializing"}})
                for c in self.spec.get("initContainers") or []
            ],
            "containerStatuses": [
                self.container_status(c, _PodInitializing) for c in self.spec["containers"]
            ],
        }

    # the pod's life

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - reported in the pod, whatever it is
            # A test kubelet that broke must say so in the pod, not hang the test.
            self.event("TestClusterError", f"{type(exc).__name__}: {exc}", "Warning")
            self.set_status(phase="Failed", reason="TestClusterError", message=str(exc))
            self.run_.deleted.wait()
        finally:
            self.teardown()

    def _run(self) -> None:
        # The real scheduler bound the pod to this node (that is how it got here).

        def scheduled(pod: Obj) -> None:
            pod["status"] = {
                **pod.get("status", {}),
                "phase": "Pending",
                "conditions": [
                    _condition("PodReadyToStartContainers", "False"),
                    _condition("Initialized", "False", "ContainersNotInitialized"),
                    _condition("Ready", "False", "ContainersNotReady"),
                    _condition("ContainersReady", "False", "ContainersNotReady"),
                    _condition("PodScheduled", "True"),
                ],
                "hostIP": NODE_IP,
                "hostIPs": [{"ip": NODE_IP}],
                "startTime": self.started,
                **self.initializing(),
            }

        self.publish(scheduled)
        if not self.mount_secrets():
            return
        for container in [*(self.spec.get("initContainers") or []), *self.spec["containers"]]:
            if not self.pull(container):
                return
        self.make_volumes()
        for container in self.spec.get("initContainers") or []:
            if not self.run_init(container):
                return
        self.run_main(self.spec["containers"][0])

    def mount_secrets(self) -> bool:
        """Write each Secret volume's keys as files (mode ``defaultMode``, group ``fsGroup``),
        once the Secret exists; False when the pod went first."""
        fs_group = (self.spec.get("securityContext") or {}).get("fsGroup")
        waited_since = time.monotonic()
        warned = False
        for volume in self.spec.get("volumes") or []:
            source = volume.get("secret")
            if source is None:
                continue
            while True:
                secret = self.read_secret(source["secretName"])
                if secret is not None:
                    break
                if not warned and time.monotonic() - waited_since > SECRET_MISSING_EVENT_S:
                    warned = True
                    self.event(
                        "FailedMount",
                        f'MountVolume.SetUp failed for volume "{volume["name"]}" : '
                        f'secret "{source["secretName"]}" not found',
                        "Warning",
                    )
                if self.run_.deleted.wait(0.02):
                    return False
            target = self.cluster.scratch / self.run_.uid / volume["name"]
            target.mkdir(parents=True)
            data = secret.get("data") or {}
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                path = target / item["path"]
                path.write_bytes(base64.b64decode(data[item["key"]]))
                mode = item.get("mode", source.get("defaultMode", 0o644))
                if fs_group is not None:
                    # As the kubelet does for a read-only volume under an fsGroup: the group
                    # may read (pkg/volume SetVolumeOwnership's read-only mask).
                    mode |= 0o440
                    shutil.chown(path, 0, fs_group)
                path.chmod(mode)
            target.chmod(0o755)
            self.volumes[volume["name"]] = (str(target), "bind", True)
        return True

    def read_secret(self, name: str) -> Obj | None:
        """The Secret, read as the node (None while it does not exist, while the Node
        authorizer does not yet know this pod mounts it, or while the API server is away
        or not serving yet)."""
        path = f"/api/v1/namespaces/{self.run_.namespace}/secrets/{name}"
        try:
            return self.cluster.api.get(path)
        except ApiError as exc:
            if exc.code == 403 or exc.code in SERVER_NOT_READY:
                return None
            raise
        except httpx.HTTPError:
            return None

    def pull(self, container: Obj) -> bool:
        """IfNotPresent with no registry: a local image or a failed pull, for good."""
        image = container["image"]
        try:
            if container.get("imagePullPolicy") != "Always":
                self.cluster.docker.images.get(image)
                return True
        except ImageNotFound:
            pass
        message = (
            f'Failed to pull image "{image}": rpc error: code = NotFound desc = '
            f"failed to pull and unpack image: {image}: not found (the test node has no "
            "registry)"
        )
        self.event("Pulling", f'Pulling image "{image}"')
        self.event("Failed", message, "Warning")
        self.event("Failed", "Error: ErrImagePull", "Warning")
        self.set_status(**self.waiting_for(container, "ErrImagePull", message))
        if self.run_.deleted.wait(PULL_BACKOFF_S):
            return False
        backoff = f'Back-off pulling image "{image}"'
        self.event("BackOff", backoff, "Normal")
        self.event("Failed", "Error: ImagePullBackOff", "Warning")
        self.set_status(**self.waiting_for(container, "ImagePullBackOff", backoff))
        self.run_.deleted.wait()
        return False

    def waiting_for(self, failing: Obj, reason: str, message: str) -> Obj:
        inits = self.spec.get("initContainers") or []
        is_init = any(c["name"] == failing["name"] for c in inits)

        def state(container: Obj) -> Obj:
            if container["name"] == failing["name"]:
                return {"waiting": {"reason": reason, "message": message}}
            return _PodInitializing if inits else {"waiting": {"reason": "ContainerCreating"}}

        return {
            "initContainerStatuses": [self.container_status(c, state(c)) for c in inits],
            "containerStatuses": [
                self.container_status(c, _PodInitializing if is_init else state(c))
                for c in self.spec["containers"]
            ],
        }

    def make_volumes(self) -> None:
        """emptyDirs: a Docker volume each (tmpfs for ``medium: Memory``), world-writable
        and, with ``fsGroup``, group-owned and setgid, as the kubelet makes them."""
        fs_group = (self.spec.get("securityContext") or {}).get("fsGroup")
        for volume in self.spec.get("volumes") or []:
            source = volume.get("emptyDir")
            if source is None:
                continue
            name = f"k8s-{self.run_.uid[:8]}-{volume['name']}"
            if source.get("medium") == "Memory":
                options = ["mode=2777" if fs_group is not None else "mode=1777"]
                if fs_group is not None:
                    options.append(f"gid={fs_group}")
                if source.get("sizeLimit"):
                    options.append(f"size={int(quantity(source['sizeLimit']))}")
                made = self.cluster.docker.volumes.create(
                    name=name,
                    driver="local",
                    driver_opts={"type": "tmpfs", "device": "tmpfs", "o": ",".join(options)},
                    labels=self.labels,
                )
            else:
                made = self.cluster.docker.volumes.create(name=name, labels=self.labels)
                root = Path(made.attrs["Mountpoint"])
                if fs_group is not None:
                    shutil.chown(root, 0, fs_group)
                root.chmod(0o2777 if fs_group is not None else 0o777)
            self.volumes[volume["name"]] = (made.name, "volume", False)

    def container_options(self, container: Obj) -> Obj:
        """What the kubelet asks of the runtime for one container, as ``docker run`` options."""
        pod_security = self.spec.get("securityContext") or {}
        security = {**pod_security, **(container.get("securityContext") or {})}
        uid = security.get("runAsUser")
        gid = security.get("runAsGroup", 0)
        if security.get("runAsNonRoot") and not uid:
            raise ValueError("CreateContainerConfigError: runAsNonRoot and the image runs as root")
        limits = (container.get("resources") or {}).get("limits") or {}
        options: Obj = {
            "user": f"{uid}:{gid}" if uid is not None else None,
            "group_add": [str(pod_security["fsGroup"])] if "fsGroup" in pod_security else None,
            "read_only": bool(security.get("readOnlyRootFilesystem")),
            "cap_drop": (security.get("capabilities") or {}).get("drop"),
            "cap_add": (security.get("capabilities") or {}).get("add"),
            "security_opt": (
                ["no-new-privileges"] if security.get("allowPrivilegeEscalation") is False else None
            ),
            "mem_limit": int(quantity(limits["memory"])) if "memory" in limits else None,
            # The kubelet gives containers no swap (NoSwap).
            "memswap_limit": int(quantity(limits["memory"])) if "memory" in limits else None,
            "nano_cpus": int(quantity(limits["cpu"]) * 1e9) if "cpu" in limits else None,
            "pids_limit": POD_PIDS_LIMIT,
            "working_dir": container.get("workingDir"),
            "labels": self.labels,
            # The names dockershim gave a pod's containers.
            "name": "_".join(
                ("k8s", container["name"], self.run_.name, self.run_.namespace, self.run_.uid, "0")
            ),
            "mounts": [self.mount(m) for m in container.get("volumeMounts") or []],
        }
        return {k: v for k, v in options.items() if v is not None}

    def mount(self, wanted: Obj) -> Mount:
        source, kind, read_only = self.volumes[wanted["name"]]
        return Mount(
            wanted["mountPath"],
            source,
            type=kind,
            read_only=read_only or bool(wanted.get("readOnly")),
            # An emptyDir starts empty: no copy of the image's files at the mount point.
            no_copy=kind == "volume",
        )

    def start(self, container: Obj, command: list[str] | None = None, **extra: Any) -> Container:
        if command is None:
            command = [*(container.get("command") or []), *(container.get("args") or [])]
        made = self.cluster.docker.containers.create(
            container["image"],
            command=command or None,
            **self.container_options(container),
            **extra,
        )
        self.event("Created", f"Created container {container['name']}")
        made.start()
        self.event("Started", f"Started container {container['name']}")
        return made

    def run_init(self, container: Obj) -> bool:
        made = self.start(container, network_mode="none")
        running = {"running": {"startedAt": timestamp()}}
        self.set_status(
            initContainerStatuses=[self.container_status(container, running, container_id=made.id)]
        )
        while True:
            try:
                outcome = made.wait(timeout=0.5)
                break
            except Exception:  # noqa: BLE001 - the read timeout of a wait still running
                if self.run_.deleted.is_set():
                    return False
        code = int(outcome.get("StatusCode", -1))
        ended = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": running["running"]["startedAt"],
                "finishedAt": timestamp(),
                "containerID": f"docker://{made.id}",
            }
        }
        status = self.container_status(container, ended, container_id=made.id)
        status["ready"] = code == 0
        self.set_status(initContainerStatuses=[status])
        if code != 0:
            # restartPolicy Never: a failed init container fails the pod.
            self.set_status(
                phase="Failed",
                conditions=self.conditions(initialized=False, ready=False),
                containerStatuses=[
                    self.container_status(c, _PodInitializing) for c in self.spec["containers"]
                ],
            )
            self.run_.deleted.wait()
            return False
        return True

    def run_main(self, container: Obj) -> None:
        init = bool(self.spec.get("shareProcessNamespace"))  # the pause process reaps
        command = [*(container.get("command") or []), *(container.get("args") or [])]
        ip = self.claim_address(_listen_port(command))
        made = self.start(
            container, command=_listen_on(command, ip), network_mode="host", init=init
        )
        self.run_.main = made
        started = {"running": {"startedAt": timestamp()}}
        self.set_status(
            phase="Running",
            podIP=ip,
            podIPs=[{"ip": ip}],
            conditions=self.conditions(initialized=True, ready=False),
            containerStatuses=[self.container_status(container, started, container_id=made.id)],
        )
        probe = container.get("readinessProbe") or {}
        port = self.probe_port(container, probe)
        threshold = int(probe.get("failureThreshold", 3))
        ready = False
        failures = 0
        while not self.run_.deleted.wait(PROBE_PERIOD_S):
            if self.run_.node_lost.is_set():
                continue
            try:
                made.reload()
            except NotFound:
                return
            state = made.attrs["State"]
            if state["Running"] and _oom_kills(str(made.id)) > 0:
                # memory.oom.group, as the kubelet sets it on cgroup v2: the whole container.
                made.kill()
                continue
            if not state["Running"]:
                self.report_exit(container, made, started)
                self.run_.deleted.wait()
                return
            ok = port is None or _connects(ip, port)
            failures = 0 if ok else failures + 1
            if ok != ready and (ok or failures >= threshold):
                ready = ok
                if not ready:
                    self.event(
                        "Unhealthy", f"Readiness probe failed: dial tcp {ip}:{port}", "Warning"
                    )
                self.set_status(
                    conditions=self.conditions(initialized=True, ready=ready),
                    containerStatuses=[
                        self.container_status(container, started, ready=ready, container_id=made.id)
                    ],
                )

    def claim_address(self, port: int | None) -> str:
        """The pod's loopback address: one handed out for it, else a fresh one, with the
        agent's port free there."""
        with self.cluster.runs_lock:
            wanted = self.cluster.next_addresses.pop(0) if self.cluster.next_addresses else None
        self.address, _ = loopback.claim(port or 0, wanted)
        return self.address

    def release_address(self) -> None:
        """The pod's containers are gone: its address is free for other pods."""
        if self.address is not None:
            loopback.release(self.address)
            self.address = None

    @staticmethod
    def probe_port(container: Obj, probe: Obj) -> int | None:
        port = (probe.get("tcpSocket") or {}).get("port")
        if isinstance(port, str):
            named = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
            return int(named[port])
        return None if port is None else int(port)

    def report_exit(self, container: Obj, made: Container, started: Obj) -> None:
        # Before the status says so: a test that saw the pod end may hand its IP out.
        self.release_address()
        state = made.attrs["State"]
        code = int(state["ExitCode"])
        reason = "OOMKilled" if state.get("OOMKilled") else ("Completed" if code == 0 else "Error")
        ended = {
            "terminated": {
                "exitCode": code,
                "reason": reason,
                "startedAt": started["running"]["startedAt"],
                "finishedAt": timestamp(),
                "containerID": f"docker://{made.id}",
            }
        }
        self.set_status(
            phase="Succeeded" if code == 0 else "Failed",
            conditions=self.conditions(
                initialized=True, ready=False, reason="PodCompleted" if code == 0 else "PodFailed"
            ),
            containerStatuses=[self.container_status(container, ended, container_id=made.id)],
        )

    def teardown(self) -> None:
        run = self.run_
        _remove_labelled(self.cluster.docker, [f"{POD_UID_LABEL}={run.uid}"])
        self.release_address()
        shutil.rmtree(self.cluster.scratch / run.uid, ignore_errors=True)
        if run.node_lost.is_set():
            return  # a lost kubelet never confirms a deletion
        # A pod deleted gracefully is gone from the API once its containers are: the
        # kubelet confirms with a delete of grace 0, for this pod only (uid precondition).
        with contextlib.suppress(ApiError, httpx.HTTPError):
            self.cluster.api.request(
                "DELETE",
                pod_path(run.namespace, run.name),
                {"gracePeriodSeconds": 0, "preconditions": {"uid": run.uid}},
            )


_PodInitializing: Obj = {"waiting": {"reason": "PodInitializing"}}


def _listen_port(command: list[str]) -> int | None:
    """The port of the agent's ``--listen tcp:HOST:PORT`` in a pod's command, if any."""
    for flag, value in itertools.pairwise(command):
        if flag == "--listen" and value.startswith("tcp:"):
            return int(value.rpartition(":")[2])
    return None


def _listen_on(command: list[str], address: str) -> list[str]:
    """The command with the agent's ``--listen tcp:HOST:PORT`` moved to ``address``: the
    pod shares the host's network, where 0.0.0.0 would be every pod's port at once."""
    moved = list(command)
    for i, (flag, value) in enumerate(itertools.pairwise(command)):
        if flag == "--listen" and value.startswith("tcp:"):
            moved[i + 1] = f"tcp:{address}:{value.rpartition(':')[2]}"
    return moved


def _connects(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1):
            return True
    except OSError:
        return False
