"""Property-based fuzzing of the real API (hypothesis): whatever the body, no 500 and no
5xx at all (nothing here is an infrastructure fault), and a rejected request changes no
state: no Redis key of the deployment is added, removed or changed, and no container or
volume appears. Each property is limited to a few dozen examples to keep the suite fast.

Schema-driven fuzzing of every operation (schemathesis) is in test_schema_fuzz.py; it uses
:class:`Deployment` from here."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote

import docker
import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.config import Settings
from orchestrator.sandbox.labels import DEPLOYMENT
from orchestrator.state.keys import Keys
from tests.e2e.helpers import function_call, new_trace, sandboxes_of
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")

FUZZ = settings(
    deadline=None,
    max_examples=50,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        # _forget_state: once per test, on purpose, not once per example.
        HealthCheck.function_scoped_fixture,
    ],
    database=None,
)
REJECTED = {400, 404, 409, 413, 422}

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
ids = st.one_of(
    st.from_regex(r"\Atrace_[a-f0-9]{32}\Z"),
    st.text(max_size=30),
    json_scalars,
)
unresolvable_items = st.one_of(
    st.just({}),
    st.builds(lambda s: {"codebase": f"nope-{s}"}, st.text(max_size=8)),
    st.builds(lambda v: {"environment": v}, json_values),
    st.builds(lambda v: {"codebase": v}, json_values.filter(lambda v: not isinstance(v, str))),
    st.dictionaries(st.text(max_size=10), json_values, max_size=4).filter(
        lambda d: "codebase" not in d
    ),
)


# JSON that Python's parser takes although strict JSON has no such thing.
non_finite = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])


@dataclass
class DeploymentState:
    """Everything a deployment holds: its Redis keys with their values, and its labelled
    containers and volumes."""

    keys: dict[str, Any]
    containers: frozenset[str]
    volumes: frozenset[str]

    def diff(self, after: DeploymentState) -> str:
        """What changed from this state to ``after``, for assertion messages."""
        added = sorted(set(after.keys) - set(self.keys))
        removed = sorted(set(self.keys) - set(after.keys))
        changed = sorted(
            k for k in set(self.keys) & set(after.keys) if self.keys[k] != after.keys[k]
        )
        return (
            f"redis keys added {added}, removed {removed}, changed {changed}; "
            f"containers added {sorted(after.containers - self.containers)}; "
            f"volumes added {sorted(after.volumes - self.volumes)}"
        )

    def rollout_ids(self) -> set[str]:
        """The ids of the rollouts that have a record (``rollout:<id>``)."""
        return {
            k.split(":")[1] for k in self.keys if k.count(":") == 1 and k.startswith("rollout:")
        }


# Keys that change on their own: workers' heartbeats and the API's transient reply lists.
_VOLATILE = ("worker:", "reply:")


class Deployment:
    """Reads a deployment's whole state straight from Redis and dockerd, bypassing the API,
    so that a request's effects are seen even where the API would not show them."""

    def __init__(self, settings: Settings) -> None:
        self.prefix = Keys.of(settings.deployment).prefix
        self.label = f"{DEPLOYMENT}={settings.deployment}"
        self.redis = redis.Redis.from_url(settings.redis_url, decode_responses=True)
        self.docker = docker.from_env()
        self.last: DeploymentState | None = None

    def before(self) -> DeploymentState:
        """The state before a request: what :meth:`state` read after the previous request
        of the same test (nothing else changes a deployment meanwhile), else read now.
        Reading costs a KEYS over the whole Redis, so each example reads once, not twice."""
        last = self.last if self.last is not None else self.state()
        self.last = None  # until the state after this request is read
        return last

    def close(self) -> None:
        self.redis.close()
        self.docker.close()

    def state(self) -> DeploymentState:
        # KEYS, not SCAN: one round trip per request (a SCAN of a busy Redis takes many).
        every = cast(list[str], self.redis.keys(self.prefix + "*"))
        names = [k for k in every if not k.removeprefix(self.prefix).startswith(_VOLATILE)]
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.type(name)
        types = pipe.execute()
        pipe = self.redis.pipeline(transaction=False)
        for name, kind in zip(names, types, strict=True):
            if kind == "hash":
                pipe.hgetall(name)
            elif kind == "list":
                pipe.lrange(name, 0, -1)
            elif kind == "set":
                pipe.smembers(name)
            elif kind == "zset":
                pipe.zrange(name, 0, -1, withscores=True)
            elif kind == "string":
                pipe.get(name)
            else:  # gone since KEYS ("none"), or a type this deployment does not use
                pipe.type(name)
        values = pipe.execute()
        keys = {
            name.removeprefix(self.prefix): value
            for name, value, kind in zip(names, values, types, strict=True)
            if kind != "none"
        }
        filters = {"label": self.label}
        containers = self.docker.api.containers(all=True, filters=filters)
        volumes = self.docker.api.volumes(filters=filters).get("Volumes") or []
        self.last = DeploymentState(
            keys=keys,
            containers=frozenset(c["Id"] for c in containers),
            volumes=frozenset(v["Name"] for v in volumes),
        )
        return self.last


