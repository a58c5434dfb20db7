"""HTTP tools (docs/tenancy.md, "HTTP tools"), against a real HTTP service this module
runs on 127.0.0.1, through a deployment of the module's own (API, worker, reaper):

- a 2xx answer is the model's output, a retry of the call gets the stored reply without
  asking the service again, and an oversized answer is cut;
- a 4xx about what the agent asked (404, 422) is the agent's: a 200 ``agent_error`` the
  model reads, the rollout goes on and is graded;
- a 5xx, a 401 (our credentials), a timeout, a refused connection are ours: a 503, the
  rollout failed with the evidence, its grade a 503, never a score;
- the secret the tool's header carries (read from a file) is in no trajectory, record,
  export, log line or error message.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from examples.finqa.search_service import respond
from orchestrator.local import free_port
from tests.e2e.conftest import side_stack
from tests.e2e.helpers import function_call, new_trace, orchestrator
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")

EXAMPLE_SERVICE = Path(__file__).parents[2] / "examples" / "finqa" / "search_service.py"
EXAMPLE_ENVIRONMENT = EXAMPLE_SERVICE.with_name("search-environment.yaml")
SLOW_S = 3.0
TIMEOUT_S = 1.0
HUGE_BYTES = 1 << 20


@dataclass
class Service:
    """The operator's search service: what it was asked, and its secret."""

    port: int
    key: str
    asked: list[dict[str, Any]] = field(default_factory=list)
    keys_seen: list[str] = field(default_factory=list)


def _handler(service: Service) -> type[BaseHTTPRequestHandler]:
    class Search(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            service.asked.append(body)
            service.keys_seen.append(self.headers.get("x-api-key", ""))
            if self.headers.get("x-api-key") != service.key:
                return self._answer(401, {"error": "unauthorized"})
            query = body.get("query", "")
            if query == "nothing":
                return self._answer(404, {"error": f"no document matches {query!r}"})
            if query == "malformed":
                return self._answer(422, {"error": "query: too vague"})
            if query == "boom":
                return self._answer(500, {"error": "index unavailable"})
            if query == "slow":
                time.sleep(SLOW_S)
            if query == "huge":
                return respond(self, 200, b"x" * HUGE_BYTES)
            return self._answer(200, {"results": [f"doc about {query}"], "top_k": body.get("k")})

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            respond(self, status, json.dumps(body).encode())

    return Search


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    found = Service(port=free_port(), key=secrets.token_urlsafe(24))
    server = ThreadingHTTPServer(("127.0.0.1", found.port), _handler(found))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        server.shutdown()
        server.server_close()


def _tool(name: str, url: str, **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "description": "Search the reference documents.",
        "url": url,
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "k": {"type": "integer", "minimum": 1}},
            "required": ["query"],
        },
        **more,
    }


