"""A fake Kubernetes control plane with a real data plane, for testing ``KubernetesBackend``
where no cluster can be had.

Real here:

- the HTTP API as lightkube speaks it: paths, query parameters (``labelSelector``,
  ``fieldSelector``, ``gracePeriodSeconds``, ``watch``, ``resourceVersion``,
  ``timeoutSeconds``), bearer authentication, object, list and watch-event JSON, and errors as
  ``Status`` objects (401, 404, 409, 410 in a watch stream, 403 for an unknown RuntimeClass);
- the pods: a fake kubelet runs each pod as real Docker containers of the pod's image, with
  the pod's command, uid/gid and ``fsGroup``, read-only root, capabilities dropped, no new
  privileges, memory and CPU limits; the Secret's keys as read-only files where the pod mounts
  them; ``emptyDir`` volumes as Docker volumes (tmpfs for ``medium: Memory``); the init
  container run first, on the shared workspace volume; readiness is a TCP connect to the
  probe's port, as the kubelet's ``tcpSocket`` probe.

Fake, and said so:

- one node (``NODE_NAME``, ``NODE_LABELS``) and a scheduler that only checks ``nodeSelector``;
- no registry: an image missing from the local daemon fails as a pull does (``ErrImagePull``,
  then ``ImagePullBackOff``);
- no admission, defaulting or schema validation beyond what is named above; no NetworkPolicy,
  CNI, RuntimeClass handlers (only ``runc``), node-pressure evictions, or
  ``activeDeadlineSeconds``; the one eviction there is: a disk-backed emptyDir past its
  ``sizeLimit`` evicts its pod, as the kubelet's eviction manager does (checked every
  ``PROBE_PERIOD_S``, not every 10 s); the kubelet's ``podPidsLimit`` (``pod_pids_limit``)
  caps each pod's processes;
- the pod network: a real pod has a network namespace of its own; here the main container
  shares the host's (Docker's host networking), so every connection to a pod stays on
  loopback, where tests may send traffic (never to a bridge address, which CI may not route).
  Each pod gets an address of its own in 127.0.0.0/8 (``loopback.claim``), the kubelet
  rewrites the agent's ``--listen tcp:0.0.0.0:PORT`` to that address, reports it as
  ``status.podIP`` and probes it there; ``hand_out`` gives a chosen address to the next pod,
  as a CNI reuses a terminated pod's IP. So the sandbox is not network-isolated in these
  tests (it can reach anything on the host's loopback; the init container has no network),
  and no test here may rely on it being so; the NetworkPolicy is not enforced either way;
- the garbage collector runs at once, not in the background; the watch history is kept until
  ``expire_next_watch`` drops it; probes run every ``PROBE_PERIOD_S``, not every second;
- on cgroup v1 (no ``memory.oom.group``) the kubelet stands in for it: an OOM kill in a
  container kills the whole container, as Kubernetes >= 1.28 does on cgroup v2.

Every Docker container and volume it makes carries the labels the suite's leak check reads
(``orchestrator.managed``, ``orchestrator.deployment`` = ``docker_deployment``), and the
fake removes them when a pod goes and when it is closed.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import itertools
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

import docker
from docker.errors import ImageNotFound, NotFound
from docker.models.containers import Container
from docker.types import Mount
from lightkube import Client, KubeConfig

from orchestrator.sandbox import labels
from tests.k8s import loopback

Obj = dict[str, Any]
MountKind = Literal["bind", "volume"]

NODE_NAME = "fake-node"
NODE_IP = "127.0.0.1"
NODE_LABELS = {"kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux"}
POD_UID_LABEL = "fake-kubelet.pod-uid"
POD_NAME_LABEL = "fake-kubelet.pod"
PROBE_PERIOD_S = 0.2
PULL_BACKOFF_S = 0.5
SECRET_MISSING_EVENT_S = 2.0
KINDS = {"pods": "Pod", "secrets": "Secret", "events": "Event"}
_PATH = re.compile(
    r"^/api/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>pods|secrets|events)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>status))?$"
)
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


def status_object(code: int, reason: str, message: str, **details: str) -> Obj:
    """A ``Status`` as the API server answers a refused request."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }


