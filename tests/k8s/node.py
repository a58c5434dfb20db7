"""A real node for the control plane of control_plane.py: the kubelet built from Debian's
``kubernetes`` source package by ``scripts/kube-build.sh`` (1.20, dockershim on the local
dockerd), with pod networking by Debian's CNI plugins (``containernetworking-plugins``).

Each pod gets an address of its own on a private /24 in 10.0.0.0/8 (never Docker's
172.16.0.0/12) through the ``ptp`` plugin: a veth pair per pod, a /32 route to it on the
host. So the host, where the worker runs, reaches a sandbox's agent at its ``podIP`` over a
veth the test's kubelet made, and nothing goes to a Docker bridge address. Pods do not
reach each other: their packets to another pod are forwarded by the host, and Docker's
FORWARD policy (DROP) drops them. Nothing enforces NetworkPolicy; a pod can still open a
connection to the host's address on its veth (a service listening on 0.0.0.0).

What differs from a production node, and why:

- one real kubelet per Docker daemon at a time (``LOCK``): dockershim has no notion of
  another kubelet, and a kubelet kills and garbage-collects every ``k8s_*`` container on its
  daemon that is not one of its own pods;
- the kubelet runs in a mount namespace of its own where the six kernel settings it insists
  on (``vm.overcommit_memory`` and the like) read as it wants: it would otherwise rewrite
  them for the whole machine. Its volume mounts reach dockerd through its root directory,
  made a shared mount first;
- its own ``--cgroup-root``, dockershim socket and checkpoints, CNI configuration, cache and
  address store, all under a temporary directory: closing the node removes them, and every
  container, mount and cgroup it made;
- image garbage collection off and node-pressure eviction thresholds at 1%: the daemon's
  images and disk are the machine's, not this node's;
- the control plane runs no node lifecycle controller, so the ``not-ready`` taint the API
  server puts on a new Node is lifted here, as an administrator, once the kubelet reports
  Ready (what that controller would do).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
from lightkube import ALL_NS, ApiError, Client
from lightkube.models.core_v1 import (
    EndpointAddress,
    EndpointPort,
    EndpointSubset,
    ServicePort,
    ServiceSpec,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Endpoints, Node, Pod, Service

from orchestrator.local import free_port
from tests.k8s.control_plane import CLUSTER_DOMAIN, NODE_NAME, ControlPlane, _Process

Obj = dict[str, Any]

PAUSE_IMAGE = os.environ.get("KUBE_PAUSE_IMAGE", "orchestrator/kube-pause:3.4.1")
"""The pod infra image scripts/kube-build.sh builds from the tree's pause.c."""
CNI_BIN_DIR = Path("/usr/lib/cni")
# Fixed in the 1.20 kubelet (not a flag): pods' log directories and their symlinks.
POD_LOGS = Path("/var/log/pods")
CONTAINER_LOGS = Path("/var/log/containers")
CGROUP_FS = Path("/sys/fs/cgroup")
PREFIX = "orch-kubelet-"
LOCK = Path("/run/lock/orchestrator-real-kubelet.lock")
LOCK_TIMEOUT_S = 600.0
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0
# What the kubelet's container manager wants these sysctls to be (setupKernelTunables,
# 1.20). Shown to it in its own mount namespace only: with protectKernelDefaults it fails
# rather than write the machine's.
KERNEL_TUNABLES = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
POD_UID_LABEL = "io.kubernetes.pod.uid"
POD_NAME_LABEL = "io.kubernetes.pod.name"
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"
# The cluster DNS Service's address (in control_plane.SERVICE_CIDR), as kubeadm's.
DNS_SERVICE_IP = "10.96.0.10"
DNSMASQ = Path("/usr/sbin/dnsmasq")
# How often the DNS records follow the API server's Services and Endpoints.
DNS_SYNC_S = 0.25
# kube-proxy's iptables mode turns this on (for NodePorts on 127.0.0.1, unused here); it is
# shown the value it wants in its own mount namespace, as the kubelet's tunables are.
PROXY_TUNABLES = {"net/ipv4/conf/all/route_localnet": "1"}


class NodeUnavailable(RuntimeError):
    """The kubelet could not be started or did not make its Node Ready (with its log)."""


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True)


