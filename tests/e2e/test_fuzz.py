"""Property-based fuzzing of the real API (hypothesis): whatever the body, no 500 and no
5xx at all (nothing here is an infrastructure fault), and a rejected request creates no
rollout. Each property is limited to a few dozen examples to keep the suite fast."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import Stack
from tests.e2e.helpers import function_call, new_trace, sandboxes_of

pytestmark = pytest.mark.xdist_group("e2e")

FUZZ = settings(
    deadline=None,
    max_examples=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
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


def _ok_or_rejected(response: httpx.Response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text}"
    if response.status_code != 200:
        assert response.status_code in REJECTED, response.text
        body = response.json()
        assert body["error"]["type"] == "rejected", body


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
    stack: Stack, client: httpx.Client, body: dict[str, Any], path: str
) -> None:
    response = client.post(path, json=body)
    _ok_or_rejected(response)
    trace = body.get("trace_id")
    if response.status_code != 200 and isinstance(trace, str) and trace.startswith("trace_"):
        assert client.get(f"/v1/rollouts/{trace}").status_code == 404
        assert sandboxes_of(stack.settings, trace) == []


@FUZZ
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_fuzz_raw_bodies(client: httpx.Client, raw: bytes) -> None:
    for path in ("/agent-rft/tools", "/agent-rft/grade", "/v1/rollouts"):
        _ok_or_rejected(client.post(path, content=raw))


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
    stack: Stack, client: httpx.Client, sample: Any, extra: dict[str, Any]
) -> None:
    item = {**extra, "codebase": stack.codebase, "gold_files": ["src/requests/api.py"]}
    item.pop("environment", None)
    response = client.post(
        "/agent-rft/grade", json={"sample": sample, "item": item, "trace_id": new_trace()}
    )
    _ok_or_rejected(response)
    if isinstance(sample, dict):
        assert response.status_code == 200, response.text
        assert 0.0 <= response.json()["score"] <= 1.0


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
def test_fuzz_create_rollout(stack: Stack, client: httpx.Client, body: dict[str, Any]) -> None:
    response = client.post("/v1/rollouts", json=body)
    _ok_or_rejected(response)
    if response.status_code == 201:
        rollout_id = response.json()["rollout_id"]
        assert client.delete(f"/v1/rollouts/{rollout_id}").status_code == 200
        return
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
    client: httpx.Client, body: Any, tool: str, rollout_id: str
) -> None:
    """Unknown ids are 404 whatever the body (or a 422 for a body of the wrong shape)."""
    for method, path in (
        ("POST", f"/v1/rollouts/{rollout_id}/tools/{tool}"),
        ("POST", f"/v1/rollouts/{rollout_id}/grade"),
        ("GET", f"/v1/rollouts/{rollout_id}"),
        ("DELETE", f"/v1/rollouts/{rollout_id}"),
    ):
        response = client.request(method, path, json=body if method == "POST" else None)
        _ok_or_rejected(response)
        assert response.status_code in (404, 422), response.text
