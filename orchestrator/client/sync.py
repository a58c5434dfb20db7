"""The blocking client of the rollout API (``/v1/rollouts``), on ``httpx.Client``."""

from __future__ import annotations

from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel
from tenacity import Retrying

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


class RolloutClient:
    """Every operation of the rollout API, returning the API's own models.

    Errors are typed (:mod:`orchestrator.client.errors`); 429s, 503s with the rollout
    intact and unanswered requests are retried under ``retry`` with the same rollout id
    and ``call_id``. An ``infra_failed`` rollout raises :class:`InfraFailure`: discard it.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        http: httpx.Client | None = None,
    ) -> None:
        """``http``: a ready ``httpx.Client`` to send through (tests, custom transports);
        its base URL is replaced by ``base_url``."""
        self.retry = retry or RetryPolicy()
        self._owned = http is None
        self._http = http or httpx.Client(timeout=timeout, verify=tls())
        self._http.base_url = httpx.URL(base_url)
        self._http.headers.update(auth_headers(token))

    # -- the API -----------------------------------------------------------------------------

    def create(
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
        return self._send(request, RolloutCreated)

    def call(
        self,
        rollout_id: str,
        tool: str,
        arguments: dict[str, Any] | str | None = None,
        *,
        call_id: str | None = None,
    ) -> ToolCallResponse:
        """Run one tool call. Agent mistakes come back as ``outcome: agent_error``."""
        return self._send(
            wire.call_request(rollout_id, tool, arguments, call_id=call_id), ToolCallResponse
        )

    def grade(
        self, rollout_id: str, *, answer: str | None = None, sample: dict[str, Any] | None = None
    ) -> Score:
        """Score the rollout (idempotent: a retry gets the first score)."""
        return self._send(wire.grade_request(rollout_id, answer=answer, sample=sample), Score)

    def get(self, rollout_id: str) -> RolloutView:
        return self._send(wire.get_request(rollout_id), RolloutView)

    def trajectory(self, rollout_id: str) -> Trajectory:
        return self._send(wire.trajectory_request(rollout_id), Trajectory)

    def close(self, rollout_id: str) -> RolloutView:
        """Destroy the rollout's sandbox now; the record stays readable."""
        return self._send(wire.close_request(rollout_id), RolloutView)

    def rollout(
        self,
        *,
        environment: str | None = None,
        codebase: str | None = None,
        item: dict[str, Any] | None = None,
        rollout_id: str | None = None,
    ) -> Rollout:
        """Create a rollout and hand it back as a context manager that always closes it."""
        created = self.create(
            environment=environment, codebase=codebase, item=item, rollout_id=rollout_id
        )
        return Rollout(self, created)

    # -- plumbing ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the HTTP connections (only those this client opened)."""
        if self._owned:
            self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _send(self, request: wire.ApiRequest, model: type[M]) -> M:
        retrying = Retrying(**self.retry.tenacity_kwargs(), before_sleep=log_retry(request))
        result: M = retrying(self._attempt, request, model)
        return result

    def _attempt(self, request: wire.ApiRequest, model: type[M]) -> M:
        try:
            response = self._http.request(request.method, request.path, json=request.body)
        except httpx.TransportError as exc:
            raise wire.transport_error(request, exc) from exc
        try:
            return wire.parse(request, response, model)
        except OrchestratorError as error:
            if not wire.needs_probe(request, error):
                raise
            raise wire.settle(request, error, self._probe(request.rollout_id)) from error

    def _probe(self, rollout_id: str) -> wire.Probe:
        probe = wire.get_request(rollout_id)
        try:
            return wire.read_probe(self._http.request(probe.method, probe.path))
        except httpx.TransportError:
            return None


class Rollout:
    """One rollout, bound to its client. ``with`` closes it whatever happens; a
    close that fails there is logged, not raised (the reaper ends the rollout later).

    ``infra_failed`` turns true once any operation raised :class:`InfraFailure`: the
    trainer must drop this sample.
    """

    def __init__(self, client: RolloutClient, created: RolloutCreated) -> None:
        self.client = client
        self.created = created
        self.id = created.rollout_id
        self.tools = created.tools
        self.infra_failed = False
        self.closed = False

    def call(
        self,
        tool: str,
        arguments: dict[str, Any] | str | None = None,
        *,
        call_id: str | None = None,
    ) -> ToolCallResponse:
        try:
            return self.client.call(self.id, tool, arguments, call_id=call_id)
        except InfraFailure:
            self.infra_failed = True
            raise

    def grade(self, *, answer: str | None = None, sample: dict[str, Any] | None = None) -> Score:
        try:
            return self.client.grade(self.id, answer=answer, sample=sample)
        except InfraFailure:
            self.infra_failed = True
            raise

    def view(self) -> RolloutView:
        return self.client.get(self.id)

    def trajectory(self) -> Trajectory:
        return self.client.trajectory(self.id)

    def close(self) -> RolloutView | None:
        """Close once; later calls do nothing and return None."""
        if self.closed:
            return None
        view = self.client.close(self.id)
        self.closed = True
        return view

    def __enter__(self) -> Rollout:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except OrchestratorError as error:
            log.warning("client.close_failed", rollout_id=self.id, error=str(error))