def assert_rejected_changed_nothing(
    response: httpx.Response, before: DeploymentState, after: DeploymentState
) -> None:
    assert after == before, (
        f"{response.request.method} {response.request.url} was rejected with "
        f"{response.status_code} ({response.text[:300]}) but changed state: {before.diff(after)}"
    )


def _ok_or_rejected(response: httpx.Response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text}"
    if response.status_code not in (200, 201):
        assert response.status_code in REJECTED, response.text
        body = response.json()
        assert body["error"]["type"] == "rejected", body


@pytest.fixture(scope="module")
def deployment(stack: Stack) -> Iterator[Deployment]:
    d = Deployment(stack.settings)
    yield d
    d.close()


@pytest.fixture(autouse=True)
def _forget_state(deployment: Deployment) -> None:
    """Each test starts from a state read afresh (another test may have changed it)."""
    deployment.last = None


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[httpx.Client]:
    with stack.client() as c:
        yield c


@pytest.fixture(scope="module")
def live_trace(stack: Stack, client: httpx.Client) -> Iterator[tuple[str, dict[str, Any]]]:
    """One rollout whose sandbox takes every fuzzed argument."""
    trace = new_trace()
    item = {"codebase": stack.codebase, "gold_files": ["src/requests/api.py"]}
    first = client.post(
        "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": "true"})
    )
    assert first.status_code == 200
    yield trace, item
    client.delete(f"/v1/rollouts/{trace}")


def _api_rollout(stack: Stack, client: httpx.Client) -> str:
    item = {"codebase": stack.codebase, "gold_files": ["src/requests/api.py"]}
    response = client.post("/v1/rollouts", json={"item": item})
    assert response.status_code == 201, response.text
    rollout_id: str = response.json()["rollout_id"]
    return rollout_id


@pytest.fixture(scope="module")
def live_rollout(stack: Stack, client: httpx.Client) -> Iterator[str]:
    """A rollout of the rollout API (``POST /v1/rollouts``) that takes fuzzed tool calls."""
    rollout_id = _api_rollout(stack, client)
    yield rollout_id
    client.delete(f"/v1/rollouts/{rollout_id}")


@pytest.fixture(scope="module")
def graded_rollout(stack: Stack, client: httpx.Client) -> Iterator[str]:
    """A rollout of the rollout API that takes fuzzed grade bodies."""
    rollout_id = _api_rollout(stack, client)
    yield rollout_id
    client.delete(f"/v1/rollouts/{rollout_id}")