class ApiFailure(Exception):
    """A request the API server refuses, with its Status."""

    def __init__(self, code: int, reason: str, message: str, **details: str) -> None:
        super().__init__(message)
        self.status = status_object(code, reason, message, **details)


def not_found(plural: str, name: str) -> ApiFailure:
    return ApiFailure(404, "NotFound", f'{plural} "{name}" not found', name=name, kind=plural)


def parse_label_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """Equality-based selectors (``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``)."""
    terms: list[tuple[str, str, str]] = []  # (operator, key, value)
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append(("!=", key, value))
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            terms.append(("=", key, value))
        elif term.startswith("!"):
            terms.append(("absent", term[1:], ""))
        elif re.fullmatch(r"[A-Za-z0-9./_-]+", term):
            terms.append(("present", term, ""))
        else:
            raise ApiFailure(400, "BadRequest", f"unable to parse requirement: {term!r}")

    def matches(got: dict[str, str]) -> bool:
        for op, key, value in terms:
            ok = {
                "!=": got.get(key) != value,
                "=": got.get(key) == value,
                "absent": key not in got,
                "present": key in got,
            }[op]
            if not ok:
                return False
        return True

    return matches


def parse_field_selector(text: str) -> Callable[[Obj], bool]:
    """``path.to.field=value`` terms (and ``!=``), as the API server supports for a few
    fields of each kind."""
    checks: list[Callable[[Obj], bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        negate = "!=" in term
        path, value = term.replace("!=", "=").replace("==", "=").split("=", 1)

        def check(obj: Obj, path: str = path, value: str = value, negate: bool = negate) -> bool:
            found: Any = obj
            for part in path.split("."):
                found = found.get(part) if isinstance(found, dict) else None
            return (
                (str(found) if found is not None else "") != value
                if negate
                else (found is not None and str(found) == value)
            )

        checks.append(check)
    return lambda obj: all(check(obj) for check in checks)


@dataclass
class Change:
    """One entry of the watch history."""

    version: int
    plural: str
    namespace: str
    type: str
    obj: Obj


class Store:
    """The API server's storage: objects by kind, namespace and name; a resourceVersion
    counter; and the history of changes that watches replay from a version."""

    def __init__(self, namespaces: set[str]) -> None:
        self.namespaces = namespaces
        self.changed = threading.Condition()
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.version = 0
        self.history: list[Change] = []
        self.oldest = 0  # a watch from before this version gets 410 Gone
        self.expire_next = False
        self.on_removed: Callable[[str, Obj], None] = lambda plural, obj: None

    def _record(self, plural: str, namespace: str, kind: str, obj: Obj) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.history.append(Change(self.version, plural, namespace, kind, copy.deepcopy(obj)))
        self.changed.notify_all()

    def _check_namespace(self, namespace: str) -> None:
        if namespace not in self.namespaces:
            raise not_found("namespaces", namespace)

    def create(self, plural: str, namespace: str, body: Obj) -> Obj:
        self._check_namespace(namespace)
        meta = body.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ApiFailure(422, "Invalid", f"{KINDS[plural]} is invalid: metadata.name: Required")
        if meta.get("namespace", namespace) != namespace:
            raise ApiFailure(400, "BadRequest", "the namespace of the object does not match")
        with self.changed:
            if (plural, namespace, name) in self.objects:
                raise ApiFailure(
                    409,
                    "AlreadyExists",
                    f'{plural} "{name}" already exists',
                    name=name,
                    kind=plural,
                )
            obj = copy.deepcopy(body)
            obj.update(kind=KINDS[plural], apiVersion="v1")
            obj["metadata"].update(
                namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=timestamp()
            )
            self.objects[(plural, namespace, name)] = obj
            self._record(plural, namespace, "ADDED", obj)
            return copy.deepcopy(obj)

    def get(self, plural: str, namespace: str, name: str) -> Obj:
        with self.changed:
            obj = self.objects.get((plural, namespace, name))
            if obj is None:
                raise not_found(plural, name)
            return copy.deepcopy(obj)

    def list(
        self, plural: str, namespace: str, select: Callable[[Obj], bool]
    ) -> tuple[str, list[Obj]]:
        self._check_namespace(namespace)
        with self.changed:
            items = [
                copy.deepcopy(obj)
                for (kind, ns, _), obj in self.objects.items()
                if kind == plural and ns == namespace and select(obj)
            ]
            return str(self.version), items

    def update(
        self, plural: str, namespace: str, name: str, uid: str, change: Callable[[Obj], None]
    ) -> Obj | None:
        """Apply ``change`` to the object if it is still the one with ``uid``."""
        with self.changed:
            obj = self.objects.get((plural, namespace, name))
            if obj is None or obj["metadata"]["uid"] != uid:
                return None
            change(obj)
            self._record(plural, namespace, "MODIFIED", obj)
            return copy.deepcopy(obj)

    def remove(self, plural: str, namespace: str, name: str) -> Obj:
        with self.changed:
            obj = self.objects.pop((plural, namespace, name), None)
            if obj is None:
                raise not_found(plural, name)
            self._record(plural, namespace, "DELETED", obj)
        self.on_removed(plural, obj)
        return copy.deepcopy(obj)

    def watch(
        self,
        plural: str,
        namespace: str,
        select: Callable[[Obj], bool],
        version: str | None,
        timeout_s: float,
        closed: threading.Event,
    ) -> Iterator[Obj]:
        """Watch events after ``version`` (or the current objects as ADDED, then changes),
        until ``timeout_s``; a version older than the history is an ERROR event (410)."""
        deadline = time.monotonic() + timeout_s
        expired: Obj | None = None
        with self.changed:
            if self.expire_next and version not in (None, "", "0"):
                # As when etcd compacted its history between the client's read and its watch.
                self.expire_next = False
                self.oldest = self.version + 1
            if version in (None, "", "0"):
                cursor = self.version
                first = [
                    {"type": "ADDED", "object": copy.deepcopy(obj)}
                    for (kind, ns, _), obj in self.objects.items()
                    if kind == plural and ns == namespace and select(obj)
                ]
            else:
                cursor = int(version)
                first = []
                if cursor < self.oldest - 1:
                    message = f"too old resource version: {cursor} ({self.oldest - 1})"
                    expired = status_object(410, "Expired", message)
        if expired is not None:
            # The API server answers 200 and ends the stream with an ERROR event.
            yield {"type": "ERROR", "object": expired}
            return
        yield from first
        while not closed.is_set():
            with self.changed:
                pending = [c for c in self.history if c.version > cursor]
                if not pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self.changed.wait(min(left, 0.5))
                    continue
                cursor = pending[-1].version
            for change in pending:
                if change.plural == plural and change.namespace == namespace and select(change.obj):
                    yield {"type": change.type, "object": change.obj}


@dataclass
class PodRun:
    """One pod on the fake node: the kubelet's thread and what it knows."""

    namespace: str
    name: str
    uid: str
    deleted: threading.Event = field(default_factory=threading.Event)
    node_lost: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    main: Container | None = None


class FakeCluster:
    """The API server (``url``, ``client()``) and the fake kubelet of one node."""

    def __init__(
        self,
        docker_client: docker.DockerClient,
        *,
        docker_deployment: str,
        namespaces: tuple[str, ...] = ("orchestrator-sandboxes",),
        runtime_classes: tuple[str, ...] = (),
        pod_pids_limit: int = 1024,
    ) -> None:
        self.docker = docker_client
        self.pod_pids_limit = pod_pids_limit
        self.docker_deployment = docker_deployment
        self.runtime_classes = set(runtime_classes)
        self.token = uuid.uuid4().hex
        self.store = Store(set(namespaces))
        self.store.on_removed = self._removed
        self.requests: list[tuple[str, str]] = []
        self.runs: dict[str, PodRun] = {}
        self.runs_lock = threading.Lock()
        self.next_addresses: list[str] = []  # under runs_lock
        self.closed = threading.Event()
        self.scratch = Path(tempfile.mkdtemp(prefix="orch-fake-kubelet-"))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.cluster = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._serving = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._serving.start()

    # -- clients ---------------------------------------------------------------------------

    def kubeconfig(self, namespace: str = "orchestrator-sandboxes") -> Obj:
        """A kubeconfig pointing at this API server with its bearer token."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "worker", "user": {"token": self.token}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "worker", "namespace": namespace},
                }
            ],
            "current-context": "fake",
        }

    def client(self, namespace: str = "orchestrator-sandboxes") -> Client:
        """A lightkube client of this API server, configured as a worker's would be."""
        config = KubeConfig.from_dict(self.kubeconfig(namespace))
        return Client(config=config, field_manager="orchestrator", trust_env=False)

    # -- looking behind the backend's back -------------------------------------------------

    def read(self, plural: str, name: str, namespace: str = "orchestrator-sandboxes") -> Obj | None:
        try:
            return self.store.get(plural, namespace, name)
        except ApiFailure:
            return None

    def names(self, plural: str, namespace: str = "orchestrator-sandboxes") -> set[str]:
        return {obj["metadata"]["name"] for obj in self.store.list(plural, namespace, _all)[1]}

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
        """Wait until the kubelet has torn down every pod that is gone from the API."""
        deadline = time.monotonic() + timeout_s
        with self.runs_lock:
            gone = [r for r in self.runs.values() if r.deleted.is_set()]
        for run in gone:
            if run.thread is not None:
                run.thread.join(max(0.0, deadline - time.monotonic()))

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
        """The node stops answering: the pod's containers freeze (its IP accepts connections
        that nobody answers), its kubelet stops reporting, and the control plane does what
        it does after the toleration: Ready=False, DisruptionTarget, deletion pending (a
        lost kubelet never confirms it)."""
        with self.runs_lock:
            run = next(r for r in self.runs.values() if r.name == pod_name)
        run.node_lost.set()
        if run.main is not None:
            run.main.pause()
        now = timestamp()

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
            pod["metadata"]["deletionTimestamp"] = now
            pod["metadata"]["deletionGracePeriodSeconds"] = 1

        self.store.update("pods", run.namespace, run.name, run.uid, lost)

    def hand_out(self, address: str) -> None:
        """The next pod to start gets ``address`` as its IP, as a CNI hands a terminated
        pod's address to a new pod (its kubelet fails the pod if the address is still held)."""
        with self.runs_lock:
            self.next_addresses.append(address)

    def expire_next_watch(self) -> None:
        """The next watch from a resourceVersion finds it compacted (410 Gone)."""
        with self.store.changed:
            self.store.expire_next = True

    def backdate(self, plural: str, name: str, seconds: float) -> None:
        """Make an object look ``seconds`` older (its creationTimestamp)."""
        obj = self.store.get(plural, "orchestrator-sandboxes", name)
        born = datetime.now(UTC) - timedelta(seconds=seconds)

        def older(found: Obj) -> None:
            found["metadata"]["creationTimestamp"] = timestamp(born)

        self.store.update(plural, obj["metadata"]["namespace"], name, obj["metadata"]["uid"], older)

    # -- the API server's verbs ------------------------------------------------------------

    def create(self, plural: str, namespace: str, body: Obj) -> Obj:
        if plural == "pods":
            handler = (body.get("spec") or {}).get("runtimeClassName")
            if handler and handler not in self.runtime_classes:
                raise ApiFailure(
                    403,
                    "Forbidden",
                    f'pod rejected: RuntimeClass "{handler}" not found',
                )
        obj = self.store.create(plural, namespace, body)
        if plural == "pods":
            self._admit(obj)
        elif plural == "secrets":
            self._collect_orphan(obj)
        return obj

    def delete(self, plural: str, namespace: str, name: str, grace_s: int | None) -> Obj:
        if plural != "pods":
            obj = self.store.remove(plural, namespace, name)
            details = {"name": name, "kind": plural, "uid": obj["metadata"]["uid"]}
            return {**status_object(200, "", ""), "status": "Success", "details": details}
        pod = self.store.get(plural, namespace, name)
        if grace_s == 0:
            return self.store.remove(plural, namespace, name)
        now = timestamp()

        def terminating(found: Obj) -> None:
            found["metadata"].setdefault("deletionTimestamp", now)
            found["metadata"]["deletionGracePeriodSeconds"] = grace_s or 1

        updated = self.store.update(plural, namespace, name, pod["metadata"]["uid"], terminating)
        with self.runs_lock:
            run = self.runs.get(pod["metadata"]["uid"])
        if run is not None and not run.node_lost.is_set():
            run.deleted.set()  # the kubelet kills the containers, then confirms the deletion
        return updated or pod

    def _removed(self, plural: str, obj: Obj) -> None:
        uid = obj["metadata"]["uid"]
        if plural != "pods":
            return
        with self.runs_lock:
            run = self.runs.get(uid)
        if run is not None:
            run.deleted.set()
        # The garbage collector: dependents owned by the pod go with it.
        namespace = obj["metadata"]["namespace"]
        _, owned = self.store.list("secrets", namespace, lambda s: _owned_by(s, uid))
        for secret in owned:
            with contextlib.suppress(ApiFailure):
                self.store.remove("secrets", namespace, secret["metadata"]["name"])

    def _collect_orphan(self, secret: Obj) -> None:
        """The garbage collector deletes a dependent whose owner does not exist."""
        namespace = secret["metadata"]["namespace"]
        owners = secret["metadata"].get("ownerReferences") or []
        _, live = self.store.list("pods", namespace, _all)
        uids = {pod["metadata"]["uid"] for pod in live}
        if owners and not any(o.get("uid") in uids for o in owners):
            with contextlib.suppress(ApiFailure):
                self.store.remove("secrets", namespace, secret["metadata"]["name"])

    def event(self, pod: Obj, reason: str, message: str, kind: str = "Normal") -> None:
        meta = pod["metadata"]
        now = timestamp()
        body = {
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}"},
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
            "source": {
                "component": "default-scheduler" if "Scheduling" in reason else "kubelet",
                "host": NODE_NAME,
            },
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        with contextlib.suppress(ApiFailure):
            self.store.create("events", meta["namespace"], body)

    # -- the kubelet -----------------------------------------------------------------------

    def _admit(self, pod: Obj) -> None:
        meta = pod["metadata"]
        run = PodRun(meta["namespace"], meta["name"], meta["uid"])
        run.thread = threading.Thread(
            target=_Kubelet(self, run, pod).run, name=f"kubelet-{meta['name']}", daemon=True
        )
        with self.runs_lock:
            self.runs[run.uid] = run
        run.thread.start()

    def close(self) -> None:
        """Stop the API server; the kubelet removes every pod's containers and volumes."""
        self.closed.set()
        with self.runs_lock:
            runs = list(self.runs.values())
        for run in runs:
            run.deleted.set()
        for run in runs:
            if run.thread is not None:
                run.thread.join(60)
        self.server.shutdown()
        self.server.server_close()
        _remove_labelled(self.docker, [f"{labels.DEPLOYMENT}={self.docker_deployment}"])
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> FakeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _disk_usage(root: Path) -> int:
    """Bytes of disk the files under ``root`` take (as the kubelet's ``du``)."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


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

    def __init__(self, cluster: FakeCluster, run: PodRun, pod: Obj) -> None:
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
        # Disk-backed emptyDirs with a sizeLimit: name -> (host directory, bytes allowed).
        self.disk_limits: dict[str, tuple[Path, int]] = {}
        self.started = timestamp()
        self.address: str | None = None  # the pod IP on loopback, while the pod holds it

    # status helpers

    def publish(self, change: Callable[[Obj], None]) -> None:
        if self.run_.node_lost.is_set():
            return  # a lost node's kubelet reports nothing
        self.cluster.store.update(
            "pods", self.run_.namespace, self.run_.name, self.run_.uid, change
        )

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
            # A fake kubelet that broke must say so in the pod, not hang the test.
            self.event("FakeKubeletError", f"{type(exc).__name__}: {exc}", "Warning")
            self.set_status(phase="Failed", reason="FakeKubeletError", message=str(exc))
            self.run_.deleted.wait()
        finally:
            self.teardown()

    def _run(self) -> None:
        deleted = self.run_.deleted
        selector = self.spec.get("nodeSelector") or {}
        if any(NODE_LABELS.get(k) != v for k, v in selector.items()):
            message = (
                "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector. "
                "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling."
            )
            self.set_status(
                phase="Pending",
                conditions=[_condition("PodScheduled", "False", "Unschedulable", message)],
            )
            self.event("FailedScheduling", message, "Warning")
            deleted.wait()
            return

        def scheduled(pod: Obj) -> None:
            pod["spec"]["nodeName"] = NODE_NAME
            pod["status"] = {
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
                "qosClass": "Guaranteed",
                **self.initializing(),
            }

        self.publish(scheduled)
        self.event(
            "Scheduled",
            f"Successfully assigned {self.run_.namespace}/{self.run_.name} to {NODE_NAME}",
        )
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
                secret = self.cluster.read("secrets", source["secretName"], self.run_.namespace)
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
            f"failed to pull and unpack image: {image}: not found (the fake cluster has no "
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
                if source.get("sizeLimit"):
                    self.disk_limits[volume["name"]] = (root, int(quantity(source["sizeLimit"])))
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
            "pids_limit": self.cluster.pod_pids_limit,
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
            over = self.over_disk_limit()
            if over is not None:
                self.evict(container, made, started, over)
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

    def over_disk_limit(self) -> str | None:
        """The eviction message when an emptyDir holds more than its sizeLimit."""
        for name, (root, limit) in self.disk_limits.items():
            used = _disk_usage(root)
            if used > limit:
                source = next(v for v in self.spec["volumes"] if v["name"] == name)
                wanted = source["emptyDir"]["sizeLimit"]
                return f'Usage of EmptyDir volume "{name}" exceeds the limit "{wanted}". '
        return None

    def evict(self, container: Obj, made: Container, started: Obj, message: str) -> None:
        """What the kubelet's eviction manager does to a pod past its own disk limit: kill
        its containers, fail it as Evicted with the reason."""
        self.release_address()
        made.kill()
        self.event("Evicted", message, "Warning")
        ended = {
            "terminated": {
                "exitCode": 137,
                "reason": "Error",
                "startedAt": started["running"]["startedAt"],
                "finishedAt": timestamp(),
                "containerID": f"docker://{made.id}",
            }
        }
        self.set_status(
            phase="Failed",
            reason="Evicted",
            message=message,
            conditions=self.conditions(initialized=True, ready=False, reason="PodFailed"),
            containerStatuses=[self.container_status(container, ended, container_id=made.id)],
        )

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
        # A pod deleted gracefully is gone from the API once its containers are.
        pod = self.cluster.read("pods", run.name, run.namespace)
        mine = pod is not None and pod["metadata"]["uid"] == run.uid
        if mine and pod and pod["metadata"].get("deletionTimestamp") and not run.node_lost.is_set():
            with contextlib.suppress(ApiFailure):
                self.cluster.store.remove("pods", run.namespace, run.name)


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


class _Handler(BaseHTTPRequestHandler):
    """The API server's HTTP side: routes, auth, Status errors, chunked watch streams."""

    protocol_version = "HTTP/1.1"
    server_version = "fake-kube-apiserver"

    @property
    def cluster(self) -> FakeCluster:
        cluster: FakeCluster = self.server.cluster  # type: ignore[attr-defined]
        return cluster

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is self.cluster.requests

    def do_GET(self) -> None:
        self.dispatch("GET")

    def do_POST(self) -> None:
        self.dispatch("POST")

    def do_DELETE(self) -> None:
        self.dispatch("DELETE")

    def do_PUT(self) -> None:
        self.dispatch("PUT")

    def do_PATCH(self) -> None:
        self.dispatch("PATCH")

    def dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.cluster.requests.append((method, self.path))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            if self.headers.get("Authorization") != f"Bearer {self.cluster.token}":
                raise ApiFailure(401, "Unauthorized", "Unauthorized")
            route = _PATH.match(url.path)
            if route is None:
                raise ApiFailure(
                    404, "NotFound", "the server could not find the requested resource"
                )
            self.route(method, route, query, raw)
        except ApiFailure as failure:
            self.send_json(failure.status["code"], failure.status)

    def route(self, method: str, route: re.Match[str], query: dict[str, str], raw: bytes) -> None:
        ns, plural, name, sub = route["ns"], route["plural"], route["name"], route["sub"]
        store = self.cluster.store
        if sub is not None and (plural != "pods" or method != "GET"):
            raise ApiFailure(405, "MethodNotAllowed", "the server does not allow this method")
        if name is None and method == "GET":
            select = self.selector(query)
            if query.get("watch") in ("true", "1"):
                self.stream(plural, ns, select, query)
                return
            version, items = store.list(plural, ns, select)
            body = {
                "kind": f"{KINDS[plural]}List",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": version},
                "items": items,
            }
            self.send_json(200, body)
        elif name is None and method == "POST":
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise ApiFailure(400, "BadRequest", f"invalid JSON: {exc}") from exc
            if not isinstance(body, dict) or body.get("kind") not in (None, KINDS[plural]):
                raise ApiFailure(400, "BadRequest", f"the body is not a {KINDS[plural]}")
            self.send_json(201, self.cluster.create(plural, ns, body))
        elif name is None and method == "DELETE":
            _, doomed = store.list(plural, ns, self.selector(query))
            grace = query.get("gracePeriodSeconds")
            for obj in doomed:
                with contextlib.suppress(ApiFailure):
                    self.cluster.delete(
                        plural, ns, obj["metadata"]["name"], None if grace is None else int(grace)
                    )
            self.send_json(200, {**status_object(200, "", ""), "status": "Success"})
        elif name is not None and method == "GET":
            self.send_json(200, store.get(plural, ns, name))
        elif name is not None and method == "DELETE":
            grace = query.get("gracePeriodSeconds")
            self.send_json(
                200, self.cluster.delete(plural, ns, name, None if grace is None else int(grace))
            )
        else:
            raise ApiFailure(405, "MethodNotAllowed", f"{method} is not served by the fake")

    def selector(self, query: dict[str, str]) -> Callable[[Obj], bool]:
        by_labels = parse_label_selector(query.get("labelSelector", ""))
        by_fields = parse_field_selector(query.get("fieldSelector", ""))
        return lambda obj: by_labels(obj["metadata"].get("labels") or {}) and by_fields(obj)

    def stream(
        self, plural: str, ns: str, select: Callable[[Obj], bool], query: dict[str, str]
    ) -> None:
        timeout_s = float(query.get("timeoutSeconds", 1800))
        events = self.cluster.store.watch(
            plural, ns, select, query.get("resourceVersion"), timeout_s, self.cluster.closed
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in events:
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def send_json(self, code: int, body: Obj) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        # Exactly this: lightkube turns an error into ApiError only for this content type.
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
