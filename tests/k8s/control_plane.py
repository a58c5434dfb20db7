"""A real Kubernetes control plane on loopback: Debian's etcd, and kube-apiserver,
kube-controller-manager and kube-scheduler built from Debian's ``kubernetes`` source package
by ``scripts/kube-build.sh`` (cached on the machine by version).

Each ``ControlPlane`` is a cluster of its own: a fresh etcd data directory, free loopback
ports, a throw-away CA made with openssl, client certificates for an administrator
(``system:masters``) and for the node's kubelet (``system:node:<node>``), a service-account
key pair, and RBAC on (``--authorization-mode=Node,RBAC``, ``NodeRestriction`` admitted).

What differs from a production control plane, and why:

- ``--watch-cache=false``: watches and lists are served from etcd, so ``compact()`` (etcd's
  own compaction) makes a watch from an older resourceVersion fail with the real 410;
- the controller manager runs every controller but ``nodelifecycle``: a lost node is
  played by the test at once (cluster.py ``node_lost``), not after that controller's
  40 s grace and the pods' tolerations, and node.py lifts a new Node's not-ready taint as
  that controller would;
- an audit log of every request (``requests()``, ``audit()``), which tests read to see what a
  client did and what the API server answered.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from lightkube import Client, KubeConfig

from orchestrator.local import free_port

Obj = dict[str, Any]

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "kube-build.sh"
NODE_NAME = "test-node"
SERVICE_CIDR = "10.96.0.0/24"
# The `kubernetes` Service's address: the first of SERVICE_CIDR.
KUBERNETES_SERVICE_IP = "10.96.0.1"
CLUSTER_DOMAIN = "cluster.local"
READY_TIMEOUT_S = 90.0
STOP_GRACE_S = 2.0
# The audit policy: every request's verb and URI, nothing of its bodies.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [{"level": "Metadata"}],
}


class AuditEntry(NamedTuple):
    """One request as the audit log tells it."""

    user: str
    verb: str  # get, list, watch, create, update, patch, delete, deletecollection
    uri: str
    group: str  # the resource's API group: "" for the core group and non-resource URLs
    resource: str  # "pods", or "pods/status" for a subresource; "" for a non-resource URL
    namespace: str  # "" for a cluster-scoped object or a non-resource URL
    code: int  # the response's HTTP status


class ControlPlaneUnavailable(RuntimeError):
    """The binaries could not be built or a component did not come up (with its log)."""


def binaries() -> Path:
    """The directory of the built binaries (building them the first time, ~5.5 minutes)."""
    wanted = os.environ.get("ORCH_KUBE_BIN")
    if wanted:
        return Path(wanted)
    done = subprocess.run(
        [str(BUILD_SCRIPT)], capture_output=True, text=True, check=False, timeout=1800
    )
    if done.returncode != 0:
        raise ControlPlaneUnavailable(f"{BUILD_SCRIPT} failed:\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def host_address() -> str:
    """This machine's own IPv4 address (its default route's source; else the first global
    address off Docker's bridges): what pods dial the host by."""
    routes = subprocess.run(
        ["ip", "-4", "-o", "route", "get", "1.1.1.1"], capture_output=True, text=True, check=False
    ).stdout.split()
    if "src" in routes:
        return routes[routes.index("src") + 1]
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for line in shown.splitlines():
        fields = line.split()
        if not fields[1].startswith(("docker", "br-", "veth")):
            return fields[3].split("/")[0]
    raise ControlPlaneUnavailable("no global IPv4 address on this machine for pods to dial")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificate(
    pki: Path, name: str, subject: str, *, server: bool = False, addresses: tuple[str, ...] = ()
) -> None:
    """``name.key`` and ``name.crt`` signed by the CA in ``pki`` (a server's also for the
    IP ``addresses``)."""
    _openssl("ecparam", "-genkey", "-name", "prime256v1", "-noout", "-out", f"{name}.key", cwd=pki)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=pki)
    usage = "serverAuth" if server else "clientAuth"
    extensions = [f"extendedKeyUsage={usage}", "keyUsage=digitalSignature,keyEncipherment"]
    if server:
        # The names and addresses a pod's in-cluster client dials the API server by.
        names = [
            "IP:127.0.0.1", *(f"IP:{a}" for a in addresses), "DNS:localhost", "DNS:kubernetes",
            "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
            f"DNS:kubernetes.default.svc.{CLUSTER_DOMAIN}",
        ]  # fmt: skip
        extensions.append("subjectAltName=" + ",".join(names))
    (pki / f"{name}.ext").write_text("\n".join(extensions) + "\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
        cwd=pki,
    )  # fmt: skip