@FUZZ
@given(
    body=st.fixed_dictionaries(
        {},
        optional={
            "type": json_values,
            "id": json_values,
            "call_id": ids,
            "name": json_values,
            "arguments": json_values,
            "trace_id": ids,
            "item": st.one_of(unresolvable_items, json_values),
            "extra": json_values,
        },
    ),
    path=st.sampled_from(["/agent-rft/tools", "/agent-rft/tools/shell", "/agent-rft/grade"]),
)
def test_fuzz_agent_rft_bodies(
    deployment: Deployment, client: httpx.Client, body: dict[str, Any], path: str
) -> None:
    """No item here resolves to a codebase: whatever the answer, nothing may be created."""
    before = deployment.before()
    response = client.post(path, json=body)
    _ok_or_rejected(response)
    assert_rejected_changed_nothing(response, before, deployment.state())


@FUZZ
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_fuzz_raw_bodies(deployment: Deployment, client: httpx.Client, raw: bytes) -> None:
    before = deployment.before()
    for path in ("/agent-rft/tools", "/agent-rft/grade", "/v1/rollouts"):
        response = client.post(path, content=raw)
        _ok_or_rejected(response)
    # Nothing here names a codebase: whatever was answered, nothing may have been made.
    assert_rejected_changed_nothing(response, before, deployment.state())


NON_FINITE_BODIES = [
    (
        "/agent-rft/tools",
        '{"trace_id": "%(trace)s", "call_id": "c1", "name": "shell", '
        '"arguments": {"command": "true", "timeout_s": %(x)s}, "item": {"codebase": "%(cb)s"}}',
    ),
    (
        "/agent-rft/tools",
        '{"trace_id": "%(trace)s", "call_id": "c1", "name": "read_file", '
        '"arguments": {"path": "README.md", "end_line": %(x)s}, "item": {"codebase": "%(cb)s"}}',
    ),
    (
        "/agent-rft/grade",
        '{"trace_id": "%(trace)s", "sample": {"output_json": %(x)s}, '
        '"item": {"codebase": "%(cb)s", "gold_files": ["setup.py"], "x": %(x)s}}',
    ),
    (
        "/agent-rft/grade",
        '{"trace_id": "%(trace)s", "sample": {"output_text": "setup.py"}, '
        '"item": {"codebase": "%(cb)s", "gold_files": %(x)s}}',
    ),
    ("/v1/rollouts", '{"codebase": %(x)s, "item": {"codebase": %(x)s}, "id": "%(trace)s"}'),
    ("/agent-rft/tools", "%(x)s"),
    ("/agent-rft/grade", '{"trace_id": "%(trace)s", "item": %(x)s, "sample": %(x)s}'),
]


@FUZZ
@given(body=st.sampled_from(NON_FINITE_BODIES), x=non_finite)
def test_fuzz_non_finite_numbers(
    stack: Stack,
    deployment: Deployment,
    client: httpx.Client,
    body: tuple[str, str],
    x: str,
) -> None:
    """NaN and Infinity are not JSON, but Python's parser takes them: wherever they sit,
    they are refused or answered, never a 5xx (JSON answers cannot encode them)."""
    path, template = body
    trace = new_trace()
    before = deployment.before()
    response = client.post(path, content=template % {"trace": trace, "x": x, "cb": stack.codebase})
    _ok_or_rejected(response)
    if response.status_code == 200:
        client.delete(f"/v1/rollouts/{trace}")  # a tool call that ran made a sandbox
    else:
        assert_rejected_changed_nothing(response, before, deployment.state())


