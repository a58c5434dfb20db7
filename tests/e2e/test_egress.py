"""Egress policies (docs/egress.md), against real services in a network namespace this
module makes (a veth pair to the host, three addresses, an HTTP server on each and a DNS
server on the first), through a deployment of the module's own:

- an allowed name resolves and its service answers; a name not allowed is NXDOMAIN; an
  address not allowed, the sandbox's own host and a sandbox beside it are refused. Each
  refusal is the agent's own failed connection: the call is ``ok``, the rollout is graded;
- an environment with no policy has no network at all;
- the E2B SDK's ``allow_internet_access`` and ``network`` narrow the policy, never widen it;
- once no sandbox uses it, the network, its rules and its DNS server are removed.
"""

from __future__ import annotations

import ipaddress
import shlex
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest
import yaml

from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.docker.egress import TABLE
from orchestrator.sandbox.egress import EgressPolicy
from tests.e2e.conftest import side_stack
from tests.e2e.helpers import function_call, new_trace, wait_for
from tests.stacks import TOKEN, Stack

pytestmark = pytest.mark.xdist_group("e2e")

PORT = 8080
ALLOWED_NAME = "search.allowed.test"
BLOCKED_NAME = "answers.blocked.test"
PROBE = r"""
import socket, sys, urllib.request
for url in sys.argv[1:]:
    try:
        print(url, "->", urllib.request.urlopen(url, timeout=5).read().decode().strip())
    except Exception as exc:
        print(url, "-> failed:", getattr(exc, "reason", exc))
"""


@dataclass(frozen=True)
class Services:
    """The namespace's addresses: ``allowed`` (named ALLOWED_NAME, also the DNS server),
    ``refused`` (named BLOCKED_NAME) and ``by_cidr`` (allowed by address)."""

    host: str
    allowed: str
    refused: str
    by_cidr: str

    def url(self, where: str) -> str:
        return f"http://{where}:{PORT}/"


