"""Schema-driven fuzzing of every operation of the real API (schemathesis 4), against the
app's own OpenAPI document: schemathesis generates valid and invalid requests from it (its
coverage phase: boundary values, missing and wrong-typed fields, bad path parameters;
then its fuzzing phase), sends them to the running stack with and without the token, and
checks each answer against the document. On top of its checks, for every request:

- no 5xx: nothing generated here is an infrastructure fault;
- a rejected request (4xx) changes no state: no Redis key of the deployment added, removed
  or changed, no container or volume (see ``Deployment`` in test_fuzz.py).

Then transport-level abuse the document cannot describe (wrong content types, deep and
huge JSON, unknown fields, hostile path segments), again for every operation, and the
accepted answers of a whole lifecycle validated against the document.

The schema is the app's own (``create_app(...).openapi()``, checked equal to the running
app's ``/openapi.json``): schemathesis's lazy ``from_fixture`` loader does not work with
pytest 9 (it sets ``Node._nodeid``, which pytest 9 removed), so the schema is built at
import and the requests go to the stack's URL.

Where the document is known to be incomplete, a check is switched off for that operation
only, with the reason next to it (``SCHEMA_GAPS``; and the lifecycle's one 409 on an Agent
RFT route).
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case
from schemathesis import checks as st_checks
from schemathesis.config import SchemathesisConfig

from orchestrator.api.app import create_app
from orchestrator.api.auth import OPEN_PATHS
from orchestrator.config import Settings
from orchestrator.tls import tls
from tests.e2e.helpers import function_call, new_trace
from tests.e2e.test_fuzz import Deployment, DeploymentState, json_values
from tests.stacks import TOKEN, Stack

pytestmark = pytest.mark.xdist_group("e2e")

AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Taken in turn, one per generated request.
BAD_AUTH = itertools.cycle(
    [
        {},
        {"Authorization": f"Bearer wrong-{TOKEN}"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
        {"Authorization": f"Bearer {TOKEN}" + "x" * 20_000},
    ]
)
OPENAPI: dict[str, Any] = create_app(Settings(api_tokens="schema-only")).openapi()
# Every phase the pytest plugin runs: examples (the document has none), coverage (each
# boundary and each violation of the document, and undocumented methods), fuzzing.
schema = schemathesis.openapi.from_dict(copy.deepcopy(OPENAPI), config=SchemathesisConfig())
# Without a token the body is never read: random requests are enough, no coverage phase.
schema_fuzzing_only = schemathesis.openapi.from_dict(
    copy.deepcopy(OPENAPI),
    config=SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False}}}),
)
OPERATIONS = sorted(
    (method.upper(), path) for path, operations in OPENAPI["paths"].items() for method in operations
)
LIMIT = Settings().max_request_bytes

CheckFunction = Callable[..., Any]
# Checks switched off for one operation because the document does not say what the API
# does. Each is a gap in the schema (or, for the Allow header, in the routing), reported to
# be fixed there; remove the entry once it is.
SCHEMA_GAPS: dict[tuple[str, str], list[tuple[CheckFunction, str]]] = {
    ("GET", "/v1/rollouts/{rollout_id}"): [
        # GET and DELETE are two routes; Starlette's 405 names only the first one's methods.
        (st_checks.allow_header_conformance, "405 says `Allow: GET`, not `GET, DELETE`"),
    ],
    ("DELETE", "/v1/rollouts/{rollout_id}"): [
        (st_checks.allow_header_conformance, "405 says `Allow: GET`, not `GET, DELETE`"),
    ],
}
# Everywhere: a schema-valid body may still be refused (422) for what JSON Schema cannot
# say here: the dataset row must name a registered codebase or environment, /agent-rft/tools
# needs a non-empty `name` (the model is shared with /agent-rft/tools/{name}, where it is
# ignored), and a rollout grade takes exactly one of `answer` and `sample`.
EXCLUDED_EVERYWHERE: list[CheckFunction] = [st_checks.positive_data_acceptance]
CONFORMANCE: list[CheckFunction] = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_headers_conformance,
    st_checks.response_schema_conformance,
]


def _excluded(case: Case[Any]) -> list[CheckFunction]:
    # The operation's own method: the coverage phase also sends it with undocumented ones.
    key = (case.operation.method.upper(), case.operation.path)
    return EXCLUDED_EVERYWHERE + [check for check, _ in SCHEMA_GAPS.get(key, [])]


SCHEMA_FUZZ = settings(
    max_examples=8,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        # _forget_state: once per test, on purpose, not once per example.
        HealthCheck.function_scoped_fixture,
    ],
)


@pytest.fixture(scope="module")
def deployment(stack: Stack) -> Iterator[Deployment]:
    """The stack's state, read directly; at the end, every rollout this module's accepted
    requests made is deleted through the API (which destroys its sandbox)."""
    d = Deployment(stack.settings)
    baseline = d.state().rollout_ids()
    yield d
    with stack.client() as client:
        for rollout_id in sorted(d.state().rollout_ids() - baseline):
            response = client.delete(f"/v1/rollouts/{quote(rollout_id, safe='')}")
            assert response.status_code in (200, 409), response.text
    d.close()


@pytest.fixture(autouse=True)
def _forget_state(deployment: Deployment) -> None:
    """Each test starts from a state read afresh (another test may have changed it)."""
    deployment.last = None


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[httpx.Client]:
    with stack.client() as c:
        yield c


def _unchanged(
    what: str, status: int, text: str, before: DeploymentState, after: DeploymentState
) -> None:
    assert after == before, (
        f"{what} was rejected with {status} ({text[:300]}) but changed state: {before.diff(after)}"
    )


def test_schema_is_the_running_apps(stack: Stack) -> None:
    response = httpx.get(f"{stack.base_url}/openapi.json", timeout=30, verify=tls())
    assert response.status_code == 200
    assert response.json() == OPENAPI


@schema.parametrize()
@SCHEMA_FUZZ
def test_every_operation_with_token(case: Case[Any], stack: Stack, deployment: Deployment) -> None:
    """Generated requests with the right token: the answer conforms to the document, is
    never a 5xx, and a rejection changes nothing."""
    before = deployment.before()
    response = case.call(base_url=stack.base_url, headers=AUTH, timeout=60)
    what = f"{case.method} {response.request.url}"
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:500]}"
    after = deployment.state()
    case.validate_response(
        response,
        headers=AUTH,
        excluded_checks=_excluded(case),
        transport_kwargs={"base_url": stack.base_url, "headers": AUTH, "timeout": 60},
    )
    if response.status_code >= 400:
        _unchanged(what, response.status_code, response.text, before, after)


@schema_fuzzing_only.parametrize()
@settings(SCHEMA_FUZZ, max_examples=5)
def test_every_operation_without_token(
    case: Case[Any], stack: Stack, deployment: Deployment
) -> None:
    """Generated requests with no token, a wrong one or another scheme: 401 with a
    challenge before the body is even read (open paths answer as usual), conforming to
    the document, changing nothing."""
    headers = next(BAD_AUTH)
    before = deployment.before()
    response = case.call(base_url=stack.base_url, headers=headers, timeout=60)
    what = f"{case.method} {response.request.url} with {headers or 'no token'}"
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:500]}"
    after = deployment.state()
    if case.path in OPEN_PATHS:
        assert response.status_code != 401, what
    else:
        assert response.status_code == 401, f"{what}: {response.status_code} {response.text}"
        assert response.headers.get("www-authenticate") == ["Bearer"], response.headers
        assert response.json()["error"]["code"] == "unauthorized"
    case.validate_response(
        response, checks=[c for c in CONFORMANCE if c not in _excluded(case)], headers=headers
    )
    if response.status_code >= 400:
        _unchanged(what, response.status_code, response.text, before, after)


# --- what the document cannot describe, for every operation --------------------------------

CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=latin-1",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=xyz",
    "application/xml",
    "application/octet-stream",
    "*/*",
    "garbage",
]
# Segments the client sends as they are (quoted): dots, separators, the store's key
# separator, NUL, non-ASCII, too long (20 kB: still under the server's line limit), and
# the shape of a real id.
path_segments = st.one_of(
    st.sampled_from(
        ["x", "ro_x", "trace_0", "a:b", "a b", "%2F", "a/b", "\x00", "é", "💥", "-", "_"]
    ),
    st.sampled_from(["A" * 201, "A" * 20_000]),
    st.text(min_size=1, max_size=60),
    st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,40}\Z"),
).filter(lambda s: s not in (".", ".."))


def _deep(depth: int, kind: str) -> str:
    if kind == "array":
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def _pad_to(body: str, size: int) -> str:
    """``body`` (a JSON object) grown to ``size`` bytes with an unknown field."""
    filler = max(0, size - len(body.encode()) - len(',"pad":""'))
    return body[:-1] + ',"pad":"' + "x" * filler + '"}'


def _envelope(path: str, trace: str) -> dict[str, Any]:
    """A body of the right shape for the operation, naming no known codebase."""
    if path.startswith("/agent-rft/tools"):
        return function_call(trace, {"codebase": "no-such-codebase"}, "shell", {"command": "ls"})
    if path == "/agent-rft/grade":
        return {"trace_id": trace, "sample": {"output_text": "x"}, "item": {"codebase": "nope"}}
    if path == "/v1/rollouts":
        return {"codebase": "no-such-codebase", "id": trace}
    if path.endswith("/grade"):
        return {"answer": "x"}
    return {"arguments": {"command": "ls"}, "call_id": "c1"}


@st.composite
def hostile_bodies(draw: st.DrawFn, path: str, trace: str) -> bytes:
    envelope = json.dumps(_envelope(path, trace))
    kind = draw(st.sampled_from(["deep", "huge", "unknown", "raw", "wrong-encoding"]))
    if kind == "deep":
        depth = draw(st.sampled_from([64, 250, 256, 300, 900, 1100, 5000, 200_000]))
        nested = _deep(depth, draw(st.sampled_from(["array", "object"])))
        where = draw(st.sampled_from(["whole", "field"]))
        return (nested if where == "whole" else envelope[:-1] + f',"deep":{nested}}}').encode()
    if kind == "huge":
        size = draw(st.sampled_from([LIMIT - 64, LIMIT, LIMIT + 1, 3 * LIMIT]))
        return _pad_to(envelope, size).encode()
    if kind == "unknown":
        extra = draw(st.dictionaries(st.text(max_size=12), json_values, min_size=1, max_size=4))
        return json.dumps({**extra, **json.loads(envelope)}).encode()
    if kind == "wrong-encoding":
        codec = draw(st.sampled_from(["utf-16", "utf-32", "latin-1", "utf-8-sig"]))
        return (envelope[:-1] + ',"x":"é💥"}').encode(codec, errors="replace")
    return draw(st.binary(max_size=300))


HOSTILE = settings(SCHEMA_FUZZ, max_examples=8)


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
@HOSTILE
@given(data=st.data())
def test_every_operation_hostile_transport(
    stack: Stack,
    deployment: Deployment,
    client: httpx.Client,
    method: str,
    path: str,
    data: st.DataObject,
) -> None:
    """Every operation, with bodies and content types no schema describes: deep JSON
    (inside and past the parser's limit), bodies around the size limit, unknown fields,
    other encodings, bytes; and hostile path segments. Never a 5xx, and a rejection
    changes nothing."""
    trace = new_trace()
    url = path
    for name in ("rollout_id", "name"):
        if "{" + name + "}" in url:
            segment = data.draw(path_segments, label=name)
            url = url.replace("{" + name + "}", quote(segment, safe=""))
    body = data.draw(hostile_bodies(path, trace), label="body")
    content_type = data.draw(st.sampled_from(CONTENT_TYPES), label="content-type")
    headers = {"Content-Type": content_type} if content_type else {}
    before = deployment.before()
    response = client.request(method, url, content=body, headers=headers)
    what = f"{method} {url} ({len(body)} bytes, {content_type})"
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:500]}"
    after = deployment.state()
    if response.status_code >= 400:
        assert response.json()["error"]["type"] == "rejected", response.text
        _unchanged(what, response.status_code, response.text, before, after)
    if len(body) > LIMIT:
        assert response.status_code == 413, f"{what}: {response.status_code}"


# --- accepted answers conform too -----------------------------------------------------------


def test_a_whole_lifecycle_conforms(stack: Stack, deployment: Deployment) -> None:
    """The documented answers of a real lifecycle, both APIs, validated against the
    document (rejections along the way must change nothing)."""

    def call(
        method: str,
        path: str,
        expect: int,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
    ) -> Any:
        operation = schema[path][method]
        kwargs: dict[str, Any] = {"path_parameters": params or {}}
        if body is not None:
            kwargs["body"] = body
            kwargs["media_type"] = "application/json"
        case = operation.Case(**kwargs)
        before = deployment.before()
        response = case.call(base_url=stack.base_url, headers=AUTH, timeout=120)
        assert response.status_code == expect, f"{method} {path}: {response.text[:500]}"
        after = deployment.state()
        skipped = _excluded(case)
        case.validate_response(
            response, checks=[c for c in CONFORMANCE if c not in skipped], headers=AUTH
        )
        if expect >= 400:
            _unchanged(f"{method} {path}", expect, response.text, before, after)
        return None if path == "/metrics" else response.json()

    for path in ("/healthz", "/readyz", "/metrics", "/v1/readiness"):
        call("GET", path, 200)

    row = {"codebase": stack.codebase, "gold_files": ["setup.py"]}
    created = call("POST", "/v1/rollouts", 201, body={"item": row})
    rid = {"rollout_id": created["rollout_id"]}
    call("POST", "/v1/rollouts", 409, body={"item": row, "id": rid["rollout_id"]})
    call("GET", "/v1/rollouts/{rollout_id}", 200, params=rid)
    tool = "/v1/rollouts/{rollout_id}/tools/{name}"
    ok = call(
        "POST", tool, 200, params={**rid, "name": "shell"}, body={"arguments": {"command": "ls"}}
    )
    assert ok["outcome"] == "ok"
    bad = call("POST", tool, 200, params={**rid, "name": "read_file"}, body={"arguments": {}})
    assert bad["outcome"] == "agent_error"
    call("GET", "/v1/rollouts/{rollout_id}/trajectory", 200, params=rid)
    call("POST", "/v1/rollouts/{rollout_id}/grade", 422, params=rid, body={})
    call("POST", "/v1/rollouts/{rollout_id}/grade", 200, params=rid, body={"answer": "setup.py"})
    call("POST", tool, 409, params={**rid, "name": "shell"}, body={"arguments": {"command": "ls"}})
    call("DELETE", "/v1/rollouts/{rollout_id}", 200, params=rid)
    call("GET", "/v1/rollouts/{rollout_id}", 200, params=rid)
    call("GET", "/v1/rollouts/{rollout_id}", 404, params={"rollout_id": "ro_never"})

    trace = new_trace()
    item = {"codebase": stack.codebase, "gold_files": ["setup.py"]}
    call(
        "POST", "/agent-rft/tools", 200, body=function_call(trace, item, "shell", {"command": "ls"})
    )
    call(
        "POST",
        "/agent-rft/tools/{name}",
        200,
        params={"name": "read_file"},
        body=function_call(trace, item, None, {"path": "setup.py"}),
    )
    call("POST", "/agent-rft/tools", 422, body=function_call(trace, item, None, {"command": "ls"}))
    grade = {"trace_id": trace, "item": item, "sample": {"output_text": "setup.py"}}
    first = call("POST", "/agent-rft/grade", 200, body=grade)
    assert call("POST", "/agent-rft/grade", 200, body=grade)["score"] == first["score"]
    # A tool call after the grade is refused (409 `ended`).
    late = function_call(trace, item, "shell", {"command": "ls"})
    ended = call("POST", "/agent-rft/tools", 409, body=late)
    assert ended["error"]["code"] == "ended"
    call("DELETE", "/v1/rollouts/{rollout_id}", 200, params={"rollout_id": trace})


# --- bad input found by fuzzing, now refused ------------------------------------------------


# A row nested 255+ levels deep once validated, then failed to serialise when stored: a
# 503 for bad input. Rows, samples and arguments are now refused past 64 levels (422).
@pytest.mark.parametrize("path", ["/agent-rft/grade", "/agent-rft/tools", "/v1/rollouts"])
def test_deeply_nested_row_is_refused_not_a_503(
    stack: Stack, deployment: Deployment, client: httpx.Client, path: str
) -> None:
    trace = new_trace()
    row = (
        f'{{"codebase": "{stack.codebase}", "gold_files": ["setup.py"], '
        f'"deep": {_deep(300, "object")}}}'
    )
    bodies = {
        "/agent-rft/grade": f'{{"trace_id": "{trace}", "sample": {{}}, "item": {row}}}',
        "/agent-rft/tools": (
            f'{{"trace_id": "{trace}", "call_id": "c1", "name": "shell", '
            f'"arguments": {{"command": "true"}}, "item": {row}}}'
        ),
        "/v1/rollouts": f'{{"id": "{trace}", "item": {row}}}',
    }
    before = deployment.before()
    response = client.post(path, content=bodies[path])
    after = deployment.state()
    assert response.status_code == 422, f"{path}: {response.status_code} {response.text}"
    assert "nested deeper" in response.text
    _unchanged(path, response.status_code, response.text, before, after)