@pytest.fixture(scope="module")
def finqa_search() -> Iterator[tuple[int, str]]:
    """The FinQA example's search service (examples/finqa/search_service.py), run as its
    README says: its port and its token."""
    port, token = free_port(), secrets.token_urlsafe(24)
    command = [sys.executable, str(EXAMPLE_SERVICE), "--port", str(port)]
    proc = subprocess.Popen(
        command, env={**os.environ, "FINQA_SEARCH_TOKEN": token}, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert "finqa search on" in proc.stdout.readline().decode()
        yield port, token
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def tools_stack(
    stack: Stack,
    service: Service,
    finqa_search: tuple[int, str],
    finqa_codebase: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("http-tools")
    finqa = yaml.safe_load(EXAMPLE_ENVIRONMENT.read_text())["environments"][0]
    finqa["tools"][0]["url"] = f"http://127.0.0.1:{finqa_search[0]}/search"
    key_file = root / "search-key"
    key_file.write_text(service.key + "\n")
    url = f"http://127.0.0.1:{service.port}/search"
    keyed = {"x-api-key": "{secret:search_key}"}
    environments = {
        "environments": [
            {
                "name": "searching",
                "tools": [
                    "shell",
                    "read_file",
                    _tool(
                        "search", url, headers=keyed, timeout_s=TIMEOUT_S, max_response_bytes=4096
                    ),
                    _tool("unkeyed", url),
                    _tool("nowhere", f"http://127.0.0.1:{free_port()}/search", headers=keyed),
                ],
                "secrets": {"search_key": {"file": str(key_file)}},
                "sandbox_secrets": {"SEARCH_KEY": "search_key"},
                "grader": {"name": "file_f1"},
            },
            finqa,
        ]
    }
    path = root / "environments.yaml"
    path.write_text(yaml.safe_dump(environments))
    token = {"FINQA_SEARCH_TOKEN": finqa_search[1]}
    with side_stack(stack, root, name="http-tools", environments_file=path, env=token) as made:
        yield made


def _item(stack: Stack) -> dict[str, Any]:
    return {"environment": "searching", "codebase": stack.codebase, "gold_files": ["README.md"]}


def _call(
    client: Any, trace: str, stack: Stack, tool: str, args: dict[str, Any], call_id: str
) -> Any:
    return client.post(
        "/agent-rft/tools",
        json=function_call(trace, _item(stack), tool, args, call_id=call_id),
    )


def test_an_answer_is_the_output_and_a_retry_gets_it_stored(
    tools_stack: Stack, service: Service
) -> None:
    trace = new_trace()
    with tools_stack.client() as client:
        first = _call(client, trace, tools_stack, "search", {"query": "sessions", "k": 3}, "c1")
        assert first.status_code == 200, first.text
        assert json.loads(first.json()["output"]) == {"results": ["doc about sessions"], "top_k": 3}
        asked = len(service.asked)
        again = _call(client, trace, tools_stack, "search", {"query": "sessions", "k": 3}, "c1")
        assert again.json()["output"] == first.json()["output"]
        assert len(service.asked) == asked  # the stored reply: the service was not asked
        huge = _call(client, trace, tools_stack, "search", {"query": "huge"}, "c2")
        assert huge.status_code == 200
        assert len(huge.json()["output"].encode()) <= 4096
        bad = _call(client, trace, tools_stack, "search", {"k": 0}, "c3")  # refused here
        assert "query: required argument is missing" in bad.json()["output"]
        assert len(service.asked) == asked + 1  # the huge one; never the invalid one
        steps = client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"]
        # Invalid arguments are answered before anything is recorded, as for any tool.
        assert [s["outcome"] for s in steps] == ["ok", "ok"]
        assert steps[1]["truncated"] is True
        client.delete(f"/v1/rollouts/{trace}")


def test_what_the_agent_asked_wrong_is_scored(tools_stack: Stack, service: Service) -> None:
    trace = new_trace()
    with tools_stack.client() as client:
        for n, query in enumerate(("nothing", "malformed")):
            answer = _call(client, trace, tools_stack, "search", {"query": query}, f"c{n}")
            assert answer.status_code == 200, answer.text
            assert "search refused the call (4" in answer.json()["output"]
        ok = _call(client, trace, tools_stack, "search", {"query": "adapters"}, "c9")
        assert ok.status_code == 200
        steps = client.get(f"/v1/rollouts/{trace}/trajectory").json()["steps"]
        assert [s["error_kind"] for s in steps] == ["tool_refused", "tool_refused", None]
        graded = client.post(
            "/agent-rft/grade",
            json={"trace_id": trace, "item": _item(tools_stack), "sample": {"output_text": "x"}},
        )
        assert graded.status_code == 200, graded.text
        client.delete(f"/v1/rollouts/{trace}")


@pytest.mark.parametrize(
    ("tool", "query", "says"),
    [
        ("search", "boom", "answered 500"),
        ("unkeyed", "anything", "answered 401"),
        ("search", "slow", f"no answer within {TIMEOUT_S} s"),
        ("nowhere", "anything", "ConnectError"),
    ],
)
def test_the_services_failure_is_ours_and_never_scored(
    tools_stack: Stack, service: Service, tool: str, query: str, says: str
) -> None:
    trace = new_trace()
    with tools_stack.client() as client:
        ok = _call(client, trace, tools_stack, "shell", {"command": "true"}, "c0")
        assert ok.status_code == 200
        failed = _call(client, trace, tools_stack, tool, {"query": query}, "c1")
        assert failed.status_code == 503, failed.text
        error = failed.json()["error"]
        assert error["code"] == "tool_service_failed" and says in error["message"]
        record = client.get(f"/v1/rollouts/{trace}").json()
        assert record["state"] == "infra_failed"
        evidence = record["infra_failure"]["evidence"]
        assert evidence["tool"] == tool and evidence["service"].endswith("/search")
        later = _call(client, trace, tools_stack, "shell", {"command": "true"}, "c2")
        assert later.status_code == 503
        graded = client.post(
            "/agent-rft/grade",
            json={"trace_id": trace, "item": _item(tools_stack), "sample": {"output_text": "x"}},
        )
        assert graded.status_code == 503
        client.delete(f"/v1/rollouts/{trace}")


def test_the_sandbox_s_commands_have_the_secret_and_its_output_never_shows_it(
    tools_stack: Stack, service: Service
) -> None:
    """``sandbox_secrets``: the command has the variable (its length proves it), and
    wherever the agent sends the value (stdout, stderr, a file it reads back) the model is
    given ``[secret SEARCH_KEY]`` instead."""
    trace = new_trace()
    with tools_stack.client() as client:

        def shell(command: str, call_id: str) -> str:
            answer = _call(client, trace, tools_stack, "shell", {"command": command}, call_id)
            assert answer.status_code == 200, answer.text
            output: str = answer.json()["output"]
            return output

        assert f"length {len(service.key)}" in shell('echo "length ${#SEARCH_KEY}"', "c1")
        shown = shell('echo "out $SEARCH_KEY"; echo "err $SEARCH_KEY" >&2', "c2")
        assert "out [secret SEARCH_KEY]" in shown and "err [secret SEARCH_KEY]" in shown
        shell('echo "$SEARCH_KEY" > /workspace/kept.txt', "c3")
        read = _call(client, trace, tools_stack, "read_file", {"path": "kept.txt"}, "c4")
        assert "[secret SEARCH_KEY]" in read.json()["output"]
        steps = client.get(f"/v1/rollouts/{trace}/trajectory").text
        assert service.key not in steps and "[secret SEARCH_KEY]" in steps
        client.delete(f"/v1/rollouts/{trace}")


def test_the_secret_is_on_no_surface(tools_stack: Stack, service: Service, tmp_path: Path) -> None:
    """Every surface a secret could leak through, after calls that succeeded, were
    refused and failed, and commands that printed it: the replies, trajectories, records,
    the export, every process's log. The service did receive it."""
    seen: list[str] = []
    with tools_stack.client() as client:
        for query in ("sessions", "nothing", "boom"):
            trace = new_trace()
            printed = _call(client, trace, tools_stack, "shell", {"command": "env"}, "c0")
            answer = _call(client, trace, tools_stack, "search", {"query": query}, "c1")
            seen += [printed.text, answer.text, client.get(f"/v1/rollouts/{trace}").text]
            seen.append(client.get(f"/v1/rollouts/{trace}/trajectory").text)
            client.delete(f"/v1/rollouts/{trace}")
    out = tmp_path / "export.jsonl"
    exported = orchestrator(tools_stack, "export", str(out))
    assert exported.returncode == 0, exported.stderr
    seen.append(out.read_text())
    seen += [log.read_text(errors="replace") for log in tools_stack.logs.glob("*.log")]
    assert service.key in service.keys_seen
    for text in seen:
        assert service.key not in text


def test_the_finqa_example_searches_through_its_service(tools_stack: Stack) -> None:
    """examples/finqa/search-environment.yaml as shipped (its URL aside): search is the
    example's service, cat still runs in the sandbox, and a phrase no report has is the
    agent's 404, scored."""
    trace = new_trace()
    item = {"environment": "finqa-search", "question": "Halvard's fiscal 2023 revenue?"}
    with tools_stack.client() as client:

        def call(tool: str, args: dict[str, Any], call_id: str) -> Any:
            body = function_call(trace, item, tool, args, call_id=call_id)
            answer = client.post("/agent-rft/tools", json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()["output"]

        matches = json.loads(call("search", {"query": "total revenue", "k": 2}, "c1"))["matches"]
        assert any(m.startswith("halvard_fy2023.txt:") for m in matches)
        report = matches[0].split(":")[0]
        assert "revenue" in call("cat", {"file": report}, "c2").lower()
        assert "refused the call (404)" in call("search", {"query": "zzz-no-such"}, "c3")
        client.delete(f"/v1/rollouts/{trace}")
