"""What the Kubernetes tests look at behind the backend's back, and the faults they play:
``RealCluster``, a control plane (control_plane.py) with its real node (node.py), read and
acted on as an administrator through the real API server; and ``Api``, a small JSON client
of that API server on plain dicts.

Every fault is played on the real node, as it happens on one: a pod's container killed
(SIGKILL through Docker), a pod's address handed to the next pod (the CNI's allocator
going round its range), a node cut off (its kubelet stopped, its pods frozen) while the
control plane does what its taint manager would.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from lightkube import Client

from orchestrator.sandbox.k8s.pods import CONTAINER
from tests.k8s.control_plane import ControlPlane
from tests.k8s.node import POD_NAME_LABEL, RealNode
from tests.k8s.rbac import SANDBOX_NAMESPACE

Obj = dict[str, Any]


class ApiError(Exception):
    """The API server refused a request (its Status code and message)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Api:
    """A small JSON client of the API server over TLS with a client certificate, on plain
    dicts: the objects exactly as the server has them."""

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

    def close(self) -> None:
        self.http.close()


@dataclass
class RealCluster:
    """A control plane, its real node, and clients of its API server: as the admin
    (``api``, plain dicts) and as the chart's worker (``worker``, its ServiceAccount's
    ``token``, user name ``worker_user``)."""

    plane: ControlPlane
    node: RealNode
    api: Api
    worker: Client
    worker_user: str
    token: str

    # -- clients ---------------------------------------------------------------------------

    def kubeconfig(self, namespace: str = SANDBOX_NAMESPACE) -> Obj:
        """A kubeconfig as the chart's worker ServiceAccount."""
        return self.plane.kubeconfig_for("worker", namespace, token=self.token)

    def client(self, namespace: str = SANDBOX_NAMESPACE) -> Client:
        """A new lightkube client as the chart's worker (the caller closes it)."""
        return self.plane.client("worker", namespace, token=self.token)

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
        """The object as the API server has it now (its JSON), or None."""
        return self.api.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")

    def names(self, plural: str, namespace: str = SANDBOX_NAMESPACE) -> set[str]:
        found = self.api.request("GET", f"/api/v1/namespaces/{namespace}/{plural}")
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

    def wait_for_pod(self, name: str, check: Callable[[Obj], bool], timeout_s: float = 30.0) -> Obj:
        """The pod once ``check`` holds for it (raises AssertionError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pod = self.read("pods", name)
            if pod is not None and check(pod):
                return pod
            assert time.monotonic() < deadline, f"pod {name} never got there: {pod}"
            time.sleep(0.05)

    def main_container(self, pod_name: str) -> Any:
        """The Docker container of the pod's sandbox container, running."""
        return self.node.container(pod_name, CONTAINER)

    def docker_objects(self, pod_name: str | None = None) -> list[str]:
        """The containers of one pod (or of every pod) that still exist, pause containers
        included. Dockershim makes no volumes: a pod's emptyDirs are the kubelet's
        directories, removed with the pod."""
        return [
            f"container {c.name}"
            for c in self.node.containers()
            if pod_name is None or c.labels.get(POD_NAME_LABEL) == pod_name
        ]

    def settle(self, *pod_names: str, timeout_s: float = 60.0) -> None:
        """Until nothing of the pods gone from the API server is left on the node, nor of
        ``pod_names`` (deleted by the test: a kubelet that missed the deletion while its
        watch was down, after an API server restart, stops them only on its next relist)."""
        self.node.wait_settled(timeout_s)
        deadline = time.monotonic() + timeout_s
        while left := [o for name in pod_names for o in self.docker_objects(name)]:
            assert time.monotonic() < deadline, f"left after settling: {left}"
            time.sleep(0.2)
            self.node.wait_settled(timeout_s)

    # -- faults ----------------------------------------------------------------------------

    def kill(self, pod_name: str) -> None:
        """SIGKILL the sandbox's container, as a runtime or a person on the node would."""
        self.node.kill(pod_name, CONTAINER)

    def hand_out(self, address: str) -> None:
        """The next pod to start gets ``address``, a terminated pod's (node.py)."""
        self.node.hand_out(address)

    @contextlib.contextmanager
    def node_lost(self, pod_name: str) -> Iterator[None]:
        """For the block, the node is lost under the pod: it stops answering (its kubelet
        stopped, the pod frozen: node.py ``unresponsive``), and the control plane does, as
        an administrator here, what its taint manager does after the pod's toleration runs
        out: Ready=False, a ``DisruptionTarget`` condition (as Kubernetes >= 1.26 writes it),
        a graceful deletion that the lost kubelet cannot confirm. After the block the node
        comes back, and its kubelet ends the pod."""
        with self.node.unresponsive(pod_name):
            path = f"/api/v1/namespaces/{SANDBOX_NAMESPACE}/pods/{pod_name}"
            pod = self.api.request("GET", path)
            conditions = [c for c in pod["status"].get("conditions") or [] if c["type"] != "Ready"]
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
            # Its resourceVersion makes this a compare-and-swap: the kubelet is stopped,
            # and nobody else writes a pod's status.
            self.api.request("PUT", f"{path}/status", pod)
            uid = pod["metadata"]["uid"]
            self.api.request(
                "DELETE", path, {"gracePeriodSeconds": 1, "preconditions": {"uid": uid}}
            )
            yield


def _condition(kind: str, status: str, reason: str, message: str) -> Obj:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastProbeTime": None,
        "lastTransitionTime": now,
    }
