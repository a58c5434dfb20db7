"""A verl ``BaseTool``-shaped tool backed by the orchestrator (no verl import).

verl builds one tool object per entry of its tool-config YAML (see
``examples/verl_tool_config.yaml``: ``class_name: orchestrator.adapters.verl.OrchestratorTool``)
and drives each trajectory through ``create`` → ``execute``... → ``calc_reward`` →
``release``, all coroutines. Every tool object of one trajectory gets the same
``instance_id``, so the rollout is keyed by it and shared by the tools (``shell`` and
``read_file`` act in the same sandbox); the last ``release`` closes it.

``create`` takes the rollout's row from its keyword arguments (verl passes the dataset
row's ``tools_kwargs[<tool>]["create_kwargs"]``): ``item`` (the row the grader reads),
optionally ``environment`` and ``codebase``. Newer verl passes them wrapped as
``create_kwargs={...}``; both work. Note: verl's ``ToolAgentLoop`` creates and releases
an instance around every single call; a stateful sandbox needs the trajectory-long
lifecycle above (verl's multi-turn rollout, or an agent loop that creates once).

``calc_reward(instance_id, answer=...)`` grades the rollout on the model's final answer
(idempotent: later calls return the first score). ``grade(instance_id, answer)`` is the
same for a verl reward function that holds the instance id.

Infrastructure failures: ``execute`` raises :class:`~orchestrator.client.InfraFailure`
(verl ends the trajectory) unless the tool's config sets ``raise_on_infra_failure:
false``, in which case the response says so and ``metrics["infra_failed"]`` is 1.0.
``calc_reward`` on a failed rollout always raises :class:`InfraFailure`, never returns a
zero; ``is_infra_failed(instance_id)`` tells the trainer which samples to drop.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.client import AsyncRolloutClient, InfraFailure, InvalidRequest, RetryPolicy
from orchestrator.observability.logging import get_logger

log = get_logger(__name__)


class ToolConfig(BaseModel):
    """The ``config:`` block of the tool's entry in verl's tool-config YAML."""

    model_config = ConfigDict(extra="ignore")

    base_url: str = Field(description="The orchestrator's URL, e.g. http://HOST:8000.")
    token: str | None = Field(None, description="The API's bearer token.")
    environment: str | None = Field(None, description="Default environment of new rollouts.")
    codebase: str | None = Field(None, description="Default codebase of new rollouts.")
    raise_on_infra_failure: bool = True
    retry_attempts: int = Field(5, ge=1)


class ToolText(BaseModel):
    """What ``execute`` returns as the tool's response: shaped like verl's
    ``ToolResponse`` (``text``; no image or video)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


