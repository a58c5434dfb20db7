"""Tenants on one deployment (docs/tenancy.md), on a real API process beside the side
stack (its worker, Redis and dockerd): a tenant sees and drives only its own rollouts,
sandboxes and snapshots, on every route; another tenant's id is a 404; tokens are kept
as digests and added or revoked by editing the tenants file, with no restart; guessing
tokens is refused; ``/readyz`` and ``/metrics`` say nothing to the internet.

The API is one of its own (``another_api``), so this module's tenants file, its lock-out
of brute force (which locks 127.0.0.1 out of that process for a few seconds) and its
metrics listener touch no other test.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import math
import secrets
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from e2b import Sandbox
from e2b.exceptions import NotFoundException, RateLimitException
from starlette.routing import Route

from orchestrator.api.app import ROUTERS, create_app
from orchestrator.api.auth import e2b_sandbox
from orchestrator.local import free_port
from orchestrator.state.keys import Keys
from orchestrator.tenants import digest
from orchestrator.tls import tls
from tests.e2e.helpers import function_call, new_trace, orchestrator
from tests.stacks import TOKEN, Stack, another_api

pytestmark = pytest.mark.xdist_group("side")

WINDOW_S = 5.0
MAX_FAILURES = 50
"""Above the failures the module's other tests make on purpose within one window (a
revocation polled for, the operator's routes refused), repeated back to back."""
QUOTA = 4
"""Sandboxes each bursting tenant may hold (test_two_tenants_bursts_neither_starves)."""
ROUNDS = 3


@dataclass
class Tenant:
    name: str
    token: str
    grader_secret: str
    quotas: dict[str, Any] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", "X-API-KEY": self.token}


def _tenant(name: str, **quotas: Any) -> Tenant:
    return Tenant(name, secrets.token_urlsafe(32), secrets.token_urlsafe(32), quotas)


def write_tenants(path: Path, *tenants: Tenant) -> None:
    """The tenants file, as an operator writes it: digests only. Replaced in one step (a
    reader never sees half a file), as a Kubernetes Secret's volume does."""
    body = {
        "tenants": {
            t.name: {
                "tokens": [digest(t.token)],
                "grader_secrets": [digest(t.grader_secret)],
                "quotas": t.quotas,
            }
            for t in tenants
        }
    }
    staged = path.with_suffix(".new")
    staged.write_text(yaml.safe_dump(body))
    staged.replace(path)


@dataclass
class Tenancy:
    api: Stack
    tenants_file: Path
    a: Tenant
    b: Tenant
    limited: list[Tenant]
    """Tenants with quotas (test_quotas_*)."""

    def write(self, *more: Tenant) -> None:
        """The module's tenants file, with ``more`` tenants."""
        write_tenants(self.tenants_file, self.a, self.b, *self.limited, *more)

    def tenant(self, name: str) -> Tenant:
        (found,) = [t for t in self.limited if t.name == name]
        return found

    @property
    def url(self) -> str:
        return self.api.base_url

    def client(self, tenant: Tenant | None, source: str = "127.0.0.1") -> httpx.Client:
        """A client of the API as ``tenant`` (None: the operator), from address ``source``
        (a test that fails authentications on purpose uses an address of its own: the
        lock-out is per address)."""
        headers = tenant.headers() if tenant else {"Authorization": f"Bearer {TOKEN}"}
        headers.setdefault("X-API-KEY", TOKEN)
        return httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=60,
            verify=tls(),
            transport=httpx.HTTPTransport(local_address=source),
        )


@pytest.fixture(scope="module")
def tenancy(side: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenancy]:
    root = tmp_path_factory.mktemp("tenancy")
    a, b = _tenant("team-a"), _tenant("team-b")
    limited = [
        _tenant("burst-a", sandboxes=QUOTA),
        _tenant("burst-b", sandboxes=QUOTA),
        _tenant("slow-maker", creations_per_s=2),
        _tenant("slow-caller", calls_per_s=2),
        _tenant("e2b-caller", calls_per_s=2),
        _tenant("one-box", sandboxes=1),
    ]
    tenants_file = root / "tenants.yaml"
    write_tenants(tenants_file, a, b, *limited)
    with another_api(
        side,
        root,
        # The operator's token given as its digest only: nothing in the settings opens it.
        api_tokens=digest(TOKEN),
        tenants_file=tenants_file,
        auth_failures_max=MAX_FAILURES,
        auth_failures_window_s=WINDOW_S,
        api_metrics_port=free_port(),
    ) as api:
        yield Tenancy(api, tenants_file, a, b, limited)


