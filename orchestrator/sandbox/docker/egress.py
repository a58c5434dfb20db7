"""Egress on the Docker backend: one network per (deployment, policy), enforced outside the
sandbox by nftables and a DNS server of its own (docs/egress.md).

For each policy in use the host has:

- a Docker bridge network (``orch-<deployment>-egress-<digest>``, bridge ``oeg<hash>``) with
  inter-container traffic off, on a /22 of ``settings.egress_subnets``;
- in the nftables table ``inet orchestrator_egress``: a set of allowed addresses (the
  policy's CIDRs, plus whatever its domains resolved to), and chains that let the bridge's
  traffic out only to that set (TCP refused with a reset, the rest with ICMP
  admin-prohibited: the agent sees its connection refused at once, not a timeout), let
  nothing from outside start a connection into it, and let it reach its host only for DNS;
- a dnsmasq on the bridge's gateway, the sandboxes' only resolver (Docker's embedded DNS
  forwards to it): allowed names are forwarded upstream and their answers added to the
  set (dnsmasq's nftset); every other name is NXDOMAIN.

Several worker processes on a host share all of it. A per-network lock file orders them:
a sandbox's create holds it shared (so an idle network is never pruned under it), setting
a network up or removing it holds it exclusive. Its mtime is the network's last use.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from docker import DockerClient
from docker.errors import APIError, NotFound
from docker.types import IPAMConfig, IPAMPool

from orchestrator.config import Settings
from orchestrator.observability.logging import get_logger
from orchestrator.sandbox import labels
from orchestrator.sandbox.backend import SandboxError
from orchestrator.sandbox.docker import states
from orchestrator.sandbox.egress import EgressPolicy

log = get_logger(__name__)

TABLE = "orchestrator_egress"
POLICY_LABEL = labels.PREFIX + "egress"
SUBNET_PREFIX = 22
"""Each network's size: 1,021 sandboxes of one policy at once on one host."""
TOOL_TIMEOUT_S = 10.0
"""How long nft or dnsmasq may take to answer."""


@dataclass(frozen=True)
class EgressNetwork:
    """One policy's network on this host, as a sandbox's create needs it."""

    name: str
    gateway: str
    """The bridge's address: the sandbox's resolver."""


def _host_tool(
    argv: list[str], *, what: str, package: str, stdin: str | None = None, detach: bool = False
) -> None:
    """Run one of the host's own tools (nft, dnsmasq) for an egress network; its failure,
    or its absence, is a :class:`SandboxError` saying ``what`` failed and why. ``detach``:
    in a session of its own (a daemon that outlives the worker)."""
    found = shutil.which(argv[0]) or f"/usr/sbin/{argv[0]}"
    try:
        subprocess.run(
            [found, *argv[1:]],
            input=stdin,
            text=True,
            capture_output=True,
            check=True,
            timeout=TOOL_TIMEOUT_S,
            start_new_session=detach,
        )
    except FileNotFoundError:
        raise SandboxError(
            f"egress needs {argv[0]} on the sandbox host (Debian's {package})"
        ) from None
    except subprocess.CalledProcessError as exc:
        raise SandboxError(f"{what}: {exc.stderr.strip()}") from exc
    except subprocess.TimeoutExpired as exc:
        raise SandboxError(f"{what}: no answer in {TOOL_TIMEOUT_S:.0f} s") from exc


def _nft(script: str) -> None:
    """Apply ``script`` as one nftables transaction (all of it or nothing)."""
    _host_tool(
        ["nft", "-f", "-"], what="nft refused the egress rules", package="nftables", stdin=script
    )


def upstream_servers(settings: Settings) -> list[str]:
    """Where allowed names are resolved: ``settings.egress_dns_servers``, else the host's
    own resolvers (/etc/resolv.conf). dnsmasq's syntax: ``address`` or ``address#port``."""
    configured = [s.strip() for s in settings.egress_dns_servers.split(",") if s.strip()]
    if configured:
        return configured
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                found.append(parts[1])
    return found