shell_arguments = st.fixed_dictionaries(
    {},
    optional={
        # Free text is quoted, so the sandbox prints it instead of running it.
        "command": st.one_of(
            st.text(max_size=80).map(lambda t: "printf %s " + shlex.quote(t)),
            st.sampled_from(["ls", "pwd", "echo $HOME", "rg -c import src | head -3"]),
            json_values,
        ),
        "timeout_s": st.one_of(
            st.floats(allow_nan=False, allow_infinity=False), st.integers(), json_values
        ),
        "other": json_values,
    },
)
read_arguments = st.fixed_dictionaries(
    {},
    optional={
        "path": st.one_of(
            st.sampled_from(["README.md", "src/requests/api.py", "src", "/workspace/README.md"]),
            st.text(max_size=40),
            json_values,
        ),
        "start_line": st.one_of(st.integers(min_value=-5, max_value=500), json_values),
        "end_line": st.one_of(st.integers(min_value=-5, max_value=500), json_values),
    },
)


@FUZZ
@given(
    name=st.sampled_from(["shell", "read_file", "nope"]),
    arguments=st.one_of(shell_arguments, read_arguments, json_values),
    as_string=st.booleans(),
)
def test_fuzz_tool_arguments(
    client: httpx.Client,
    live_trace: tuple[str, dict[str, Any]],
    name: str,
    arguments: Any,
    as_string: bool,
) -> None:
    trace, item = live_trace
    body = function_call(trace, item, name, arguments, as_string=False)
    if as_string:
        body["arguments"] = json.dumps(arguments)
    response = client.post("/agent-rft/tools", json=body)
    if not as_string and not isinstance(arguments, (str, dict, type(None))):
        assert response.status_code == 422, response.text  # the body's own shape is wrong
        return
    # Whatever the arguments, the agent gets an answer, not an HTTP error.
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["call_id"] == body["call_id"]
    assert isinstance(reply["output"], str) and reply["output"]
    assert len(reply["output"].encode()) <= 16 * 1024


@FUZZ
@given(sample=json_values, extra=st.dictionaries(st.text(max_size=8), json_values, max_size=3))
def test_fuzz_grade_samples(
    stack: Stack,
    deployment: Deployment,
    client: httpx.Client,
    sample: Any,
    extra: dict[str, Any],
) -> None:
    item = {**extra, "codebase": stack.codebase, "gold_files": ["src/requests/api.py"]}
    item.pop("environment", None)
    before = deployment.before()
    response = client.post(
        "/agent-rft/grade", json={"sample": sample, "item": item, "trace_id": new_trace()}
    )
    _ok_or_rejected(response)
    if isinstance(sample, dict):
        # A graded trace that never called a tool: a record, but never a sandbox.
        assert response.status_code == 200, response.text
        assert 0.0 <= response.json()["score"] <= 1.0
        after = deployment.state()
        assert (after.containers, after.volumes) == (before.containers, before.volumes)
    else:
        assert_rejected_changed_nothing(response, before, deployment.state())


@FUZZ
@given(
    body=st.fixed_dictionaries(
        {},
        optional={
            "environment": json_values,
            "codebase": json_values,
            "item": st.one_of(unresolvable_items, json_values),
            "id": ids,
        },
    )
)
def test_fuzz_create_rollout(
    stack: Stack, deployment: Deployment, client: httpx.Client, body: dict[str, Any]
) -> None:
    before = deployment.before()
    response = client.post("/v1/rollouts", json=body)
    _ok_or_rejected(response)
    if response.status_code == 201:
        rollout_id = response.json()["rollout_id"]
        assert client.delete(f"/v1/rollouts/{rollout_id}").status_code == 200
        return
    assert_rejected_changed_nothing(response, before, deployment.state())
    rollout_id = body.get("id")
    if isinstance(rollout_id, str) and rollout_id.startswith("trace_"):
        assert client.get(f"/v1/rollouts/{rollout_id}").status_code == 404
        assert sandboxes_of(stack.settings, rollout_id) == []