@dataclass
class Owned:
    """What tenant A holds while B tries to reach it."""

    rollout: str
    trace: str
    item: dict[str, Any]
    sandbox: str
    access_token: str
    snapshot: str


@pytest.fixture(scope="module")
def owned(tenancy: Tenancy, side: Stack) -> Iterator[Owned]:
    item = {"codebase": side.codebase, "gold_files": ["README.md"]}
    rollout = f"ro_{uuid.uuid4().hex}"
    trace = new_trace()
    with tenancy.client(tenancy.a) as a:
        made = a.post("/v1/rollouts", json={"id": rollout, "item": item})
        assert made.status_code == 201, made.text
        called = a.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "true"})
        )
        assert called.status_code == 200, called.text
        sandbox = a.post("/sandboxes", json={"templateID": "base", "timeout": 300})
        assert sandbox.status_code == 201, sandbox.text
        sandbox_id = sandbox.json()["sandboxID"]
        snap = a.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "team-a-snap"})
        assert snap.status_code == 201, snap.text
        try:
            yield Owned(
                rollout=rollout,
                trace=trace,
                item=item,
                sandbox=sandbox_id,
                access_token=sandbox.json()["envdAccessToken"],
                snapshot=snap.json()["snapshotID"],
            )
        finally:
            a.delete(f"/v1/rollouts/{rollout}")
            a.delete(f"/v1/rollouts/{trace}")
            a.delete(f"/sandboxes/{sandbox_id}")
            a.delete(f"/templates/{snap.json()['snapshotID']}")


def _crossings(o: Owned, b: Tenant) -> dict[tuple[str, str], tuple[str, str, dict[str, Any]]]:
    """Every route that names a thing, as tenant B asks for tenant A's: (method, route)
    to (method, url, body)."""
    graded = {"trace_id": o.trace, "item": o.item, "sample": {"output_text": "x"}}
    call = function_call(o.trace, o.item, "shell", {"command": "touch /workspace/b-was-here"})
    sbx = f"/sandboxes/{o.sandbox}"
    return {
        ("GET", "/v1/rollouts/{rollout_id}"): ("GET", f"/v1/rollouts/{o.rollout}", {}),
        ("DELETE", "/v1/rollouts/{rollout_id}"): ("DELETE", f"/v1/rollouts/{o.rollout}", {}),
        ("GET", "/v1/rollouts/{rollout_id}/trajectory"): (
            "GET",
            f"/v1/rollouts/{o.rollout}/trajectory",
            {},
        ),
        ("POST", "/v1/rollouts/{rollout_id}/tools/{name}"): (
            "POST",
            f"/v1/rollouts/{o.rollout}/tools/shell",
            {"arguments": {"command": "touch /workspace/b-was-here"}},
        ),
        ("POST", "/v1/rollouts/{rollout_id}/grade"): (
            "POST",
            f"/v1/rollouts/{o.rollout}/grade",
            {"answer": "x"},
        ),
        ("POST", "/agent-rft/tools"): ("POST", "/agent-rft/tools", call),
        ("POST", "/agent-rft/tools/{name}"): ("POST", "/agent-rft/tools/shell", call),
        ("POST", "/agent-rft/grade"): ("POST", "/agent-rft/grade", graded),
        ("POST", "/agent-rft/grade/{secret}"): (
            "POST",
            f"/agent-rft/grade/{b.grader_secret}",
            graded,
        ),
        ("GET", "/sandboxes/{sandbox_id}"): ("GET", sbx, {}),
        ("DELETE", "/sandboxes/{sandbox_id}"): ("DELETE", sbx, {}),
        ("GET", "/sandboxes/{sandbox_id}/metrics"): ("GET", f"{sbx}/metrics", {}),
        ("POST", "/sandboxes/{sandbox_id}/timeout"): ("POST", f"{sbx}/timeout", {"timeout": 1}),
        ("POST", "/sandboxes/{sandbox_id}/connect"): ("POST", f"{sbx}/connect", {"timeout": 5}),
        ("POST", "/v2/sandboxes/{sandbox_id}/connect"): (
            "POST",
            f"/v2{sbx}/connect",
            {"timeout": 5},
        ),
        ("POST", "/sandboxes/{sandbox_id}/resume"): ("POST", f"{sbx}/resume", {}),
        ("POST", "/sandboxes/{sandbox_id}/pause"): ("POST", f"{sbx}/pause", {}),
        ("POST", "/sandboxes/{sandbox_id}/snapshots"): ("POST", f"{sbx}/snapshots", {}),
        ("POST", "/sandboxes/{sandbox_id}/fork"): ("POST", f"{sbx}/fork", {"count": 1}),
        ("DELETE", "/templates/{template_id}"): ("DELETE", f"/templates/{o.snapshot}", {}),
    }