class EgressNetworks:
    """The egress networks of one deployment on this host."""

    def __init__(self, client: DockerClient, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.dir = settings.state_dir / "egress" / settings.deployment
        self._ready: dict[str, EgressNetwork] = {}

    # -- names -----------------------------------------------------------------------------

    def _key(self, policy: EgressPolicy) -> str:
        # The deployment is in the key: deployments sharing a host share no network, so
        # each prunes only its own.
        return hashlib.sha256(f"{self.settings.deployment}\0{policy.digest}".encode()).hexdigest()[
            :10
        ]

    def network_name(self, policy: EgressPolicy) -> str:
        """The Docker network of ``policy``'s sandboxes."""
        return f"orch-{self.settings.deployment}-egress-{policy.digest}"

    @staticmethod
    def _bridge(key: str) -> str:
        return f"oeg{key}"  # an interface name has 15 characters at most

    # -- use -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def attached(self, policy: EgressPolicy) -> Iterator[EgressNetwork]:
        """The network of ``policy``, set up if it is not, held for the caller's create and
        start of a container on it (a prune waits for neither)."""
        key = self._key(policy)
        self.dir.mkdir(parents=True, exist_ok=True)
        lock_path = self.dir / f"{key}.lock"
        with lock_path.open("a+b") as lock:
            while True:
                fcntl.flock(lock, fcntl.LOCK_SH)
                network = self._ready.get(key)
                if network is not None and self._intact(key):
                    os.utime(lock_path)
                    try:
                        yield network
                    finally:
                        fcntl.flock(lock, fcntl.LOCK_UN)
                    return
                fcntl.flock(lock, fcntl.LOCK_UN)
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    self._ready[key] = self._set_up(policy, key)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)

    def _intact(self, key: str) -> bool:
        """Whether this host still has what :meth:`_set_up` made (a prune by another
        process removes the marker first; a crashed dnsmasq leaves its pid dead)."""
        state = self.dir / key
        try:
            (state / "ready").stat()
        except OSError:
            return False
        return _dnsmasq_pid(state) is not None

    # -- set-up ----------------------------------------------------------------------------

    def _set_up(self, policy: EgressPolicy, key: str) -> EgressNetwork:
        started = time.monotonic()
        name = self.network_name(policy)
        bridge = self._bridge(key)
        state = self.dir / key
        state.mkdir(exist_ok=True)
        (state / "ready").unlink(missing_ok=True)
        subnet, gateway = self._network(policy, name, bridge)
        servers = upstream_servers(self.settings)
        if policy.allow_domains and not servers:
            raise SandboxError(
                "egress allows domains but this host has no DNS server to ask: set "
                "ORCH_EGRESS_DNS_SERVERS"
            )
        _nft(nft_rules(key, bridge, gateway, policy))
        self._dnsmasq(state, key, gateway, policy, servers)
        (state / "ready").write_text(f"{name}\n{subnet}\n")
        log.info(
            "egress.network_ready",
            network=name,
            subnet=subnet,
            domains=list(policy.allow_domains),
            cidrs=list(policy.allow_cidrs),
            ms=round((time.monotonic() - started) * 1000, 1),
        )
        return EgressNetwork(name=name, gateway=gateway)

    def _network(self, policy: EgressPolicy, name: str, bridge: str) -> tuple[str, str]:
        """The Docker network ``name``: found, or made on a free /22. Returns its subnet and
        gateway."""
        try:
            found = self.client.api.inspect_network(name)
        except NotFound:
            found = None
        except APIError as exc:
            raise states.docker_fault("inspect an egress network", exc) from exc
        if found is None:
            return self._create_network(policy, name, bridge)
        config = (found.get("IPAM") or {}).get("Config") or [{}]
        return str(config[0].get("Subnet", "")), str(config[0].get("Gateway", ""))

    def _create_network(self, policy: EgressPolicy, name: str, bridge: str) -> tuple[str, str]:
        api = self.client.api
        for attempt in range(3):
            with self._allocation_lock():
                subnet = self._free_subnet()
                gateway = str(next(subnet.hosts()))
                try:
                    api.create_network(
                        name,
                        driver="bridge",
                        options={
                            "com.docker.network.bridge.name": bridge,
                            "com.docker.network.bridge.enable_icc": "false",
                        },
                        ipam=IPAMConfig(
                            pool_configs=[IPAMPool(subnet=str(subnet), gateway=gateway)]
                        ),
                        labels={
                            labels.MANAGED: "true",
                            labels.DEPLOYMENT: self.settings.deployment,
                            POLICY_LABEL: policy.model_dump_json(),
                        },
                        check_duplicate=True,
                    )
                except APIError as exc:
                    # Another deployment's (with a state_dir of its own, so another lock)
                    # took the same subnet in between: choose again.
                    if "overlap" in str(exc).lower() and attempt < 2:
                        continue
                    raise states.docker_fault(f"create egress network {name}", exc) from exc
            return str(subnet), gateway
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _allocation_lock(self) -> Iterator[None]:
        # Host-wide, not per deployment: two deployments on one host take subnets from the
        # same pool.
        path = self.settings.state_dir / "egress" / "subnets.lock"
        with path.open("a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _free_subnet(self) -> ipaddress.IPv4Network:
        pool = ipaddress.IPv4Network(self.settings.egress_subnets)
        taken: list[ipaddress.IPv4Network] = []
        try:
            for network in self.client.api.networks():
                for config in (network.get("IPAM") or {}).get("Config") or []:
                    with contextlib.suppress(ValueError, KeyError):
                        taken.append(ipaddress.IPv4Network(config["Subnet"], strict=False))
        except APIError as exc:
            raise states.docker_fault("list networks", exc) from exc
        prefix = max(SUBNET_PREFIX, pool.prefixlen)
        for candidate in pool.subnets(new_prefix=prefix):
            if not any(candidate.overlaps(t) for t in taken):
                return candidate
        raise SandboxError(
            f"no free /{prefix} left in ORCH_EGRESS_SUBNETS ({pool}) for another egress "
            "policy: widen it, or use fewer distinct policies at once"
        )

    def _dnsmasq(
        self, state: Path, key: str, gateway: str, policy: EgressPolicy, servers: list[str]
    ) -> None:
        pid_file = state / "dnsmasq.pid"
        lines = [
            "no-resolv",
            "no-hosts",
            "no-poll",
            "bind-dynamic",
            f"listen-address={gateway}",
            "except-interface=lo",
            # Every name not allowed below: NXDOMAIN.
            "address=/#/",
            "cache-size=1000",
            f"pid-file={pid_file}",
            f"log-facility={state / 'dnsmasq.log'}",
        ]
        for domain in policy.allow_domains:
            lines += [f"server=/{domain}/{server}" for server in servers]
            lines.append(f"nftset=/{domain}/4#inet#{TABLE}#allow_{key}")
        conf = state / "dnsmasq.conf"
        text = "\n".join(lines) + "\n"
        running = _dnsmasq_pid(state)
        if running is not None:
            if conf.read_text() == text:
                return  # a worker's restart leaves the resolver its sandboxes use alone
            _stop(running)
        conf.write_text(text)
        # dnsmasq forks once it listens; its own exit status says whether it could.
        _host_tool(
            ["dnsmasq", f"--conf-file={conf}"],
            what="the egress DNS server did not start",
            package="dnsmasq-base",
            detach=True,
        )

    # -- removal ---------------------------------------------------------------------------

    def prune(self, *, idle_s: float) -> int:
        """Remove this deployment's egress networks that no sandbox is on and none used for
        ``idle_s`` (0: every unused one). Returns how many were removed."""
        try:
            wanted = [*labels.deployment_filter(self.settings.deployment), POLICY_LABEL]
            networks = self.client.api.networks(filters={"label": wanted})
        except APIError as exc:
            raise states.docker_fault("list egress networks", exc) from exc
        removed = 0
        for summary in networks:
            try:
                policy = EgressPolicy.model_validate_json(
                    (summary.get("Labels") or {}).get(POLICY_LABEL, "{}")
                )
            except ValueError:
                continue
            if self._remove_if_unused(policy, idle_s):
                removed += 1
        return removed

    def _remove_if_unused(self, policy: EgressPolicy, idle_s: float) -> bool:
        key = self._key(policy)
        name = self.network_name(policy)
        self.dir.mkdir(parents=True, exist_ok=True)
        lock_path = self.dir / f"{key}.lock"
        with lock_path.open("a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a create is using it right now
            try:
                if idle_s and time.time() - lock_path.stat().st_mtime < idle_s:
                    return False
                try:
                    details = self.client.api.inspect_network(name)
                    # Stopped containers too (a reset restarting one): the network's own
                    # view lists only those with a live endpoint.
                    on_it = self.client.api.containers(all=True, filters={"network": name})
                except NotFound:
                    details, on_it = {}, []
                except APIError as exc:
                    raise states.docker_fault("inspect an egress network", exc) from exc
                if on_it:
                    return False
                self._tear_down(key, name, details)
                return True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _tear_down(self, key: str, name: str, details: dict[str, object]) -> None:
        state = self.dir / key
        self._ready.pop(key, None)
        (state / "ready").unlink(missing_ok=True)
        pid = _dnsmasq_pid(state)
        if pid is not None:
            _stop(pid)
        bridge = self._bridge(key)
        # Each statement on its own: a half-made network (a crash mid set-up) lacks some.
        for statement in (
            f'delete element inet {TABLE} out_of {{ "{bridge}" }}',
            f'delete element inet {TABLE} into {{ "{bridge}" }}',
            f'delete element inet {TABLE} host_from {{ "{bridge}" }}',
            f"delete chain inet {TABLE} out_{key}",
            f"delete chain inet {TABLE} into_{key}",
            f"delete chain inet {TABLE} host_{key}",
            f"delete set inet {TABLE} allow_{key}",
        ):
            with contextlib.suppress(SandboxError):
                _nft(statement)
        if details:
            try:
                self.client.api.remove_network(name)
            except NotFound:
                pass
            except APIError as exc:
                raise states.docker_fault(f"remove egress network {name}", exc) from exc
        shutil.rmtree(state, ignore_errors=True)
        log.info("egress.network_removed", network=name)


def nft_rules(key: str, bridge: str, gateway: str, policy: EgressPolicy) -> str:
    """The nftables transaction that makes (or remakes) one network's rules. Base chains
    come first with their maps: idempotent, so every set-up may carry them."""
    table = f"inet {TABLE}"
    elements = ", ".join(policy.allow_cidrs)
    lines = [
        f"add table {table}",
        f"add map {table} out_of {{ type ifname : verdict; }}",
        f"add map {table} into {{ type ifname : verdict; }}",
        f"add map {table} host_from {{ type ifname : verdict; }}",
        # Before Docker's own filter (priority 0): a drop here is final, an accept is not
        # (Docker's chains still decide, as for any of its networks).
        f"add chain {table} forward {{ type filter hook forward priority filter - 5; }}",
        f"add chain {table} input {{ type filter hook input priority filter - 5; }}",
        f"flush chain {table} forward",
        f"flush chain {table} input",
        f"add rule {table} forward iifname vmap @out_of",
        f"add rule {table} forward oifname vmap @into",
        f"add rule {table} input iifname vmap @host_from",
        # auto-merge: an allowed name's address inside an allowed CIDR (added by dnsmasq
        # after the CIDR), or the CIDRs added again over it, is no overlap error.
        f"add set {table} allow_{key} {{ type ipv4_addr; flags interval; auto-merge; }}",
    ]
    if elements:
        lines.append(f"add element {table} allow_{key} {{ {elements} }}")
    for chain in ("out", "into", "host"):
        lines += [f"add chain {table} {chain}_{key}", f"flush chain {table} {chain}_{key}"]
    lines += [
        # Sandbox to sandbox on the same bridge (Docker's icc=false says the same).
        f'add rule {table} out_{key} oifname "{bridge}" drop',
        f"add rule {table} out_{key} ip daddr @allow_{key} return",
        f"add rule {table} out_{key} meta l4proto tcp reject with tcp reset",
        f"add rule {table} out_{key} reject with icmpx admin-prohibited",
        f"add rule {table} into_{key} ct state established,related return",
        f"add rule {table} into_{key} drop",
        f"add rule {table} host_{key} ip daddr {gateway} udp dport 53 return",
        f"add rule {table} host_{key} ip daddr {gateway} tcp dport 53 return",
        f"add rule {table} host_{key} meta l4proto tcp reject with tcp reset",
        f"add rule {table} host_{key} reject with icmpx admin-prohibited",
        f'add element {table} out_of {{ "{bridge}" : jump out_{key} }}',
        f'add element {table} into {{ "{bridge}" : jump into_{key} }}',
        f'add element {table} host_from {{ "{bridge}" : jump host_{key} }}',
    ]
    return "\n".join(lines) + "\n"


def _dnsmasq_pid(state: Path) -> int | None:
    """The pid of ``state``'s dnsmasq if it runs (a pid file outlives its process, and its
    number may be another's by now: the command line must name this configuration)."""
    try:
        pid = int((state / "dnsmasq.pid").read_text().strip())
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if str(state / "dnsmasq.conf").encode() in command and _alive(pid) else None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie does not (a daemon's parent may be slow to reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _stop(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