@FUZZ
@given(
    body=st.one_of(
        st.fixed_dictionaries(
            {}, optional={"arguments": json_values, "call_id": ids, "answer": json_values}
        ),
        json_values,
    ),
    tool=st.sampled_from(["shell", "read_file", "x"]),
    rollout_id=st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,40}\Z"),
)
def test_fuzz_rollout_api_calls(
    deployment: Deployment, client: httpx.Client, body: Any, tool: str, rollout_id: str
) -> None:
    """Unknown ids are 404 whatever the body (or a 422 for a body of the wrong shape)."""
    before = deployment.before()
    for method, path in (
        ("POST", f"/v1/rollouts/{rollout_id}/tools/{tool}"),
        ("POST", f"/v1/rollouts/{rollout_id}/grade"),
        ("GET", f"/v1/rollouts/{rollout_id}"),
        ("GET", f"/v1/rollouts/{rollout_id}/trajectory"),
        ("DELETE", f"/v1/rollouts/{rollout_id}"),
    ):
        response = client.request(method, path, json=body if method == "POST" else None)
        _ok_or_rejected(response)
        assert response.status_code in (404, 422), response.text
    # All five were rejected: together they changed nothing.
    assert_rejected_changed_nothing(response, before, deployment.state())


LIVE = settings(FUZZ, max_examples=30)


@LIVE
@given(
    # Any name but "." and "..", which the client folds into the path.
    tool=st.sampled_from(["shell", "read_file", "nope"])
    | st.text(min_size=1, max_size=20).filter(lambda t: t not in (".", "..")),
    arguments=st.one_of(shell_arguments, read_arguments, json_values),
    as_string=st.booleans(),
    call_id=st.one_of(st.none(), ids),
    extra=st.dictionaries(st.text(max_size=8), json_values, max_size=2),
)
def test_fuzz_live_rollout_calls(
    deployment: Deployment,
    client: httpx.Client,
    live_rollout: str,
    tool: str,
    arguments: Any,
    as_string: bool,
    call_id: Any,
    extra: dict[str, Any],
) -> None:
    """Tool calls on a live rollout of the rollout API: an answer for the agent (200) or a
    rejection that touches nothing, never a 5xx."""
    body: dict[str, Any] = {
        **extra,
        "arguments": json.dumps(arguments) if as_string else arguments,
    }
    if call_id is not None:
        body["call_id"] = call_id
    before = deployment.before()
    response = client.post(f"/v1/rollouts/{live_rollout}/tools/{quote(tool, safe='')}", json=body)
    _ok_or_rejected(response)
    if response.status_code == 200:
        reply = response.json()
        assert reply["outcome"] in ("ok", "agent_error"), reply
        assert isinstance(reply["output"], str)
        if reply["outcome"] == "agent_error" and reply["seq"] == 0:
            # Caught before the sandbox: nothing counted, nothing recorded.
            assert deployment.state().keys == before.keys
    else:
        assert_rejected_changed_nothing(response, before, deployment.state())
    assert client.get(f"/v1/rollouts/{live_rollout}").json()["state"] == "active"


@LIVE
@given(
    body=st.one_of(
        st.fixed_dictionaries(
            {}, optional={"answer": json_values, "sample": json_values, "extra": json_values}
        ),
        json_values,
    )
)
def test_fuzz_live_rollout_grade(
    deployment: Deployment, client: httpx.Client, graded_rollout: str, body: Any
) -> None:
    """Grade bodies on a live rollout: a rejected one changes nothing; the first accepted
    one fixes the score, and every later one gets that score again."""
    first = client.get(f"/v1/rollouts/{graded_rollout}").json()
    before = deployment.before()
    response = client.post(f"/v1/rollouts/{graded_rollout}/grade", json=body)
    _ok_or_rejected(response)
    if response.status_code == 200:
        score = response.json()["score"]
        assert 0.0 <= score <= 1.0
        if first["score"] is not None:
            assert score == first["score"]
        view = client.get(f"/v1/rollouts/{graded_rollout}").json()
        # The grade closed it (grace_after_grade_s 0): its score stays, its sandbox went.
        assert (view["state"], view["score"]) == ("closed", score)
    else:
        assert_rejected_changed_nothing(response, before, deployment.state())