def _mounts_under(root: Path) -> list[Path]:
    """Mount points at or under ``root`` in this mount namespace, deepest first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = Path(line.split()[4].replace("\\040", " "))
        if point == root or root in point.parents:
            found.append(point)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _unmount_under(root: Path) -> None:
    for point in _mounts_under(root):
        subprocess.run(["umount", "--lazy", str(point)], check=False, capture_output=True)


def _cgroup_hierarchies() -> list[Path]:
    return [d for d in CGROUP_FS.iterdir() if (d / "cgroup.procs").exists()]


def _remove_cgroups(name: str) -> None:
    """rmdir the cgroup ``/name`` and everything under it, in every hierarchy, deepest
    first (an empty cgroup goes with rmdir; its files are not files)."""
    for hierarchy in _cgroup_hierarchies():
        top = hierarchy / name
        if not top.is_dir():
            continue
        dirs = sorted(
            (Path(d) for d, _, _ in os.walk(top)), key=lambda p: len(p.parts), reverse=True
        )
        for directory in dirs:
            with contextlib.suppress(OSError):
                directory.rmdir()


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0-10.254.255.0 that no route of this machine overlaps."""
    routes = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], check=True, capture_output=True, text=True
    ).stdout
    taken = []
    for line in routes.splitlines():
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(line.split()[0], strict=False))
    for _ in range(64):
        subnet = ipaddress.IPv4Network(
            f"10.{random.randint(200, 254)}.{random.randint(0, 255)}.0/24"
        )
        if not any(subnet.overlaps(t) for t in taken if t.prefixlen > 0):
            return subnet
    raise NodeUnavailable("no free /24 for pods in 10.200.0.0/16-10.254.0.0/16")


