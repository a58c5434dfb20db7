"""A preflight of a deployed Agent RFT job before it is paid for: what the platform's own
preflight endpoints do (``/v1/fine_tuning/alpha/tool/run`` and ``.../graders/run``, which
call a tool server and a grader once), from here, against the URLs and headers of the job:
one call per tool and one grade, checking each answer's shape, auth and time.

Each check is a :class:`Check`; :func:`run_preflight` runs them all and never raises for
what the endpoints answer (a failure is a failed check).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from orchestrator.rft.job import JobBody
from orchestrator.tls import tls

MAX_RESPONSE_BYTES = 1024 * 1024
"""The platform reads at most 1 MB of a tool's answer (more reaches the model as a 413)."""
PLATFORM_TIMEOUT_S = 600.0
"""The platform waits at most 10 minutes for a tool call or a grade."""


class Check(BaseModel):
    """One thing the preflight checked."""

    what: str
    ok: bool
    detail: str = ""
    ms: float | None = None


def sample_arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    """The smallest arguments a tool's JSON Schema asks for: each required property's
    first enum value, minimum, or a plain value of its type."""
    out: dict[str, Any] = {}
    properties = parameters.get("properties") or {}
    for name in parameters.get("required") or []:
        schema = properties.get(name) or {}
        kind = schema.get("type")
        kind = next((k for k in kind if k != "null"), None) if isinstance(kind, list) else kind
        if "enum" in schema:
            out[name] = schema["enum"][0]
        elif kind in ("integer", "number"):
            out[name] = schema.get("minimum", 1)
        elif kind == "boolean":
            out[name] = False
        elif kind == "array":
            out[name] = []
        elif kind == "object":
            out[name] = {}
        else:
            out[name] = "preflight"
    return out


def run_preflight(
    job: JobBody,
    row: dict[str, Any],
    *,
    arguments: dict[str, dict[str, Any]] | None = None,
    timeout_s: float = PLATFORM_TIMEOUT_S,
    transport: httpx.BaseTransport | None = None,
) -> list[Check]:
    """One call per tool of ``job`` and one grade, on dataset ``row`` (a platform row:
    ``messages``, ``tools`` and the item), as the platform would send them. ``arguments``:
    a tool's arguments instead of :func:`sample_arguments`."""
    reinforcement = job.method.reinforcement
    schemas = {
        t["function"]["name"]: t["function"].get("parameters") or {}
        for t in row.get("tools") or []
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    }
    item = {k: v for k, v in row.items() if k not in ("messages", "tools")}
    trace = f"trace_preflight_{uuid.uuid4().hex}"
    checks: list[Check] = []
    with httpx.Client(timeout=timeout_s, transport=transport, verify=tls()) as http:
        for tool in reinforcement.tools:
            args = (arguments or {}).get(tool.name, sample_arguments(schemas.get(tool.name, {})))
            call_id = f"call_preflight_{uuid.uuid4().hex[:12]}"
            body = {
                "type": "function_call",
                "id": None,  # as the platform's own preflight helper sends it
                "call_id": call_id,
                "name": tool.name,
                "arguments": json.dumps(args),
                "trace_id": trace,
                "item": item,
            }
            if tool.name not in schemas:
                checks.append(Check(what=f"tool {tool.name}: in the row's tools", ok=False))
            checks.append(_tool_call(http, tool.name, tool.server_url, tool.headers, body))
            if tool.headers:
                checks.append(_refused_without(http, f"tool {tool.name}", tool.server_url, body))
        grader = reinforcement.grader
        grade = {"sample": {"output_text": ""}, "item": item, "trace_id": trace}
        checks.append(_grade(http, grader.url, grader.headers, grade))
        if grader.headers:
            checks.append(_refused_without(http, "grader", grader.url, grade))
    return checks


def _post(
    http: httpx.Client, url: str, headers: dict[str, str], body: dict[str, Any]
) -> tuple[httpx.Response | None, float, str]:
    started = time.monotonic()
    try:
        response = http.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        return None, (time.monotonic() - started) * 1000, f"{type(exc).__name__}: {exc}"
    return response, (time.monotonic() - started) * 1000, ""


def _tool_call(
    http: httpx.Client, name: str, url: str, headers: dict[str, str], body: dict[str, Any]
) -> Check:
    what = f"tool {name}: a call answers a function_call_output"
    response, ms, error = _post(http, url, headers, body)
    if response is None:
        return Check(what=what, ok=False, detail=error, ms=ms)
    problems = _timing(ms) + _size(response)
    if response.status_code != 200:
        problems.append(f"HTTP {response.status_code}: {response.text[:300]}")
    else:
        try:
            answer = _ToolAnswer.model_validate_json(response.content)
        except ValidationError as exc:
            problems.append(f"not a function_call_output: {exc.errors()[0]['msg']}")
        else:
            if answer.call_id != body["call_id"]:
                problems.append(f"call_id {answer.call_id!r} is not the call's")
            if answer.type != "function_call_output":
                problems.append(f"type is {answer.type!r}")
    detail = "; ".join(problems) or f"HTTP 200 in {ms:.0f} ms"
    return Check(what=what, ok=not problems, detail=detail, ms=ms)


def _grade(http: httpx.Client, url: str, headers: dict[str, str], body: dict[str, Any]) -> Check:
    what = "grader: a grade answers a numeric score"
    response, ms, error = _post(http, url, headers, body)
    if response is None:
        return Check(what=what, ok=False, detail=error, ms=ms)
    problems = _timing(ms)
    if response.status_code != 200:
        problems.append(f"HTTP {response.status_code}: {response.text[:300]}")
    else:
        try:
            score = _Score.model_validate_json(response.content).score
        except ValidationError:
            problems.append(f"no numeric score in {response.text[:200]!r}")
        else:
            detail = f"score {score} in {ms:.0f} ms"
    detail = "; ".join(problems) if problems else detail
    return Check(what=what, ok=not problems, detail=detail, ms=ms)


def _refused_without(http: httpx.Client, who: str, url: str, body: dict[str, Any]) -> Check:
    """The endpoint must refuse a request without the job's headers (its credentials)."""
    what = f"{who}: refused without the job's headers"
    response, ms, error = _post(http, url, {}, body)
    if response is None:
        return Check(what=what, ok=False, detail=error, ms=ms)
    refused = response.status_code in (401, 403)
    return Check(what=what, ok=refused, detail=f"HTTP {response.status_code}", ms=ms)


def _timing(ms: float) -> list[str]:
    if ms / 1000 > PLATFORM_TIMEOUT_S:
        return [f"took {ms / 1000:.0f} s, past the platform's {PLATFORM_TIMEOUT_S:.0f} s"]
    return []


def _size(response: httpx.Response) -> list[str]:
    if len(response.content) > MAX_RESPONSE_BYTES:
        return [f"answer of {len(response.content):,} bytes, over the platform's 1 MB"]
    return []


class _ToolAnswer(BaseModel):
    type: str
    call_id: str
    output: str


class _Score(BaseModel):
    score: float
