"""The asyncio client of the rollout API (``/v1/rollouts``), on ``httpx.AsyncClient``.

Same operations, errors and retry policy as :class:`orchestrator.client.RolloutClient`.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel
from tenacity import AsyncRetrying

from orchestrator.api.models import (
    RolloutCreated,
    RolloutView,
    Score,
    ToolCallResponse,
    Trajectory,
)
from orchestrator.client import wire
from orchestrator.client.errors import InfraFailure, OrchestratorError
from orchestrator.client.retry import RetryPolicy
from orchestrator.client.transport import DEFAULT_TIMEOUT, auth_headers, log, log_retry
from orchestrator.tls import tls

M = TypeVar("M", bound=BaseModel)


class AsyncRolloutClient:
    """Every operation of the rollout API, awaitable; see :class:`RolloutClient`."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self._owned = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout, verify=tls())
        self._http.base_url = httpx.URL(base_url)
        self._http.headers.update(auth_headers(token))

    async def create(
        self,
        *,
        environment: str | None = None,
        codebase: str | None = None,
        item: dict[str, Any] | None = None,
        rollout_id: str | None = None,
    ) -> RolloutCreated:
        """Create a rollout and its sandbox; the answer carries the tools' schemas."""
        request = wire.create_request(
            environment=environment, codebase=codebase, item=item, rollout_id=rollout_id
        )
        return await self._send(request, RolloutCreated)

    async def call(
        self,
        rollout_id: str,
        tool: str,
        arguments: dict[str, Any] | str | None = None,
        *,
        call_id: str | None = None,
    ) -> ToolCallResponse:
        """Run one tool call. Agent mistakes come back as ``outcome: agent_error``."""
        return await self._send(
            wire.call_request(rollout_id, tool, arguments, call_id=call_id), ToolCallResponse
        )

    async def grade(
        self, rollout_id: str, *, answer: str | None = None, sample: dict[str, Any] | None = None
    ) -> Score:
        """Score the rollout (idempotent: a retry gets the first score)."""
        return await self._send(wire.grade_request(rollout_id, answer=answer, sample=sample), Score)

    async def get(self, rollout_id: str) -> RolloutView:
        return await self._send(wire.get_request(rollout_id), RolloutView)

    async def trajectory(self, rollout_id: str) -> Trajectory:
        return await self._send(wire.trajectory_request(rollout_id), Trajectory)

    async def close(self, rollout_id: str) -> RolloutView:
        """Destroy the rollout's sandbox now; the record stays readable."""
        return await self._send(wire.close_request(rollout_id), RolloutView)

    async def rollout(
        self,
        *,
        environment: str | None = None,
        codebase: str | None = None,
        item: dict[str, Any] | None = None,
        rollout_id: str | None = None,
    ) -> AsyncRollout:
        """Create a rollout; ``async with`` it to have it closed whatever happens."""
        created = await self.create(
            environment=environment, codebase=codebase, item=item, rollout_id=rollout_id
        )
        return AsyncRollout(self, created)

    async def shutdown(self) -> None:
        """Close the HTTP connections (only those this client opened)."""
        if self._owned:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def _send(self, request: wire.ApiRequest, model: type[M]) -> M:
        retrying = AsyncRetrying(**self.retry.tenacity_kwargs(), before_sleep=log_retry(request))
        return await retrying(self._attempt, request, model)

    async def _attempt(self, request: wire.ApiRequest, model: type[M]) -> M:
        try:
            response = await self._http.request(request.method, request.path, json=request.body)
        except httpx.TransportError as exc:
            raise wire.transport_error(request, exc) from exc
        try:
            return wire.parse(request, response, model)
        except OrchestratorError as error:
            if not wire.needs_probe(request, error):
                raise
            raise wire.settle(request, error, await self._probe(request.rollout_id)) from error

    async def _probe(self, rollout_id: str) -> wire.Probe:
        probe = wire.get_request(rollout_id)
        try:
            return wire.read_probe(await self._http.request(probe.method, probe.path))
        except httpx.TransportError:
            return None


class AsyncRollout:
    """One rollout, bound to its async client; ``async with`` closes it whatever
    happens. ``infra_failed`` turns true once an operation raised :class:`InfraFailure`."""

    def __init__(self, client: AsyncRolloutClient, created: RolloutCreated) -> None:
        self.client = client
        self.created = created
        self.id = created.rollout_id
        self.tools = created.tools
        self.infra_failed = False
        self.closed = False

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any] | str | None = None,
        *,
        call_id: str | None = None,
    ) -> ToolCallResponse:
        try:
            return await self.client.call(self.id, tool, arguments, call_id=call_id)
        except InfraFailure:
            self.infra_failed = True
            raise

    async def grade(
        self, *, answer: str | None = None, sample: dict[str, Any] | None = None
    ) -> Score:
        try:
            return await self.client.grade(self.id, answer=answer, sample=sample)
        except InfraFailure:
            self.infra_failed = True
            raise

    async def view(self) -> RolloutView:
        return await self.client.get(self.id)

    async def trajectory(self) -> Trajectory:
        return await self.client.trajectory(self.id)

    async def close(self) -> RolloutView | None:
        """Close once; later calls do nothing and return None."""
        if self.closed:
            return None
        view = await self.client.close(self.id)
        self.closed = True
        return view

    async def __aenter__(self) -> AsyncRollout:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.close()
        except OrchestratorError as error:
            log.warning("client.close_failed", rollout_id=self.id, error=str(error))