LISTINGS = {
    ("GET", "/sandboxes"),
    ("GET", "/v2/sandboxes"),
    ("GET", "/snapshots"),
}
"""Routes that list: B's listing holds none of A's (test_listings_hold_only_the_tenants)."""
CREATES = {("POST", "/v1/rollouts"), ("POST", "/sandboxes"), ("POST", "/v2/sandboxes")}
"""Routes that make a thing, the caller's (test_a_create_cannot_reach_another_tenants)."""
OPERATOR_ONLY = {("GET", "/v1/readiness"), ("GET", "/metrics")}
"""The operator's alone: any tenant gets a 404 (test_operator_routes)."""
OPEN = {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/openapi.json"), ("GET", "/docs")}
OPEN |= {("GET", "/redoc"), ("GET", "/docs/oauth2-redirect")}


def test_every_route_is_tried_across_tenants(tenancy: Tenancy) -> None:
    """The table below covers the app's routes exactly: a route added later without a
    crossing case fails here. The E2B sandbox plane is reached with the sandbox's own
    access token, never a tenant's (test_the_sandbox_plane_wants_the_sandboxes_own_token)."""
    app = create_app(tenancy.api.settings)
    served = [r for router in ROUTERS for r in router.routes]
    routes = {
        (method, route.path)
        for route in [*served, *app.routes]
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }
    placeholder = Owned("r", "t", {}, "s", "x", "p")
    covered = set(_crossings(placeholder, _tenant("x"))) | LISTINGS | CREATES
    covered |= OPERATOR_ONLY | OPEN
    plane = {r for r in routes if e2b_sandbox(r[1])}
    assert {path for _, path in plane} == {
        "/health",
        "/files",
        "/process.Process/{method}",
        "/filesystem.Filesystem/{method}",
    }
    assert routes - plane == covered


def test_another_tenants_things_are_not_found_on_every_route(
    tenancy: Tenancy, owned: Owned
) -> None:
    with tenancy.client(tenancy.b) as b:
        for (method, route), (verb, url, body) in _crossings(owned, tenancy.b).items():
            response = b.request(verb, url, json=body if verb != "GET" else None)
            assert response.status_code == 404, (method, route, response.text)
    # Nothing of A's changed: its rollouts run, its sandbox lives, its snapshot is kept.
    with tenancy.client(tenancy.a) as a:
        assert a.get(f"/v1/rollouts/{owned.rollout}").json()["state"] == "active"
        assert a.get(f"/v1/rollouts/{owned.trace}").json()["score"] is None
        steps = a.get(f"/v1/rollouts/{owned.trace}/trajectory").json()["steps"]
        assert len(steps) == 1
        assert a.get(f"/sandboxes/{owned.sandbox}").json()["state"] == "running"
        listed = a.get("/snapshots").json()
        assert owned.snapshot in {s["snapshotID"] for s in listed}
        ls = a.post(
            f"/v1/rollouts/{owned.rollout}/tools/shell",
            json={"arguments": {"command": "ls /workspace/b-was-here; true"}},
        ).json()
        assert "No such file" in ls["output"]


def test_the_operator_sees_and_drives_every_tenants(tenancy: Tenancy, owned: Owned) -> None:
    with tenancy.client(None) as admin:
        assert admin.get(f"/v1/rollouts/{owned.rollout}").status_code == 200
        assert (
            admin.get(f"/sandboxes/{owned.sandbox}", headers={"X-API-KEY": TOKEN}).status_code
            == 200
        )
        listed = admin.get("/v2/sandboxes", headers={"X-API-KEY": TOKEN}).json()
        assert owned.sandbox in {s["sandboxID"] for s in listed}
        ran = admin.post(
            f"/v1/rollouts/{owned.rollout}/tools/shell", json={"arguments": {"command": "true"}}
        )
        assert ran.status_code == 200 and ran.json()["outcome"] == "ok"


def test_listings_hold_only_the_tenants(tenancy: Tenancy, owned: Owned) -> None:
    with tenancy.client(tenancy.b) as b:
        for path in ("/sandboxes", "/v2/sandboxes"):
            listed = b.get(path)
            assert listed.status_code == 200
            assert owned.sandbox not in {s["sandboxID"] for s in listed.json()}
        snapshots = b.get("/snapshots")
        assert snapshots.status_code == 200
        assert owned.snapshot not in {s["snapshotID"] for s in snapshots.json()}
        by_parent = b.get("/snapshots", params={"sandboxID": owned.sandbox}).json()
        assert by_parent == []


def test_a_create_cannot_reach_another_tenants(tenancy: Tenancy, owned: Owned) -> None:
    """A's snapshot, by id or by name, is no template for B (the answer an unknown one
    gets); A's rollout id taken is a 409 whoever asks, saying nothing of whose."""
    with tenancy.client(tenancy.b) as b:
        for template in (owned.snapshot, "team-a-snap"):
            made = b.post("/v2/sandboxes", json={"templateID": template})
            if made.status_code == 201:  # a name that is no snapshot of B's: an environment?
                b.delete(f"/sandboxes/{made.json()['sandboxID']}")
            assert made.status_code == 400, made.text
        taken = b.post("/v1/rollouts", json={"id": owned.rollout, "item": owned.item})
        assert taken.status_code == 409
        assert taken.json()["error"]["code"] == "exists"


def test_the_sandbox_plane_wants_the_sandboxes_own_token(tenancy: Tenancy, owned: Owned) -> None:
    """A tenant's token is no way into a sandbox: the plane wants the sandbox's own."""
    headers = {"E2b-Sandbox-Id": owned.sandbox, "X-Access-Token": tenancy.b.token}
    with httpx.Client(base_url=tenancy.url, verify=tls(), timeout=30) as raw:
        refused = raw.get("/files", params={"path": "/etc/os-release"}, headers=headers)
        assert refused.status_code == 400, refused.text  # as E2B's envd answers it
        assert "X-Access-Token" in refused.json()["message"]
        headers["X-Access-Token"] = owned.access_token
        read = raw.get("/files", params={"path": "/etc/os-release"}, headers=headers)
        assert read.status_code == 200


def test_the_e2b_sdk_sees_its_tenants_sandboxes_only(tenancy: Tenancy, owned: Owned) -> None:
    """The stock SDK, with B's key: A's sandbox is not found, not listed, not killed."""
    key, url = tenancy.b.token, tenancy.url
    with pytest.raises(NotFoundException):
        Sandbox.connect(owned.sandbox, api_key=key, api_url=url, sandbox_url=url)
    listed = Sandbox.list(api_key=key, api_url=url, sandbox_url=url).next_items()
    assert owned.sandbox not in {s.sandbox_id for s in listed}
    assert Sandbox.kill(owned.sandbox, api_key=key, api_url=url, sandbox_url=url) is False
    mine = Sandbox.create(api_key=key, api_url=url, sandbox_url=url)
    try:
        assert mine.commands.run("echo b").stdout == "b\n"
        with tenancy.client(tenancy.a) as a:
            assert a.get(f"/sandboxes/{mine.sandbox_id}").status_code == 404
    finally:
        mine.kill()


def test_each_tenants_grader_secret_grades_its_own(tenancy: Tenancy, side: Stack) -> None:
    item = {"codebase": side.codebase, "gold_files": ["README.md"]}
    trace = new_trace()
    graded = {"trace_id": trace, "item": item, "sample": {"output_text": "README.md"}}
    with httpx.Client(base_url=tenancy.url, verify=tls(), timeout=60) as raw:
        with tenancy.client(tenancy.b) as b:
            call = function_call(trace, item, "shell", {"command": "true"})
            assert b.post("/agent-rft/tools", json=call).status_code == 200
        assert (
            raw.post(f"/agent-rft/grade/{tenancy.a.grader_secret}", json=graded).status_code == 404
        )
        scored = raw.post(f"/agent-rft/grade/{tenancy.b.grader_secret}", json=graded)
        assert scored.status_code == 200, scored.text
        assert 0.0 <= scored.json()["score"] <= 1.0
        assert raw.post("/agent-rft/grade/" + "x" * 43, json=graded).status_code == 401
    with tenancy.client(tenancy.b) as b:
        b.delete(f"/v1/rollouts/{trace}")


def test_operator_routes(tenancy: Tenancy) -> None:
    """``/readyz`` is open and says only whether; its reasons and ``/metrics`` are the
    operator's; the scraper reads ``/metrics`` on a listener of its own."""
    with httpx.Client(base_url=tenancy.url, verify=tls(), timeout=30) as raw:
        ready = raw.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {"ready": True}
        assert raw.get("/metrics").status_code == 401
        assert raw.get("/v1/readiness").status_code == 401
    with tenancy.client(tenancy.a) as a:
        assert a.get("/metrics").status_code == 404
        assert a.get("/v1/readiness").status_code == 404
    with tenancy.client(None) as admin:
        reasons = admin.get("/v1/readiness").json()
        assert reasons["ready"] is True
        assert tenancy.api.settings.host_id in {h["host"] for h in reasons["checks"]["hosts"]}
        assert "orchestrator_tool_calls_total" in admin.get("/metrics").text
    port = tenancy.api.settings.api_metrics_port
    scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
    assert scraped.status_code == 200
    assert "orchestrator_tool_calls_total" in scraped.text
    assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=30).status_code == 404


