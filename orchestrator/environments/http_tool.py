"""HTTP tools: a call forwarded to the operator's own service, outside the sandbox
(docs/tenancy.md, "HTTP tools").

An :class:`HttpTool` is built from a :class:`~orchestrator.environments.models.HttpToolConfig`.
Each call's arguments are validated as a custom tool's are (its ``parameters``), then
POSTed as a JSON object by the API process (:meth:`HttpTool.request`). What the service
answers decides whose the outcome is:

- 2xx: the body is the model's output (at most ``max_response_bytes`` read; then the
  output budget), ``ok``;
- 4xx about what the agent asked (:data:`AGENT_STATUSES`: 400, 404, 422, ...): the agent's
  mistake, ``agent_error``, the status and the body's start shown to the model, scored;
- any other 4xx (401, 403, 429, ...), a 5xx, a redirect, a timeout, a refused or broken
  connection: ours. :class:`ServiceFailed` carries the
  evidence (status, time taken, the URL's scheme, host and path), never a header: the
  rollout fails and is never scored.

Headers may name the environment's secrets (``{secret:NAME}``), read when the call is made;
their values appear in no trajectory, log line, export or error message.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict

from orchestrator.config import Settings
from orchestrator.environments.custom_tool import SchemaTool
from orchestrator.environments.models import SECRET_REF, HttpToolConfig
from orchestrator.outcomes import Outcome
from orchestrator.sandbox.backend import ExecOp, OpResult, ReadOp
from orchestrator.secrets import SecretSource, SecretUnreadable, read_secret
from orchestrator.tools.base import ToolResult, agent_error, within_budget

SHOWN_ERROR_BYTES = 2000
"""Of a 4xx answer's body, what the model is shown."""
AGENT_STATUSES = frozenset({400, 404, 405, 409, 410, 413, 414, 415, 416, 422})
"""4xx answers about what the agent asked (a malformed or impossible request, nothing
found): its mistake, scored. Every other 4xx is about us (401, 403, 407: our credentials;
408, 429: the service's load; the rest: a misconfigured tool), as is any 5xx."""


class HttpArgs(BaseModel):
    """A validated call: the JSON object the service is sent."""

    model_config = ConfigDict(frozen=True)

    values: dict[str, Any]


class ServiceFailed(Exception):
    """The tool's service failed the call (5xx, timeout, connection): our fault."""

    def __init__(self, message: str, evidence: dict[str, Any]) -> None:
        super().__init__(message)
        self.message = message
        self.evidence = evidence


class SecretUnavailable(ServiceFailed):
    """A secret the tool's headers name could not be read (our configuration's fault)."""


class HttpTool(SchemaTool[HttpArgs]):
    """An HTTP tool: its call goes to the operator's service, never to the sandbox."""

    args_model = HttpArgs
    config: HttpToolConfig

    def __init__(self, config: HttpToolConfig, secrets: dict[str, SecretSource]) -> None:
        super().__init__(config)
        self.secrets = {name: secrets[name] for name in config.secrets_named()}

    def parse(self, arguments: dict[str, Any] | str | None, settings: Settings) -> HttpArgs:
        return HttpArgs(values=self.validated(arguments))

    def command_timeout_s(self, args: HttpArgs, settings: Settings) -> float:
        return self.config.timeout_s

    def operation(self, args: HttpArgs, settings: Settings) -> ExecOp | ReadOp:
        raise TypeError(f"{self.name} is an HTTP tool: it runs outside the sandbox")

    def shape(self, args: HttpArgs, settings: Settings, ran: OpResult) -> ToolResult:
        raise TypeError(f"{self.name} is an HTTP tool: it runs outside the sandbox")

    def where(self) -> str:
        """The service, as evidence may name it: scheme, host and path, no query."""
        parts = urlsplit(self.config.url)
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"

    async def request(
        self, client: httpx.AsyncClient, args: HttpArgs, settings: Settings
    ) -> ToolResult:
        """Make the call; its result for the model, or :class:`ServiceFailed`."""
        headers = {"content-type": "application/json"}
        headers |= {k: self._filled(v) for k, v in self.config.headers.items()}
        body = json.dumps(args.values, ensure_ascii=False).encode()
        started = time.monotonic()
        limit = self.config.max_response_bytes
        try:
            async with client.stream(
                "POST",
                self.config.url,
                content=body,
                headers=headers,
                timeout=self.config.timeout_s,
            ) as response:
                read = bytearray()
                async for chunk in response.aiter_bytes():
                    read += chunk
                    if len(read) > limit:
                        break
                status = response.status_code
        except httpx.TimeoutException:
            raise self._failed(f"no answer within {self.config.timeout_s} s", started) from None
        except httpx.HTTPError as exc:
            # The exception's text may hold the URL, never a header: the URL is the
            # operator's, its query left out of the evidence.
            raise self._failed(f"{type(exc).__name__}", started) from None
        elapsed_ms = (time.monotonic() - started) * 1000
        truncated = len(read) > limit
        text = bytes(read[:limit]).decode("utf-8", errors="replace")
        if status >= 400 and status not in AGENT_STATUSES:
            raise self._failed(f"answered {status}", started, status=status)
        budget = self.fitted_budget(settings)
        if status >= 400:
            shown = text[:SHOWN_ERROR_BYTES]
            return agent_error(
                f"{self.name} refused the call ({status}): {shown}",
                "tool_refused",
                budget=budget,
            ).model_copy(update={"duration_ms": elapsed_ms})
        if status >= 300:
            raise self._failed(f"answered {status} (not followed)", started, status=status)
        result = ToolResult(
            output=text, outcome=Outcome.OK, truncated=truncated, duration_ms=elapsed_ms
        )
        return within_budget(result, budget)

    def _filled(self, value: str) -> str:
        return SECRET_REF.sub(lambda m: self._secret(m.group(1)), value)

    def _secret(self, name: str) -> str:
        try:
            return read_secret(name, self.secrets[name])
        except SecretUnreadable as exc:
            raise SecretUnavailable(
                f"{exc} for tool {self.name!r}", {"tool": self.name, "secret": name}
            ) from None

    def _failed(self, what: str, started: float, status: int | None = None) -> ServiceFailed:
        elapsed = round((time.monotonic() - started) * 1000, 1)
        evidence: dict[str, Any] = {"tool": self.name, "service": self.where(), "ms": elapsed}
        if status is not None:
            evidence["status"] = status
        return ServiceFailed(f"the {self.name} tool's service {what}", evidence)