def _make_pki(pki: Path, addresses: tuple[str, ...]) -> None:
    pki.mkdir(parents=True)
    _openssl("ecparam", "-genkey", "-name", "prime256v1", "-noout", "-out", "ca.key", cwd=pki)
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=orchestrator-test-ca",
        "-days", "2", "-out", "ca.crt", cwd=pki,
    )  # fmt: skip
    _certificate(pki, "apiserver", "/CN=kube-apiserver", server=True, addresses=addresses)
    _certificate(pki, "admin", "/O=system:masters/CN=test-admin")
    _certificate(pki, "node", f"/O=system:nodes/CN=system:node:{NODE_NAME}")
    # The service-account signing pair (RSA: what the token controller and issuer expect).
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


class _Process:
    """One component: its command, its log file, its process."""

    def __init__(self, name: str, command: list[str], log: Path) -> None:
        self.name = name
        self.command = command
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # Killed with the test process whatever way it ends (setpriv sets the parent-death
        # signal before exec): a crashed test run leaves no control plane behind.
        command = ["setpriv", "--pdeathsig", "KILL", "--", *self.command]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        """The exit status, negative for a signal; None while it runs (or never started)."""
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                # The API server drains open watches for up to a minute; these are
                # throw-away clusters, and a cut is what a crash or a restart does anyway.
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(15)
        self.proc = None

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ControlPlane:
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler, on loopback."""

    def __init__(
        self,
        *,
        namespaces: tuple[str, ...] = ("orchestrator-sandboxes",),
        pod_network: bool = False,
    ) -> None:
        """``pod_network``: serve pods too, as a cluster's API server does (on every address,
        advertised at the machine's own, the ``kubernetes`` Service's endpoint), for a
        ``RealNode`` with ``services``. Off, it listens on loopback only."""
        self.namespaces = namespaces
        self.bin = binaries()
        self.host_address = host_address() if pod_network else None
        self.root = Path(tempfile.mkdtemp(prefix="orch-kube-"))
        self.pki = self.root / "pki"
        extra = () if self.host_address is None else (self.host_address, KUBERNETES_SERVICE_IP)
        _make_pki(self.pki, extra)
        self.etcd_port = free_port()
        self.apiserver_port = free_port()
        self.url = f"https://127.0.0.1:{self.apiserver_port}"
        self.audit_log = self.root / "audit.log"
        (self.root / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY))
        self.admin_kubeconfig = self.root / "admin.kubeconfig"
        self.admin_kubeconfig.write_text(json.dumps(self.kubeconfig_for("admin")))
        self.etcd = _Process("etcd", self._etcd_command(), self.root / "etcd.log")
        self.apiserver = _Process(
            "kube-apiserver", self._apiserver_command(), self.root / "kube-apiserver.log"
        )
        self.controller_manager = _Process(
            "kube-controller-manager",
            self._controller_manager_command(),
            self.root / "kube-controller-manager.log",
        )
        self.scheduler = _Process(
            "kube-scheduler", self._scheduler_command(), self.root / "kube-scheduler.log"
        )
        self._components = [self.etcd, self.apiserver, self.controller_manager, self.scheduler]

    # -- commands --------------------------------------------------------------------------

    def _etcd_command(self) -> list[str]:
        client = f"http://127.0.0.1:{self.etcd_port}"
        return [
            "etcd",
            "--name=test",
            f"--data-dir={self.root / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            # A peer URL nobody dials (one member): port 0 would be refused by etcd.
            f"--listen-peer-urls=http://127.0.0.1:{free_port()}",
            "--log-level=warn",
        ]

    def _apiserver_command(self) -> list[str]:
        pki = self.pki
        return [
            str(self.bin / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--bind-address={'127.0.0.1' if self.host_address is None else '0.0.0.0'}",
            f"--secure-port={self.apiserver_port}",
            "--insecure-port=0",
            f"--cert-dir={self.root / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--api-audiences=https://kubernetes.default.svc",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            *self._network_flags(),
            "--watch-cache=false",
            f"--audit-policy-file={self.root / 'audit-policy.json'}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-mode=blocking",
            "--profiling=false",
            "--v=1",
        ]

    def _network_flags(self) -> list[str]:
        if self.host_address is None:
            # The `kubernetes` Service's endpoints would be a loopback address (refused).
            return ["--endpoint-reconciler-type=none"]
        # Pods reach the API server as a cluster's do: the `kubernetes` Service, whose
        # endpoint is this address (kube-proxy's rules send it here); and it reaches the
        # kubelet's server (logs, port-forward) at the Node's InternalIP, this address too.
        pki = self.pki
        return [
            f"--advertise-address={self.host_address}",
            f"--kubelet-client-certificate={pki / 'admin.crt'}",
            f"--kubelet-client-key={pki / 'admin.key'}",
            "--kubelet-preferred-address-types=InternalIP",
        ]

    def _controller_manager_command(self) -> list[str]:
        return [
            str(self.bin / "kube-controller-manager"),
            f"--kubeconfig={self.admin_kubeconfig}",
            "--controllers=*,-nodelifecycle",
            "--leader-elect=false",
            "--port=0",
            "--secure-port=0",
            "--use-service-account-credentials=false",
            f"--service-account-private-key-file={self.pki / 'sa.key'}",
            f"--root-ca-file={self.pki / 'ca.crt'}",
            "--v=1",
        ]

    def _scheduler_command(self) -> list[str]:
        return [
            str(self.bin / "kube-scheduler"),
            f"--kubeconfig={self.admin_kubeconfig}",
            "--leader-elect=false",
            "--port=0",
            "--secure-port=0",
            "--v=1",
        ]

    # -- clients ---------------------------------------------------------------------------

    def kubeconfig_for(
        self, user: str, namespace: str = "orchestrator-sandboxes", *, token: str | None = None
    ) -> Obj:
        """A kubeconfig for one of the PKI's client certificates (``admin``, ``node``), or
        for a bearer ``token`` (a ServiceAccount's)."""
        credentials: Obj
        if token is not None:
            credentials = {"token": token}
        else:
            credentials = {
                "client-certificate-data": _b64(self.pki / f"{user}.crt"),
                "client-key-data": _b64(self.pki / f"{user}.key"),
            }
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority-data": _b64(self.pki / "ca.crt"),
                    },
                }
            ],
            "users": [{"name": user, "user": credentials}],
            "contexts": [
                {
                    "name": "test",
                    "context": {"cluster": "test", "user": user, "namespace": namespace},
                }
            ],
            "current-context": "test",
        }

    def client(
        self, user: str = "admin", namespace: str = "orchestrator-sandboxes", **kw: Any
    ) -> Client:
        """A lightkube client of this API server as ``user``."""
        config = KubeConfig.from_dict(self.kubeconfig_for(user, namespace, **kw))
        return Client(config=config, field_manager="orchestrator-tests", trust_env=False)

    # -- life ------------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        """Start every component and wait until the API server is ready and the
        controllers have made each namespace's default ServiceAccount."""
        try:
            self.etcd.start()
            self._wait(self.etcd, self._etcd_healthy)
            self.start_apiserver()
            self.controller_manager.start()
            self.scheduler.start()
            admin = self.client()
            from lightkube.models.meta_v1 import ObjectMeta
            from lightkube.resources.core_v1 import Namespace, ServiceAccount

            for namespace in self.namespaces:
                with contextlib.suppress(Exception):
                    admin.create(Namespace(metadata=ObjectMeta(name=namespace)))
            for namespace in self.namespaces:
                # Pods are refused until the token controller made the namespace's default
                # ServiceAccount (the ServiceAccount admission plugin looks it up).
                self._wait(
                    self.controller_manager,
                    lambda ns=namespace: _exists(admin, ServiceAccount, "default", ns),
                )
        except BaseException:
            self.close()
            raise
        return self

    def start_apiserver(self) -> None:
        """Start the API server (again, on the same port) and wait for ``/readyz``."""
        self.apiserver.start()
        self._wait(self.apiserver, self._apiserver_ready)

    def stop_apiserver(self) -> None:
        """Stop the API server (its clients' connections drop; etcd keeps the state)."""
        self.apiserver.stop()

    def close(self) -> None:
        for component in reversed(self._components):
            component.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait(self, component: _Process, ready: Any) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if ready():
                return
            if not component.alive() and component.proc is not None:
                raise ControlPlaneUnavailable(f"{component.name} exited:\n{component.tail()}")
            if time.monotonic() > deadline:
                raise ControlPlaneUnavailable(
                    f"{component.name} not ready in {READY_TIMEOUT_S} s:\n{component.tail()}"
                )
            time.sleep(0.1)

    # -- etcd ------------------------------------------------------------------------------

    def _etcd(self, path: str, body: Obj) -> Obj:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.etcd_port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            found: Obj = json.loads(response.read())
            return found

    def _etcd_healthy(self) -> bool:
        try:
            self._etcd("/v3/kv/range", {"key": _b64_text("health")})
        except (OSError, urllib.error.URLError):
            return False
        return True

    def compact(self) -> int:
        """Compact etcd's history up to a revision after every write so far: a watch from
        any resourceVersion read before this call gets 410 Gone. Returns the revision."""
        # A write of our own first, so that the last resourceVersion a client read is
        # strictly before the compacted revision.
        self._etcd("/v3/kv/put", {"key": _b64_text("orch-test/compact"), "value": _b64_text("x")})
        revision = int(self._etcd("/v3/kv/range", {"key": _b64_text("x")})["header"]["revision"])
        self._etcd("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision

    # -- the API server --------------------------------------------------------------------

    def _apiserver_ready(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        try:
            with urllib.request.urlopen(
                f"{self.url}/readyz", context=context, timeout=2
            ) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def requests(self) -> Iterator[tuple[str, str, str]]:
        """(user, verb, request URI) of every request the API server completed so far."""
        for entry in self.audit():
            yield entry.user, entry.verb, entry.uri

    def audit(self) -> Iterator[AuditEntry]:
        """Every request the API server completed so far, in the order it logged them. A
        watch is logged when it ends (its ``ResponseComplete``), not when it starts."""
        try:
            text = self.audit_log.read_text()
        except FileNotFoundError:
            return
        # Each event is one line: a last line without its newline is still being written.
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            event = json.loads(line)
            if event.get("stage") != "ResponseComplete":
                continue
            ref = event.get("objectRef") or {}
            resource = ref.get("resource", "")
            if ref.get("subresource"):
                resource += "/" + ref["subresource"]
            yield AuditEntry(
                user=event["user"]["username"],
                verb=event["verb"],
                uri=event["requestURI"],
                group=ref.get("apiGroup", ""),
                resource=resource,
                namespace=ref.get("namespace", ""),
                code=int((event.get("responseStatus") or {}).get("code", 0)),
            )


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _b64_text(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _exists(client: Client, kind: Any, name: str, namespace: str) -> bool:
    try:
        client.get(kind, name, namespace=namespace)
    except Exception:  # noqa: BLE001 - not yet (404) or not answering yet
        return False
    return True