@dataclass
class _Session:
    """One trajectory's rollout, shared by the tool objects that created it."""

    rollout_id: str | None = None
    holders: int = 0
    infra_error: str | None = None
    score: float | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class OrchestratorTool:
    """One orchestrator tool (its name from the schema) in verl's ``BaseTool`` shape."""

    # Shared by every tool object in the process: the tools of one trajectory share a
    # rollout, and one connection pool serves them all.
    _sessions: ClassVar[dict[str, _Session]] = {}
    _clients: ClassVar[dict[tuple[str, str | None], AsyncRolloutClient]] = {}

    def __init__(self, config: dict[str, Any], tool_schema: Any = None) -> None:
        self.config = config
        self.settings = ToolConfig.model_validate(config)
        self.tool_schema = tool_schema
        self.name: str = _schema_name(tool_schema) or str(config.get("name", ""))
        if not self.name:
            raise ValueError("the tool needs a name: give a tool_schema (function.name)")

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolText]:
        """Join the trajectory's rollout, creating it on the first tool's ``create``."""
        instance_id = instance_id or uuid.uuid4().hex
        row = dict(kwargs.get("create_kwargs") or kwargs)
        session = self._sessions.setdefault(instance_id, _Session())
        async with session.lock:
            session.holders += 1
            if session.rollout_id is None and session.infra_error is None:
                try:
                    created = await self._client().create(
                        environment=row.get("environment", self.settings.environment),
                        codebase=row.get("codebase", self.settings.codebase),
                        item=row.get("item") or {},
                    )
                    session.rollout_id = created.rollout_id
                except InfraFailure as exc:
                    session.infra_error = str(exc)
        return instance_id, ToolText()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolText, float, dict[str, Any]]:
        """Run this tool in the trajectory's sandbox: (response, step reward 0, metrics)."""
        session = self._session(instance_id)
        try:
            if session.infra_error is not None or session.rollout_id is None:
                raise InfraFailure(session.infra_error or "the rollout was never created")
            reply = await self._client().call(session.rollout_id, self.name, parameters)
        except InfraFailure as exc:
            session.infra_error = session.infra_error or str(exc)
            if self.settings.raise_on_infra_failure:
                raise
            text = f"infrastructure failure (this sample must be dropped): {exc}"
            return ToolText(text=text), 0.0, {"infra_failed": 1.0}
        metrics = {
            "infra_failed": 0.0,
            "agent_error": float(reply.outcome == "agent_error"),
            "duration_ms": reply.duration_ms,
        }
        return ToolText(text=reply.output), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The rollout's score on ``answer=`` (or ``sample=``); the first score stands.
        Raises :class:`InfraFailure` for a failed rollout: drop the sample."""
        answer, sample = kwargs.get("answer"), kwargs.get("sample")
        session = self._session(instance_id)
        if answer is None and sample is None:
            if session.score is not None:
                return session.score
            raise InvalidRequest("calc_reward needs answer= (the model's final answer)")
        return await self.grade(instance_id, answer, sample=sample)

    async def grade(
        self, instance_id: str, answer: str | None, *, sample: dict[str, Any] | None = None
    ) -> float:
        """Grade the trajectory's rollout; raises :class:`InfraFailure` if it failed."""
        session = self._session(instance_id)
        if session.infra_error is not None or session.rollout_id is None:
            raise InfraFailure(
                session.infra_error or "the rollout was never created",
                rollout_id=session.rollout_id,
            )
        try:
            score = await self._client().grade(session.rollout_id, answer=answer, sample=sample)
        except InfraFailure as exc:
            session.infra_error = str(exc)
            raise
        session.score = score.score
        return score.score

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Leave the rollout; the last tool to leave closes it."""
        session = self._sessions.get(instance_id)
        if session is None:
            return
        async with session.lock:
            session.holders -= 1
            if session.holders > 0:
                return
            self._sessions.pop(instance_id, None)
            if session.rollout_id is not None:
                try:
                    await self._client().close(session.rollout_id)
                except Exception as exc:  # noqa: BLE001 - the reaper closes it later; a release never fails
                    log.warning(
                        "verl.release_failed", rollout_id=session.rollout_id, error=repr(exc)
                    )

    def is_infra_failed(self, instance_id: str) -> bool:
        """True when the trajectory's rollout failed for infrastructure reasons."""
        session = self._sessions.get(instance_id)
        return session is not None and session.infra_error is not None

    def rollout_id(self, instance_id: str) -> str | None:
        session = self._sessions.get(instance_id)
        return session.rollout_id if session else None

    def _session(self, instance_id: str) -> _Session:
        session = self._sessions.get(instance_id)
        if session is None:
            raise KeyError(f"unknown instance {instance_id}: create() it first")
        return session

    def _client(self) -> AsyncRolloutClient:
        key = (self.settings.base_url, self.settings.token)
        client = self._clients.get(key)
        if client is None:
            retry = RetryPolicy(attempts=self.settings.retry_attempts)
            client = AsyncRolloutClient(self.settings.base_url, self.settings.token, retry=retry)
            self._clients[key] = client
        return client

    @classmethod
    async def shutdown(cls) -> None:
        """Close the shared HTTP clients (at the end of a run, or between event loops)."""
        clients, cls._clients = list(cls._clients.values()), {}
        for client in clients:
            await client.shutdown()


def _schema_name(schema: Any) -> str | None:
    """The function name of an OpenAI tool schema: verl's pydantic model or a dict."""
    if schema is None:
        return None
    if isinstance(schema, dict):
        name = (schema.get("function") or {}).get("name")
        return str(name) if name else None
    function = getattr(schema, "function", None)
    name = getattr(function, "name", None)
    return str(name) if name else None