def _until(predicate: Any, timeout_s: float = 10.0) -> None:
    """Wait for the file to be read again (it is looked at once a second)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the tenants file was not read again in time"
        time.sleep(0.1)


def test_tokens_are_added_and_revoked_without_a_restart(tenancy: Tenancy) -> None:
    c = _tenant("team-c")
    pid = tenancy.api.procs["api"].pid

    def answers(tenant: Tenant) -> int:
        # From an address of its own: waiting for a revocation fails on purpose.
        with tenancy.client(tenant, source="127.0.0.3") as client:
            return client.get("/v2/sandboxes").status_code

    assert answers(c) == 401
    try:
        tenancy.write(c)
        _until(lambda: answers(c) == 200)
        # A file that does not parse keeps the last good one: nobody is locked out.
        tenancy.tenants_file.write_text("tenants: {team-c: {tokens: [not-a-digest]}}\n")
        time.sleep(2.5)
        assert answers(c) == 200 and answers(tenancy.a) == 200
        tenancy.write()
        _until(lambda: answers(c) == 401)
        assert answers(tenancy.a) == 200
    finally:
        tenancy.write()
    assert tenancy.api.procs["api"].pid == pid and tenancy.api.procs["api"].poll() is None
    log = (tenancy.api.logs / "api.log").read_text()
    assert "audit.credential_added" in log and "audit.credential_revoked" in log
    assert "tenants.reload_refused" in log
    assert c.token not in log


def test_guessing_tokens_is_refused_even_the_right_guess(tenancy: Tenancy) -> None:
    """Past the limit of failures, the address is refused whatever it presents (a right
    guess included) until its window ends; then the right token works again. Other
    addresses are not refused meanwhile."""
    with tenancy.client(None, source="127.0.0.2") as guesser:
        for _ in range(MAX_FAILURES):
            guess = {"Authorization": f"Bearer {secrets.token_urlsafe(32)}"}
            assert guesser.get("/v1/rollouts/ro_x", headers=guess).status_code == 401
        right = {"Authorization": f"Bearer {tenancy.a.token}"}
        locked = guesser.get("/v1/rollouts/ro_x", headers=right)
        assert locked.status_code == 429, locked.text
        assert 1 <= int(locked.headers["Retry-After"]) <= WINDOW_S
        with tenancy.client(tenancy.a) as a:
            assert a.get("/v1/rollouts/ro_x").status_code == 404
        _until(lambda: guesser.get("/v1/rollouts/ro_x", headers=right).status_code == 404)


def test_the_operators_views_filter_by_tenant(
    tenancy: Tenancy, owned: Owned, side: Stack, tmp_path: Path
) -> None:
    """The CLI is the operator's: every tenant's rollouts, each with its tenant, and a
    filter to one of them for listings and exports."""
    listed = orchestrator(side, "rollouts", "ls", "--tenant", "team-a", "--limit", "500", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert {owned.rollout, owned.trace, owned.sandbox} <= {r["rollout_id"] for r in rows}
    assert {r["tenant"] for r in rows} == {"team-a"}
    out = tmp_path / "team-b.jsonl"
    exported_run = orchestrator(side, "export", str(out), "--tenant", "team-b")
    assert exported_run.returncode == 0, exported_run.stderr
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["tenant"] for r in exported} <= {"team-b"}
    assert owned.rollout not in {r["rollout_id"] for r in exported}


@dataclass
class Burst:
    """One tenant's burst of rollout creations: each one's answer and how long it took."""

    tenant: str
    statuses: list[int]
    seconds: list[float]
    created: list[str]
    refusals: list[httpx.Response]

    def percentile(self, q: float) -> float:
        ok = sorted(s for s, code in zip(self.seconds, self.statuses, strict=True) if code == 201)
        return ok[min(len(ok) - 1, math.ceil(q * len(ok)) - 1)] * 1000 if ok else math.nan


async def _burst(tenancy: Tenancy, tenant: Tenant, item: dict[str, Any], n: int) -> Burst:
    async with httpx.AsyncClient(
        base_url=tenancy.url, headers=tenant.headers(), timeout=120, verify=tls()
    ) as client:

        async def one() -> tuple[httpx.Response, float]:
            started = time.perf_counter()
            response = await client.post("/v1/rollouts", json={"item": item})
            return response, time.perf_counter() - started

        answers = await asyncio.gather(*(one() for _ in range(n)))
    return Burst(
        tenant=tenant.name,
        statuses=[r.status_code for r, _ in answers],
        seconds=[s for _, s in answers],
        created=[r.json()["rollout_id"] for r, _ in answers if r.status_code == 201],
        refusals=[r for r, _ in answers if r.status_code != 201],
    )


def _end(tenancy: Tenancy, tenant: Tenant, bursts: list[Burst]) -> None:
    with tenancy.client(tenant) as client:
        for burst in bursts:
            for rollout_id in burst.created:
                assert client.delete(f"/v1/rollouts/{rollout_id}").status_code == 200


def _refused(tenancy: Tenancy, tenant: Tenant) -> float:
    """``tenant``'s sandboxes refused so far, by the API's counter (its metrics port)."""
    port = tenancy.api.settings.api_metrics_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    name = f'orchestrator_quota_refused_total{{quota="sandboxes",tenant="{tenant.name}"}} '
    found = [float(line.removeprefix(name)) for line in text.splitlines() if line.startswith(name)]
    return found[0] if found else 0.0


def test_two_tenants_bursts_neither_starves(tenancy: Tenancy, side: Stack) -> None:
    """Tenant A bursts three times its quota of sandboxes while tenant B bursts its own: A
    holds its quota and no more, its excess refused at once (429, Retry-After), and B
    gets every sandbox it asked for, as when it bursts alone. Each one's acquisition
    times (request to 201) are printed, alone and together, over ROUNDS rounds each
    (docs/tenancy.md)."""
    a, b = tenancy.tenant("burst-a"), tenancy.tenant("burst-b")
    item = {"codebase": side.codebase, "gold_files": ["README.md"]}
    refused_before = _refused(tenancy, a)
    warm = asyncio.run(_burst(tenancy, b, item, QUOTA))  # not measured: first sandboxes
    _end(tenancy, b, [warm])
    # What an API process that died between a close and its quota's release leaves: a
    # member whose rollout ended. It is found and forgotten when B reaches its quota.
    held = Keys.of(side.settings.deployment).tenant_sandboxes(b.name)
    with redis.Redis.from_url(side.settings.redis_url) as client:
        client.zadd(held, {warm.created[0]: time.time()})
    phases: dict[tuple[str, str], list[Burst]] = {}
    for _ in range(ROUNDS):
        for tenant in (a, b):
            alone = asyncio.run(_burst(tenancy, tenant, item, QUOTA))
            _end(tenancy, tenant, [alone])
            assert alone.statuses == [201] * QUOTA, [r.text for r in alone.refusals]
            phases.setdefault((tenant.name, "alone"), []).append(alone)

        async def together() -> tuple[Burst, Burst]:
            return await asyncio.gather(
                _burst(tenancy, a, item, 3 * QUOTA), _burst(tenancy, b, item, QUOTA)
            )

        burst_a, burst_b = asyncio.run(together())
        try:
            assert burst_b.statuses == [201] * QUOTA, [r.text for r in burst_b.refusals]
            assert sorted(burst_a.statuses) == [201] * QUOTA + [429] * (2 * QUOTA)
            for refused in burst_a.refusals:
                assert refused.json()["error"]["code"] == "over_quota"
                assert int(refused.headers["Retry-After"]) >= 1
            port = tenancy.api.settings.api_metrics_port
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            for tenant in (a, b):
                held = f'orchestrator_tenant_sandboxes{{tenant="{tenant.name}"}}'
                assert f"{held} {float(QUOTA)}" in text
        finally:
            _end(tenancy, a, [burst_a])
            _end(tenancy, b, [burst_b])
        phases.setdefault((a.name, "together"), []).append(burst_a)
        phases.setdefault((b.name, "together"), []).append(burst_b)
    assert _refused(tenancy, a) - refused_before == 2 * QUOTA * ROUNDS
    print(f"\nacquisition, request to 201, ms (quota {QUOTA} sandboxes each, {ROUNDS} rounds):")
    print(f"{'tenant':10} {'phase':9} {'asked':>5} {'got':>4} {'p50':>8} {'p99':>8}")
    for (name, phase), bursts in phases.items():
        pooled = Burst(
            name,
            [c for one in bursts for c in one.statuses],
            [t for one in bursts for t in one.seconds],
            [i for one in bursts for i in one.created],
            [],
        )
        print(
            f"{name:10} {phase:9} {len(pooled.statuses):>5} {len(pooled.created):>4} "
            f"{pooled.percentile(0.5):8.0f} {pooled.percentile(0.99):8.0f}"
        )


def test_quotas_of_creations_and_calls_per_second(tenancy: Tenancy, side: Stack) -> None:
    """Past a tenant's rate, a creation is a 429 and an Agent RFT call a 503 (the platform
    retries it), each with Retry-After; a call refused changed nothing and its retry runs."""
    item = {"codebase": side.codebase, "gold_files": ["README.md"]}
    maker = tenancy.tenant("slow-maker")
    burst = asyncio.run(_burst(tenancy, maker, item, 12))
    try:
        # A second's worth (2) at once, then 2/s: a burst spread over more time by a slow
        # machine gets more, and all twelve only if it took over five seconds.
        made = burst.statuses.count(201)
        assert 2 <= made < 12 and burst.statuses.count(429) == 12 - made, burst.statuses
        assert all(r.json()["error"]["code"] == "over_quota" for r in burst.refusals)
    finally:
        _end(tenancy, maker, [burst])
    caller = tenancy.tenant("slow-caller")
    trace = new_trace()
    with tenancy.client(caller) as client:
        answers = [
            client.post(
                "/agent-rft/tools",
                json=function_call(trace, item, "shell", {"command": "echo hi"}, call_id=f"c{n}"),
            )
            for n in range(10)
        ]
        codes = [r.status_code for r in answers]
        assert codes[:2] == [200, 200] and 503 in codes[2:], codes
        throttled = next(r for r in answers if r.status_code == 503)
        assert throttled.json()["error"]["code"] == "over_quota"
        retry_s = int(throttled.headers["Retry-After"])
        steps = client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"]
        assert len(steps) == codes.count(200)
        time.sleep(retry_s)
        again = client.post(
            "/agent-rft/tools",
            json=function_call(trace, item, "shell", {"command": "echo hi"}, call_id="again"),
        )
        assert again.status_code == 200, again.text
        client.delete(f"/v1/rollouts/{trace}")


def test_an_e2b_sandboxes_commands_and_resume_keep_its_tenants_quotas(tenancy: Tenancy) -> None:
    """An E2B sandbox's commands and file operations are its tenant's tool calls, though
    they carry the sandbox's token: past the calls quota they are refused before they run
    (the SDK's RateLimitException). A paused sandbox holds no place in the sandboxes quota;
    its resume takes one again, or is refused as a new sandbox would be."""
    url = tenancy.url
    caller = tenancy.tenant("e2b-caller")

    def create(key: str) -> Sandbox:
        return Sandbox.create(
            template="base", api_key=key, api_url=url, sandbox_url=url, timeout=120
        )

    sbx = create(caller.token)
    try:

        def run(n: int) -> str:
            try:
                return sbx.commands.run(f"echo {n}").stdout.strip()
            except RateLimitException as exc:
                return str(exc)

        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(run, range(8)))
        ran = [o for o in outcomes if o.isdigit()]
        refused = [o for o in outcomes if "faster than its quota of 2.0/s" in o]
        assert len(ran) >= 2 and refused and len(ran) + len(refused) == 8, outcomes
        with pytest.raises(RateLimitException, match="faster than its quota"):
            for n in range(8):
                sbx.files.write(f"/workspace/f{n}", b"x")
    finally:
        sbx.kill()

    one = tenancy.tenant("one-box")
    first = create(one.token)
    second = None
    try:
        first.files.write("/workspace/kept", b"kept")
        assert first.pause() is True
        second = create(one.token)  # the paused one holds no place
        with pytest.raises(RateLimitException, match="holds its quota of 1 sandboxes"):
            Sandbox.connect(first.sandbox_id, api_key=one.token, api_url=url, sandbox_url=url)
        second.kill()
        resumed = Sandbox.connect(first.sandbox_id, api_key=one.token, api_url=url, sandbox_url=url)
        assert resumed.files.read("/workspace/kept") == "kept"
    finally:
        for sandbox in (first, second):
            if sandbox is not None:
                Sandbox.kill(sandbox.sandbox_id, api_key=one.token, api_url=url, sandbox_url=url)


def _audit(side: Stack, *args: str) -> list[dict[str, Any]]:
    listed = orchestrator(side, "audit", "--json", "--since", "1h", *args)
    assert listed.returncode == 0, listed.stderr
    entries: list[dict[str, Any]] = json.loads(listed.stdout)
    return entries


def test_the_audit_log_says_who_changed_what(tenancy: Tenancy, side: Stack, tmp_path: Path) -> None:
    """The tenants file's changes (once, though every API process reads the file), the
    environments the deployment serves (once for two API processes on the same ones), an
    admin's end of another tenant's rollout (a tenant's end of its own is routine), and a
    codebase added and removed from the CLI, by its user: all in ``orchestrator audit``."""
    d = _tenant("team-d")
    tenancy.write(d)
    try:
        with tenancy.client(d) as client:
            _until(lambda: client.get("/v2/sandboxes").status_code == 200)
    finally:
        tenancy.write()
    added = {
        e["details"]["kind"]: e
        for e in _audit(side, "--event", "credential_added")
        if e["details"]["tenant"] == "team-d"
    }
    assert set(added) == {"token", "grader_secret"}
    assert added["token"]["actor"] == "tenants-file"
    assert added["token"]["details"]["credential"] == digest(d.token).removeprefix("sha256:")[:12]
    assert len(_audit(side, "--event", "environments_changed")) == 1

    item = {"codebase": side.codebase, "gold_files": ["README.md"]}
    with tenancy.client(tenancy.a) as a, tenancy.client(None) as admin:
        own = a.post("/v1/rollouts", json={"item": item}).json()["rollout_id"]
        assert a.delete(f"/v1/rollouts/{own}").status_code == 200
        forced = a.post("/v1/rollouts", json={"item": item}).json()["rollout_id"]
        assert admin.delete(f"/v1/rollouts/{forced}").status_code == 200
    ended = {e["details"]["rollout_id"]: e for e in _audit(side, "--event", "rollout_ended")}
    assert own not in ended
    assert ended[forced]["actor"] == "default" and ended[forced]["details"]["tenant"] == "team-a"

    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "README.md").write_text("audited\n")
    name = f"audit-{uuid.uuid4().hex[:8]}"
    for args in (("codebase", "add", name, str(tree)), ("codebase", "rm", name)):
        done = orchestrator(side, *args)
        assert done.returncode == 0, done.stderr
    entries = [e for e in _audit(side) if e["details"].get("codebase") == name]
    assert [e["event"] for e in entries] == ["codebase_added", "codebase_removed"]
    assert {e["actor"] for e in entries} == {f"{getpass.getuser()}@{socket.gethostname()}"}
    text = orchestrator(side, "audit", "--since", "1h").stdout
    assert d.token not in text and tenancy.a.token not in text