def _free_subnet() -> ipaddress.IPv4Network:
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    taken = [
        ipaddress.IPv4Network(line.split()[0], strict=False)
        for line in routes.splitlines()
        if line and line.split()[0][0].isdigit()
    ]
    for third in range(200, 250):
        candidate = ipaddress.IPv4Network(f"10.254.{third}.0/24")
        if not any(candidate.overlaps(t) for t in taken):
            return candidate
    raise RuntimeError("no free 10.254.x.0/24 for the test's namespace")


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("egress-services")
    netns = f"orch-egress-{uuid.uuid4().hex[:8]}"
    host_if, ns_if = f"veg{netns[-8:]}", f"vegn{netns[-8:]}"[:15]
    subnet = _free_subnet()
    host, allowed, refused, by_cidr = (str(subnet[n]) for n in (1, 2, 3, 4))
    procs: list[subprocess.Popen[bytes]] = []

    def run(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True)

    def in_ns(*argv: str) -> list[str]:
        return ["ip", "netns", "exec", netns, *argv]

    run("ip", "netns", "add", netns)
    try:
        run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        run("ip", "link", "set", ns_if, "netns", netns)
        run("ip", "addr", "add", f"{host}/24", "dev", host_if)
        run("ip", "link", "set", host_if, "up")
        for address in (allowed, refused, by_cidr):
            run(*in_ns("ip", "addr", "add", f"{address}/24", "dev", ns_if))
        run(*in_ns("ip", "link", "set", ns_if, "up"))
        run(*in_ns("ip", "link", "set", "lo", "up"))
        for address in (allowed, refused, by_cidr):
            page = root / address
            page.mkdir()
            (page / "index.html").write_text(f"service at {address}\n")
            procs.append(
                subprocess.Popen(
                    in_ns(sys.executable, "-m", "http.server", "--bind", address, str(PORT)),
                    cwd=page,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        # The operator's resolver: the one DNS server that knows both names.
        procs.append(
            subprocess.Popen(
                in_ns(
                    "/usr/sbin/dnsmasq",
                    "--keep-in-foreground",
                    "--no-resolv",
                    "--no-hosts",
                    "--bind-interfaces",
                    f"--listen-address={allowed}",
                    f"--host-record={ALLOWED_NAME},{allowed}",
                    f"--host-record={BLOCKED_NAME},{refused}",
                    f"--pid-file={root / 'dns.pid'}",
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        for address in (allowed, refused, by_cidr):
            wait_for(partial(_answers, address), timeout_s=10, what=f"the service at {address}")
        _wait_for_dns(allowed)
        yield Services(host=host, allowed=allowed, refused=refused, by_cidr=by_cidr)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        subprocess.run(["ip", "netns", "delete", netns], check=False)


def _answers(address: str) -> bool:
    """Whether the service at ``address`` answers from the host (the veth's other end)."""
    try:
        httpx.get(f"http://{address}:{PORT}/", timeout=1)
    except httpx.HTTPError:
        return False
    return True


def _wait_for_dns(address: str) -> None:
    """Until the DNS server at ``address`` answers a query for ALLOWED_NAME (a bare DNS
    message: an id, recursion desired, one question of type A, class IN)."""
    name = b"".join(bytes([len(p)]) + p.encode() for p in ALLOWED_NAME.split("."))
    query = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + name + b"\x00\x00\x01\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.1)
        for _ in range(200):
            sock.sendto(query, (address, 53))
            try:
                if sock.recv(512)[:2] == query[:2]:
                    return
            except TimeoutError:
                continue
    raise RuntimeError(f"the DNS server at {address} did not come up")


@pytest.fixture(scope="module")
def egress_stack(
    stack: Stack, services: Services, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("egress")
    policy = {"allow_domains": ["allowed.test"], "allow_cidrs": [f"{services.by_cidr}/32"]}
    environments = {
        "environments": [
            {
                "name": "networked",
                "tools": ["shell"],
                "egress": policy,
                "grader": {"name": "file_f1"},
                "reuse": False,
                # No warm pool: test_an_unused_network_is_removed needs it empty.
                "pool_autosize": False,
            },
            {
                "name": "offline",
                "tools": ["shell"],
                "grader": {"name": "file_f1"},
                "pool_autosize": False,
            },
        ]
    }
    path = root / "environments.yaml"
    path.write_text(yaml.safe_dump(environments))
    with side_stack(
        stack, root, name="egress", environments_file=path, egress_dns_servers=services.allowed
    ) as made:
        yield made
    # The deployment's end (local_stack: collect_expired, everything) removed its networks.
    backend = DockerBackend(made.settings)
    assert not backend.client.api.networks(filters={"name": f"orch-{made.settings.deployment}"})


def _item(stack: Stack, environment: str = "networked") -> dict[str, Any]:
    return {"environment": environment, "codebase": stack.codebase, "gold_files": ["README.md"]}


def _probe_command(*urls: str) -> str:
    return shlex.join(["python3", "-c", PROBE, *urls])


def _lines(output: str) -> dict[str, str]:
    found = {}
    for line in output.splitlines():
        url, sep, result = line.partition(" -> ")
        if sep:
            found[url] = result
    return found


def _shell(client: Any, trace: str, stack: Stack, command: str, env: str = "networked") -> str:
    answer = client.post(
        "/agent-rft/tools",
        json=function_call(trace, _item(stack, env), "shell", {"command": command}),
    )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["output"])


def test_only_what_the_policy_allows_is_reached_and_a_refusal_is_scored(
    egress_stack: Stack, services: Services
) -> None:
    trace = new_trace()
    urls = [
        services.url(ALLOWED_NAME),
        services.url(services.by_cidr),
        services.url(BLOCKED_NAME),
        services.url(services.refused),
        services.url(services.allowed),  # allowed now: its name resolved to it above
        services.url(services.host),
    ]
    with egress_stack.client() as client:
        seen = _lines(_shell(client, trace, egress_stack, _probe_command(*urls)))
        assert urls[0] in seen, seen
        assert seen[urls[0]] == f"service at {services.allowed}", seen
        assert seen[urls[1]] == f"service at {services.by_cidr}"
        assert "Name or service not known" in seen[urls[2]]  # NXDOMAIN: never resolved
        assert "Connection refused" in seen[urls[3]]
        assert seen[urls[4]] == f"service at {services.allowed}"
        assert "Connection refused" in seen[urls[5]]
        # The sandbox's own host, where the API listens: its DNS server only.
        api = f"http://{_gateway(egress_stack)}:{egress_stack.settings.api_port}/readyz"
        seen = _lines(_shell(client, trace, egress_stack, _probe_command(api)))
        assert "Connection refused" in seen[api], seen
        steps = client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"]
        assert [s["outcome"] for s in steps] == ["ok", "ok"]
        graded = client.post(
            "/agent-rft/grade",
            json={
                "trace_id": trace,
                "item": _item(egress_stack),
                "sample": {"output_text": "README.md"},
            },
        )
        assert graded.status_code == 200, graded.text
        assert client.get(f"/v1/rollouts/{trace}").json()["state"] != "infra_failed"


def test_no_policy_no_network(egress_stack: Stack, services: Services) -> None:
    trace = new_trace()
    with egress_stack.client() as client:
        output = _shell(
            client, trace, egress_stack, _probe_command(services.url(services.by_cidr)), "offline"
        )
        assert "Network is unreachable" in output, output
        client.delete(f"/v1/rollouts/{trace}")


def test_a_sandbox_beside_it_is_not_reachable(egress_stack: Stack) -> None:
    # A connection to a port where nothing listens tells the two apart: reached, the
    # peer's kernel refuses it at once (ECONNREFUSED); cut off, it times out.
    one, other = new_trace(), new_trace()
    own_address = "import socket; print(socket.gethostbyname(socket.gethostname()))"
    with egress_stack.client() as client:
        address = _shell(client, one, egress_stack, f'python3 -c "{own_address}"').split()[0]
        ipaddress.IPv4Address(address)
        connect = (
            "import socket; s = socket.socket(); s.settimeout(2); "
            f"print(s.connect_ex(('{address}', 9)))"
        )
        here = _shell(client, one, egress_stack, f'python3 -c "{connect}"').split()[0]
        assert here == "111"  # from itself: reached, refused
        there = _shell(client, other, egress_stack, f'python3 -c "{connect}"').split()[0]
        assert there == "11", there  # EAGAIN: timed out, never reached
        for trace in (one, other):
            client.delete(f"/v1/rollouts/{trace}")


def test_e2b_network_options_narrow_the_policy(
    egress_stack: Stack, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    from e2b import Sandbox

    monkeypatch.setenv("E2B_API_URL", egress_stack.base_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", egress_stack.base_url)
    monkeypatch.setenv("E2B_API_KEY", TOKEN)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    template = f"networked/{egress_stack.codebase}"
    both = [services.url(ALLOWED_NAME), services.url(services.by_cidr)]
    probe = _probe_command(*both)

    offline = Sandbox.create(template=template, timeout=120, allow_internet_access=False)
    try:
        seen = _lines(offline.commands.run(probe).stdout)
        assert all("failed" in seen[u] for u in both), seen
    finally:
        offline.kill()

    narrowed = Sandbox.create(template=template, timeout=120, network={"allow_out": [ALLOWED_NAME]})
    try:
        seen = _lines(narrowed.commands.run(probe).stdout)
        assert seen[both[0]] == f"service at {services.allowed}"
        assert "Connection refused" in seen[both[1]]  # the template allows it; this one not
    finally:
        narrowed.kill()

    whole = Sandbox.create(template=template, timeout=120)
    try:
        seen = _lines(whole.commands.run(probe).stdout)
        assert seen[both[1]] == f"service at {services.by_cidr}"
    finally:
        whole.kill()

    with pytest.raises(Exception, match="outside this template's egress policy"):
        Sandbox.create(template=template, timeout=120, network={"allow_out": ["example.com"]})


def test_an_unused_network_is_removed_with_its_rules_and_resolver(
    egress_stack: Stack, services: Services
) -> None:
    backend = DockerBackend(egress_stack.settings)
    trace = new_trace()
    with egress_stack.client() as client:
        _shell(client, trace, egress_stack, "true")
        assert client.delete(f"/v1/rollouts/{trace}").status_code in (200, 204)
    policy = EgressPolicy(allow_domains=["allowed.test"], allow_cidrs=[services.by_cidr])
    name = backend.egress.network_name(policy)
    wait_for(
        lambda: not backend.client.api.inspect_network(name).get("Containers"),
        timeout_s=10,
        what=f"no sandbox on {name}",
    )
    assert backend.egress.prune(idle_s=0) >= 1
    assert not backend.client.api.networks(names=[name])
    table = subprocess.run(
        ["nft", "list", "table", "inet", TABLE], capture_output=True, text=True
    ).stdout
    key = backend.egress._key(policy)
    assert f"allow_{key}" not in table and f"out_{key}" not in table
    running = subprocess.run(["pgrep", "-af", "dnsmasq"], capture_output=True, text=True).stdout
    assert str(backend.egress.dir / key) not in running
    # The next sandbox of the policy makes it again.
    again = new_trace()
    with egress_stack.client() as client:
        output = _shell(client, again, egress_stack, _probe_command(services.url(ALLOWED_NAME)))
        assert f"service at {services.allowed}" in output
        client.delete(f"/v1/rollouts/{again}")


def _gateway(stack: Stack) -> str:
    backend = DockerBackend(stack.settings)
    found = backend.client.api.networks(filters={"name": f"orch-{stack.settings.deployment}"})
    return str(found[0]["IPAM"]["Config"][0]["Gateway"]) if found else "10.231.0.1"