class RealNode:
    """The control plane's node (``NODE_NAME``), run by a real kubelet: pods the scheduler
    binds to it run as Docker containers on the local daemon, on a pod network of their own
    (``subnet``). ``close`` stops the kubelet and removes every container, mount, cgroup,
    pod log and file it made, whatever state it was left in."""

    def __init__(
        self,
        plane: ControlPlane,
        *,
        max_pods: int = 110,
        pod_pids_limit: int = 1024,
        services: bool = False,
    ) -> None:
        """``pod_pids_limit``: the kubelet's ``podPidsLimit``, each pod's processes.
        ``services``: what an installed application needs of a cluster besides its pods.
        Pods reach each other and ClusterIP Services (the real kube-proxy, iptables mode),
        resolve Services by name (``DNS_SERVICE_IP``: the smallest stand-in for CoreDNS,
        which Debian does not package: Debian's dnsmasq answering from the Services and
        Endpoints this node copies from the API server every ``DNS_SYNC_S``), and reach the
        API server through the ``kubernetes`` Service; the plane must be made with
        ``pod_network``. Pods still reach nothing off this machine (no route is NATed)."""
        if services and plane.host_address is None:
            raise ValueError("services need a ControlPlane(pod_network=True)")
        self.services = services
        self.kube_proxy: _Process | None = None
        self.dnsmasq: _Process | None = None
        self.dns_port = 0
        self.proxy_healthz = ""
        self._dns_stop = threading.Event()
        self._dns_thread: threading.Thread | None = None
        self._forward_rules: list[list[str]] = []
        self.plane = plane
        self.bin = plane.bin
        self.max_pods = max_pods
        self.pod_pids_limit = pod_pids_limit
        self.id = uuid.uuid4().hex[:8]
        # Made once the lock is held (start): a sweep of another process's stale nodes
        # takes every directory of the prefix but its own.
        self.root = Path()
        self.cgroup_root = f"{PREFIX}{self.id}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.port = 0
        self.healthz_port = 0
        self.kubelet: _Process | None = None
        self._lock: Any = None
        self.docker = docker.from_env()
        # A unix socket takes no proxy (and os.environ changes under pytest: tests/conftest.py).
        self.docker.api.trust_env = False

    @property
    def kubelet_root(self) -> Path:
        """The kubelet's --root-dir (pods' volumes, its checkpoints)."""
        return self.root / "kubelet"

    # -- files -----------------------------------------------------------------------------

    def _write_files(self) -> None:
        assert self.subnet is not None
        self.kubelet_root.mkdir()
        (self.root / "kubeconfig").write_text(json.dumps(self.plane.kubeconfig_for("node")))
        (self.root / "config.json").write_text(json.dumps(self._config()))
        net_d = self.root / "cni" / "net.d"
        net_d.mkdir(parents=True)
        (net_d / "10-orch-test.conflist").write_text(json.dumps(self._cni_config()))
        tunables = self.root / "sysctl"
        tunables.mkdir()
        for key, value in {**KERNEL_TUNABLES, **PROXY_TUNABLES}.items():
            (tunables / key.replace("/", ".")).write_text(value + "\n")

    def _config(self) -> Obj:
        """The KubeletConfiguration (the flags' file form; a few are flags only)."""
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": self.port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.plane.pki / "ca.crt")},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_root}",
            "failSwapOn": False,
            "oomScoreAdj": 0,
            "protectKernelDefaults": True,
            # Its chains in the machine's iptables would outlive it; nothing here needs them.
            "makeIPTablesUtilChains": False,
            "maxPods": self.max_pods,
            # The daemon's images are the machine's: never collected by this kubelet.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            # Node pressure only when the machine is really out (its disk is shared); per-pod
            # limits (emptyDir sizeLimit, ephemeral-storage) are still enforced.
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "evictionPressureTransitionPeriod": "5s",
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "20s",
            # Pods' emptyDir usage measured every second: a disk-backed one past its
            # sizeLimit is evicted at the eviction manager's next look (every 10 s).
            "volumeStatsAggPeriod": "1s",
            # A memory-backed emptyDir's tmpfs sized to its sizeLimit (ENOSPC past it), as
            # every kubelet from 1.22 does by default (alpha in 1.20).
            "featureGates": {"SizeMemoryBackedVolumes": True},
            "serializeImagePulls": False,
            "podPidsLimit": self.pod_pids_limit,
            **self._service_config(),
        }

    def _service_config(self) -> Obj:
        if not self.services:
            return {}
        # Its server on the Node's InternalIP (this machine's address, which the kubelet
        # reports; a loopback one it refuses): the API server's logs and port-forward reach
        # it there.
        return {
            "address": self.plane.host_address,
            "clusterDNS": [DNS_SERVICE_IP],
            "clusterDomain": CLUSTER_DOMAIN,
        }

    def _cni_config(self) -> Obj:
        return {
            "cniVersion": "0.4.0",
            "name": f"orch-test-{self.id}",
            "plugins": [
                {
                    "type": "ptp",
                    # No NAT: pods have no business outside the host (sandboxes have no
                    # network), and no rule of ours is left in the machine's iptables.
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": str(self.subnet)}]],
                        "dataDir": str(self.root / "cni" / "ipam"),
                        # Services' addresses and the host's are off the pod /24: a default
                        # route through the host end, where kube-proxy's rules meet them.
                        **({"routes": [{"dst": "0.0.0.0/0"}]} if self.services else {}),
                    },
                }
            ],
        }

    def _command(self) -> list[str]:
        runtime = f"unix://{self.root / 'dockershim.sock'}"
        kubelet = [
            str(self.bin / "kubelet"),
            f"--config={self.root / 'config.json'}",
            f"--kubeconfig={self.root / 'kubeconfig'}",
            f"--root-dir={self.kubelet_root}",
            f"--cert-dir={self.root / 'pki'}",
            f"--hostname-override={NODE_NAME}",
            "--container-runtime=docker",
            f"--container-runtime-endpoint={runtime}",
            f"--image-service-endpoint={runtime}",
            f"--experimental-dockershim-root-directory={self.root / 'dockershim'}",
            f"--pod-infra-container-image={PAUSE_IMAGE}",
            "--network-plugin=cni",
            f"--cni-bin-dir={CNI_BIN_DIR}",
            f"--cni-conf-dir={self.root / 'cni' / 'net.d'}",
            f"--cni-cache-dir={self.root / 'cni' / 'cache'}",
            f"--volume-plugin-dir={self.root / 'volume-plugins'}",
            "--v=2",
        ]
        return self._with_tunables(KERNEL_TUNABLES, kubelet)

    def _with_tunables(self, tunables: dict[str, str], command: list[str]) -> list[str]:
        """``command`` in a mount namespace of its own where each of ``tunables`` reads as
        given: its file bound over /proc/sys there (/proc is a private mount: the host
        never sees these binds, and a write to one changes the file, not the kernel)."""
        binds = " && ".join(
            f"mount --bind {self.root / 'sysctl' / key.replace('/', '.')} /proc/sys/{key}"
            for key in tunables
        )
        return [
            "unshare", "--mount", "--propagation", "unchanged", "--",
            "sh", "-c", f'{binds} && exec "$@"', Path(command[0]).name, *command,
        ]  # fmt: skip

    # -- life ------------------------------------------------------------------------------

    def start(self) -> RealNode:
        """Start the kubelet and wait until its Node is Ready and schedulable."""
        try:
            if not (self.bin / "kubelet").exists():
                raise NodeUnavailable(f"no kubelet in {self.bin}: run scripts/kube-build.sh")
            plugins = [CNI_BIN_DIR / name for name in ("ptp", "host-local", "loopback")]
            if not all(plugin.exists() for plugin in plugins):
                raise NodeUnavailable(
                    f"no CNI plugins in {CNI_BIN_DIR}: run scripts/host-setup.sh "
                    "(Debian's containernetworking-plugins)"
                )
            try:
                self.docker.images.get(PAUSE_IMAGE)
            except docker.errors.ImageNotFound as exc:
                raise NodeUnavailable(f"no image {PAUSE_IMAGE}: run scripts/kube-build.sh") from exc
            self._take_lock()
            # A Node left by an earlier kubelet of this plane would read Ready at once.
            _delete_node(self.plane)
            self.root = Path(tempfile.mkdtemp(prefix=PREFIX))
            _sweep_stale(self.docker, keep=self.root)
            if _has_proxy_rules():
                _proxy_cleanup(self.bin)  # a dead process's node's (the lock is held)
            self.port, self.healthz_port = free_port(), free_port()
            self.subnet = _free_subnet()
            self._write_files()
            # The kubelet's mounts (Secrets, memory emptyDirs) are made in its own mount
            # namespace: under a shared mount they propagate back here, where dockerd is.
            _run("mount", "--bind", str(self.kubelet_root), str(self.kubelet_root))
            _run("mount", "--make-shared", str(self.kubelet_root))
            for hierarchy in _cgroup_hierarchies():
                # The kubelet refuses a --cgroup-root missing from any hierarchy.
                (hierarchy / self.cgroup_root).mkdir(exist_ok=True)
            self.kubelet = _Process("kubelet", self._command(), self.root / "kubelet.log")
            self.kubelet.start()
            if self.services:
                self._start_services()
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _take_lock(self) -> None:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        self._lock = LOCK.open("w")
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NodeUnavailable(
                        f"another real kubelet held {LOCK} for {LOCK_TIMEOUT_S} s"
                    ) from None
                time.sleep(0.5)

    def _wait_ready(self) -> None:
        with contextlib.closing(self.plane.client()) as admin:
            self._untaint_once_ready(admin)

    def _untaint_once_ready(self, admin: Client) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert self.kubelet is not None
            if not self.kubelet.alive():
                raise NodeUnavailable(f"the kubelet exited:\n{self.kubelet.tail(60)}")
            node = None
            with contextlib.suppress(Exception):
                node = admin.get(Node, NODE_NAME)
            if node is not None and _ready(node):
                break
            if time.monotonic() > deadline:
                raise NodeUnavailable(
                    f"node not Ready in {READY_TIMEOUT_S} s:\n{self.kubelet.tail(60)}"
                )
            time.sleep(0.1)
        # What the node lifecycle controller does once a node reports Ready (it does not
        # run here: control_plane.py).
        assert node.spec is not None
        taints = [t for t in node.spec.taints or [] if t.key != "node.kubernetes.io/not-ready"]
        admin.patch(Node, NODE_NAME, {"spec": {"taints": taints or None}})

    def containers(self) -> list[Any]:
        """The Docker containers this kubelet made (dockershim's ``k8s_*``, pause included)
        that still exist: those under its cgroup root."""
        found = []
        for container in self.docker.containers.list(
            all=True, filters={"label": POD_UID_LABEL}, ignore_removed=True
        ):
            parent = container.attrs.get("HostConfig", {}).get("CgroupParent") or ""
            if parent.startswith(f"/{self.cgroup_root}/"):
                found.append(container)
        return found

    def pod_containers(self, pod_uid: str, *, running: bool = False) -> list[str]:
        """Names of the containers of one pod (by uid) that still exist (only the running
        ones with ``running``)."""
        return [
            c.name
            for c in self.containers()
            if c.labels.get(POD_UID_LABEL) == pod_uid and (not running or c.status == "running")
        ]

    def settle(self) -> list[str]:
        """Remove the exited containers of pods no longer in the API server (by their
        ``io.kubernetes.pod.uid`` label), and those pods' log directories; return the
        names removed.

        What the kubelet's container garbage collection does, once a minute (not
        configurable in 1.20), to a deleted pod's pause container: a test that checks that
        nothing of a pod is left need not wait for it. A running container, or one of a pod
        still in the API server (being deleted included), is the kubelet's business and
        left alone."""
        removed: list[str] = []
        uids: set[str] = set()
        for container in self._of_gone_pods(terminating=False):
            if container.status == "running":
                continue
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                container.remove(v=True)
                removed.append(container.name)
            uids.add(container.labels.get(POD_UID_LABEL, ""))
        _remove_pod_logs(uids)
        return removed

    def wait_settled(self, timeout_s: float = 60.0) -> None:
        """Until no container of a pod gone from the API server is left: ``settle`` again
        while the kubelet still stops one, or tears the same pod sandbox down (Docker then
        refuses the second removal); AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.settle()
            left = [c.name for c in self._of_gone_pods(terminating=True)]
            if not left:
                return
            assert time.monotonic() < deadline, f"left after settling: {left}"
            time.sleep(0.2)

    def _of_gone_pods(self, *, terminating: bool) -> list[Any]:
        """Containers of pods no longer in the API server; with ``terminating``, of pods
        being deleted too (a delete with grace 0 leaves the pod listed, with a deletion
        timestamp, until its kubelet has stopped it: waiting must see those, and removing
        must leave them to the kubelet)."""
        # Containers first: the kubelet makes them only for pods the API server had, so one
        # whose pod a later listing lacks is a deleted pod's (not a pod made meanwhile).
        containers = self.containers()
        with contextlib.closing(self.plane.client()) as admin:
            # A lazy listing: read before the client closes.
            live = {
                p.metadata.uid
                for p in admin.list(Pod, namespace=ALL_NS)
                if p.metadata and not (terminating and p.metadata.deletionTimestamp is not None)
            }
        return [c for c in containers if c.labels.get(POD_UID_LABEL, "") not in live]

    def container(self, pod_name: str, name: str) -> Any:
        """The running Docker container of one of a pod's containers."""
        (found,) = [
            c
            for c in self.containers()
            if c.labels.get(POD_NAME_LABEL) == pod_name
            and c.labels.get(CONTAINER_NAME_LABEL) == name
            and c.status == "running"
        ]
        return found

    def kill(self, pod_name: str, container: str) -> None:
        """SIGKILL one running container of a pod, as the runtime's OOM killer or a person
        on the node would; the kubelet then reports it (exit 137)."""
        self.container(pod_name, container).kill()

    @contextlib.contextmanager
    def unresponsive(self, *pod_names: str) -> Iterator[None]:
        """For the block, the node as one cut off from its cluster: the kubelet stopped
        (SIGSTOP: no status, no lease, no deletion confirmed) and the named pods'
        containers frozen (``docker pause``: their addresses take connections that nobody
        answers). After it, both go on where they were."""
        assert self.kubelet is not None and self.kubelet.proc is not None
        frozen = [c for c in self.containers() if c.labels.get(POD_NAME_LABEL) in pod_names]
        frozen = [c for c in frozen if c.status == "running"]
        group = self.kubelet.proc.pid  # its own session and process group: _Process
        os.killpg(group, signal.SIGSTOP)
        try:
            for container in frozen:
                container.pause()
            yield
        finally:
            for container in frozen:
                with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                    container.unpause()
            os.killpg(group, signal.SIGCONT)

    def hand_out(self, address: str, timeout_s: float = 30.0) -> None:
        """The next pod to start gets ``address``, as a CNI hands a terminated pod's
        address to a new pod: once the address is free (the kubelet tore the old pod's
        network down), the ``host-local`` allocator's record of the last address it gave
        is set to the one before it, as after going once round the node's /24.
        AssertionError if the address is still held after ``timeout_s``."""
        store = self.root / "cni" / "ipam" / self._cni_config()["name"]
        deadline = time.monotonic() + timeout_s
        while (store / address).exists():
            assert time.monotonic() < deadline, f"{address} still held after {timeout_s} s"
            time.sleep(0.1)
        # host-local keeps one such file per range of the network (one range here: 0).
        previous = ipaddress.ip_address(address) - 1
        (store / "last_reserved_ip.0").write_text(str(previous))

    # -- services (kube-proxy, DNS) ---------------------------------------------------------

    def _start_services(self) -> None:
        assert self.subnet is not None and self.plane.host_address is not None
        for needed in (self.bin / "kube-proxy", DNSMASQ):
            if not needed.exists():
                raise NodeUnavailable(
                    f"no {needed}: run scripts/kube-build.sh and scripts/host-setup.sh"
                )
        # Pod to pod (a Service's backend included) is forwarded by this host, where
        # Docker's FORWARD policy is DROP. Only this node's /24 to itself: a pod still
        # reaches nothing off the machine.
        rule = ["FORWARD", "-s", str(self.subnet), "-d", str(self.subnet),
                "-m", "comment", "--comment", self.cgroup_root, "-j", "ACCEPT"]  # fmt: skip
        _run("iptables", "-w", "-I", *rule)
        self._forward_rules.append(rule)
        self.proxy_healthz = f"127.0.0.1:{free_port()}"
        (self.root / "kube-proxy.json").write_text(json.dumps(self._proxy_config()))
        self.kube_proxy = _Process(
            "kube-proxy",
            self._with_tunables(
                PROXY_TUNABLES,
                [
                    str(self.bin / "kube-proxy"),
                    f"--config={self.root / 'kube-proxy.json'}",
                    "--v=1",
                ],
            ),
            self.root / "kube-proxy.log",
        )
        self.kube_proxy.start()
        self._start_dns()
        self._wait_services()

    def _wait_services(self) -> None:
        """Until kube-proxy has written its rules once (its healthz answers 200 only then)
        and dnsmasq is serving: either one down would show only as pods that never turn
        Ready, minutes later."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            for process in (self.kube_proxy, self.dnsmasq):
                assert process is not None
                _running(process)
            try:
                with urllib.request.urlopen(f"http://{self.proxy_healthz}/healthz", timeout=2):
                    return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                assert self.kube_proxy is not None
                raise NodeUnavailable(f"kube-proxy not healthy:\n{self.kube_proxy.tail(40)}")
            time.sleep(0.2)

    def _proxy_config(self) -> Obj:
        (self.root / "admin.kubeconfig").write_text(json.dumps(self.plane.kubeconfig_for("admin")))
        return {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.root / "admin.kubeconfig")},
            "hostnameOverride": NODE_NAME,
            "mode": "iptables",
            "clusterCIDR": str(self.subnet),
            "bindAddress": "127.0.0.1",
            "healthzBindAddress": self.proxy_healthz,
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            # Root here cannot lower its own OOM score (no CAP_SYS_RESOURCE).
            "oomScoreAdj": 0,
            # Zero: leave the machine's conntrack table size and timeouts as they are.
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
            "iptables": {"syncPeriod": "30s", "minSyncPeriod": "0s", "masqueradeAll": False},
        }

    def _start_dns(self) -> None:
        address = self.plane.host_address
        assert address is not None
        self.dns_port = free_port()
        hosts = self.root / "dns-hosts"
        hosts.write_text("")
        self.dnsmasq = _Process(
            "dnsmasq",
            [
                str(DNSMASQ),
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--no-poll",
                f"--addn-hosts={hosts}",
                f"--listen-address={address}",
                "--bind-interfaces",
                f"--port={self.dns_port}",
                # Names of the cluster not (yet) known are NXDOMAIN at once, never cached.
                f"--local=/{CLUSTER_DOMAIN}/",
                "--cache-size=0",
                "--user=root",
                "--pid-file=",
                "--log-facility=-",
            ],
            self.root / "dnsmasq.log",
        )
        self.dnsmasq.start()
        self._wait_dns_listening(address)
        with contextlib.closing(self.plane.client()) as admin:
            admin.create(
                Service(
                    metadata=ObjectMeta(name="kube-dns", namespace="kube-system"),
                    spec=ServiceSpec(
                        clusterIP=DNS_SERVICE_IP,
                        ports=[
                            ServicePort(
                                name="dns", port=53, protocol="UDP", targetPort=self.dns_port
                            ),
                            ServicePort(
                                name="dns-tcp", port=53, protocol="TCP", targetPort=self.dns_port
                            ),
                        ],
                    ),
                )
            )
            admin.create(
                Endpoints(
                    metadata=ObjectMeta(name="kube-dns", namespace="kube-system"),
                    subsets=[
                        EndpointSubset(
                            addresses=[EndpointAddress(ip=address)],
                            ports=[
                                EndpointPort(name="dns", port=self.dns_port, protocol="UDP"),
                                EndpointPort(name="dns-tcp", port=self.dns_port, protocol="TCP"),
                            ],
                        )
                    ],
                )
            )
        with contextlib.closing(self.plane.client()) as admin:
            self._sync_dns_once(admin)
        self._dns_thread = threading.Thread(target=self._sync_dns, name="dns-sync", daemon=True)
        self._dns_thread.start()

    def _wait_dns_listening(self, address: str) -> None:
        """Until dnsmasq accepts a connection. Its records are reloaded by SIGHUP, and one
        sent before dnsmasq has set its handlers ends it, silently (under load, the first
        sync came that early: "dnsmasq exited" with an empty log); it sets them before it
        opens its sockets."""
        assert self.dnsmasq is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            _running(self.dnsmasq)
            try:
                with socket.create_connection((address, self.dns_port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise NodeUnavailable(
                        f"dnsmasq not listening on {address}:{self.dns_port}:\n"
                        f"{self.dnsmasq.tail(40)}"
                    ) from None
                time.sleep(0.05)

    def _sync_dns(self) -> None:
        # One client for the thread's life: four lists a second, not four TLS set-ups.
        with contextlib.closing(self.plane.client()) as admin:
            while not self._dns_stop.wait(DNS_SYNC_S):
                # The API server may be restarting; the records stay as they were meanwhile.
                with contextlib.suppress(Exception):
                    self._sync_dns_once(admin)

    def _sync_dns_once(self, admin: Client) -> None:
        records = dns_records(
            list(admin.list(Service, namespace=ALL_NS)),
            list(admin.list(Endpoints, namespace=ALL_NS)),
        )
        hosts = self.root / "dns-hosts"
        text = "".join(f"{ip} {name}\n" for name, ip in records)
        if hosts.read_text() == text:
            return
        fresh = hosts.with_suffix(".new")
        fresh.write_text(text)
        fresh.rename(hosts)
        if self.dnsmasq is not None and self.dnsmasq.proc is not None:
            # dnsmasq reads its hosts files again on SIGHUP.
            self.dnsmasq.proc.send_signal(signal.SIGHUP)

    def _stop_services(self) -> None:
        self._dns_stop.set()
        if self._dns_thread is not None:
            self._dns_thread.join(5)
            self._dns_thread = None
        for process in (self.dnsmasq, self.kube_proxy):
            if process is not None:
                process.stop()
        self.dnsmasq = self.kube_proxy = None
        if self.services:
            # The Service names this node's DNS port: the plane's next node makes its own.
            with contextlib.suppress(Exception), contextlib.closing(self.plane.client()) as admin:
                admin.delete(Service, "kube-dns", namespace="kube-system")
                admin.delete(Endpoints, "kube-dns", namespace="kube-system")
            _proxy_cleanup(self.bin)
        for rule in self._forward_rules:
            subprocess.run(["iptables", "-w", "-D", *rule], check=False, capture_output=True)
        self._forward_rules.clear()

    def close(self) -> None:
        """Stop the kubelet (and kube-proxy and the DNS); remove its containers, mounts,
        cgroups, iptables rules, pod logs and files."""
        self._stop_services()
        if self.kubelet is not None:
            self.kubelet.stop()
            self.kubelet = None
            # The node is gone for good, as when one is removed from a cluster: the next
            # RealNode of this plane registers afresh, and its pods go with it.
            with contextlib.suppress(Exception):
                _delete_node(self.plane)
        uids = set()
        for container in self.containers():
            uids.add(container.labels.get(POD_UID_LABEL, ""))
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                container.remove(force=True, v=True)
        _remove_pod_logs(uids)
        if self.root != Path():
            _unmount_under(self.root)
            shutil.rmtree(self.root, ignore_errors=True)
        _remove_cgroups(self.cgroup_root)
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        self.docker.close()

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _running(process: _Process) -> None:
    """NodeUnavailable, with its exit status and last lines, when ``process`` has exited."""
    if not process.alive():
        raise NodeUnavailable(
            f"{process.name} exited ({process.returncode()}):\n{process.tail(40)}"
        )


def dns_records(services: list[Service], endpoints: list[Endpoints]) -> list[tuple[str, str]]:
    """(name, address) as CoreDNS's kubernetes plugin answers A queries: a Service's
    ``<name>.<namespace>.svc.<domain>`` at its ClusterIP; for a headless one, at each of
    its endpoints (not-ready ones too where the Service publishes them), and each endpoint
    with a hostname (a StatefulSet's pod) also as ``<hostname>.<name>.<namespace>.svc``."""
    records: list[tuple[str, str]] = []
    headless: dict[tuple[str, str], bool] = {}
    for service in services:
        meta, spec = service.metadata, service.spec
        if meta is None or spec is None or meta.name is None or meta.namespace is None:
            continue
        name = f"{meta.name}.{meta.namespace}.svc.{CLUSTER_DOMAIN}"
        if spec.clusterIP and spec.clusterIP != "None":
            records.append((name, spec.clusterIP))
        elif spec.clusterIP == "None":
            headless[(meta.namespace, meta.name)] = bool(spec.publishNotReadyAddresses)
    for endpoint in endpoints:
        meta = endpoint.metadata
        if meta is None or (meta.namespace, meta.name) not in headless:
            continue
        assert meta.name is not None and meta.namespace is not None
        name = f"{meta.name}.{meta.namespace}.svc.{CLUSTER_DOMAIN}"
        for subset in endpoint.subsets or []:
            addresses = list(subset.addresses or [])
            if headless[(meta.namespace, meta.name)]:
                addresses += subset.notReadyAddresses or []
            for address in addresses:
                records.append((name, address.ip))
                if address.hostname:
                    records.append((f"{address.hostname}.{name}", address.ip))
    return sorted(records)


def _kube_chains() -> list[tuple[str, str]]:
    """(table, chain) of every KUBE-* chain in this machine's iptables."""
    found = []
    for table in ("filter", "nat", "mangle"):
        listed = subprocess.run(
            ["iptables", "-w", "-t", table, "-S"], check=False, capture_output=True, text=True
        ).stdout
        found += [
            (table, line.split()[1]) for line in listed.splitlines() if line.startswith("-N KUBE-")
        ]
    return found


def _has_proxy_rules() -> bool:
    return bool(_kube_chains())


def _proxy_cleanup(bin_dir: Path) -> None:
    """kube-proxy's own removal of the KUBE-* chains and jumps it made in iptables; then
    what it leaves on purpose (its canaries, the mark chains it shares with a kubelet),
    which nothing else on this machine uses."""
    subprocess.run(
        [str(bin_dir / "kube-proxy"), "--cleanup"], check=False, capture_output=True, timeout=60
    )
    left = _kube_chains()
    for verb in ("-F", "-X"):
        for table, chain in left:
            subprocess.run(
                ["iptables", "-w", "-t", table, verb, chain], check=False, capture_output=True
            )


def _delete_node(plane: ControlPlane) -> None:
    with contextlib.closing(plane.client()) as admin:
        try:
            admin.delete(Node, NODE_NAME)
        except ApiError as exc:
            if exc.status.code != 404:
                raise


def _remove_pod_logs(uids: set[str]) -> None:
    """The pods' directories in /var/log/pods (``<namespace>_<name>_<uid>``) and the
    symlinks into them left dangling in /var/log/containers."""
    for uid in uids - {""}:
        for log in POD_LOGS.glob(f"*_{uid}"):
            shutil.rmtree(log, ignore_errors=True)
    for link in CONTAINER_LOGS.glob("*.log"):
        if link.is_symlink() and not link.exists():
            with contextlib.suppress(OSError):
                link.unlink()


def _ready(node: Node) -> bool:
    conditions = node.status.conditions if node.status else None
    return any(c.type == "Ready" and c.status == "True" for c in conditions or [])


def _sweep_stale(client: docker.DockerClient, keep: Path) -> None:
    """What a RealNode of a process that died left behind: with the lock held, no other
    real kubelet runs, so every container, mount and cgroup of the prefix is stale."""
    for container in client.containers.list(
        all=True, filters={"label": POD_UID_LABEL}, ignore_removed=True
    ):
        parent = container.attrs.get("HostConfig", {}).get("CgroupParent") or ""
        if parent.startswith(f"/{PREFIX}"):
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                container.remove(force=True, v=True)
    for stale in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if stale != keep:
            _unmount_under(stale)
            shutil.rmtree(stale, ignore_errors=True)
    for hierarchy in _cgroup_hierarchies():
        for stale_cgroup in hierarchy.glob(f"{PREFIX}*"):
            _remove_cgroups(stale_cgroup.name)
    rules = subprocess.run(
        ["iptables", "-w", "-S", "FORWARD"], check=False, capture_output=True, text=True
    ).stdout
    for line in rules.splitlines():
        if line.startswith("-A FORWARD") and f"--comment {PREFIX}" in line:
            subprocess.run(
                ["iptables", "-w", "-D", *line.split()[1:]], check=False, capture_output=True
            )
