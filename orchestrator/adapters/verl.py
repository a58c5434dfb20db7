"""A verl tool (``BaseTool``) and reward function backed by the orchestrator.

verl builds one tool object per entry of its tool-config YAML (``examples/verl_tool_config.yaml``:
``class_name: orchestrator.adapters.verl.OrchestratorTool``,
``actor_rollout_ref.rollout.multi_turn.tool_config_path``) and the reward function from
``reward.custom_reward_function`` (``path=pkg://orchestrator.adapters.verl``,
``name=compute_score``, ``+reward.custom_reward_function.reward_kwargs.base_url=...`` and
``.token=...``). The module imports without verl (the product's venv has none): with verl
installed the tool subclasses ``verl.tools.base_tool.BaseTool``, without it it has the same
shape. Read against verl 0.9.1 (tests/trainers/verl_checks.py proves it there).

**One rollout per trajectory.** verl's ``ToolAgentLoop`` calls ``create`` → ``execute`` →
``release`` around every single tool call, with a fresh ``instance_id`` each time, and
passes ``execute(..., agent_data=AgentData)``. A sandbox must outlive those calls, so
when ``agent_data`` is given the rollout is keyed by the trajectory
(``agent_data.request_id``) and stays open across verl's create/release pairs; it is
created lazily at the trajectory's first tool call, from the dataset row's
``tools_kwargs[<tool>]["create_kwargs"]`` (verl's ``RLHFDataset`` copies
``extra_info.tools_kwargs`` there): ``item`` (the row the orchestrator's grader reads),
optionally ``environment`` and ``codebase`` (else the item's own, else the tool config's).
Each call writes the trajectory's ``agent_data.extra_fields``, which verl hands to the
reward function as ``extra_info`` and puts in the output batch as columns:
``orchestrator_rollout_id``, ``orchestrator_tool_calls`` and, on an infrastructure
failure, ``orchestrator_infra_failed: True`` and ``orchestrator_infra_error``.

**Scoring.** verl never calls ``calc_reward``; its reward step calls :func:`compute_score`,
which grades the trajectory's rollout on the model's final answer (the orchestrator
scores; ``ground_truth`` is not used: the grader reads the rollout's item) and closes it.
A trajectory whose model made no tool call has no rollout yet: one is created from
``extra_info["tools_kwargs"]`` and graded, so every sample is scored the same way. The
reward worker may be another process (a Ray actor): it needs only ``extra_info``.
Trajectory sessions that no reward step ends in this process are pruned once older than
``session_ttl_s`` (about the sandbox's lifetime); the server's idle timeout ends their
sandboxes anyway.

**Infrastructure failures are never a score.** An infra-failed call raises
:class:`~orchestrator.client.InfraFailure` (verl shows the model ``Error executing tool
...`` and carries on: the trajectory is flagged, not ended). ``compute_score`` then, by
default (``on_infra_failure="raise"``), raises, which fails the step rather than scoring
the sample; with ``on_infra_failure="flag"`` it returns ``{"score": 0.0,
"orchestrator_infra_failed": True}`` and the trainer must remove the sample before the
advantage with :func:`drop_infra_failed`. Agent-caused failures (a bad command, a wrong
path) are ordinary tool output and are scored: the server decides which is which.

**Without ``agent_data``** (a caller driving the tool itself): the rollout belongs to the
``instance_id``: ``create(instance_id, create_kwargs=row)`` on each tool joins it,
``execute`` runs in it (created lazily), ``calc_reward(instance_id, answer=...)`` grades
it (the first score stands), and the last ``release`` closes it.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.client import AsyncRolloutClient, InfraFailure, InvalidRequest, RetryPolicy
from orchestrator.observability.logging import get_logger
from orchestrator.outcomes import Outcome

if TYPE_CHECKING:
    # mypy runs where verl is not installed: the shape is what matters to it.
    _BaseTool = object
else:
    try:
        from verl.tools.base_tool import BaseTool as _BaseTool
    except ImportError:  # the product's venv: same duck shape, verl's loader only imports the class
        _BaseTool = object

log = get_logger(__name__)

# The trajectory's agent_data.extra_fields keys (reward extra_info, output batch columns).
ROLLOUT_ID = "orchestrator_rollout_id"
INFRA_FAILED = "orchestrator_infra_failed"
INFRA_ERROR = "orchestrator_infra_error"
TOOL_CALLS = "orchestrator_tool_calls"
# verl's column of each sample's reward dict: compute_score's own flag lands there, since
# an extra_fields column of the same name (None where no tool flagged) replaces the plain one.
REWARD_EXTRA_INFO = "reward_extra_info"

OnInfraFailure = Literal["raise", "flag"]


class ToolConfig(BaseModel):
    """The ``config:`` block of the tool's entry in verl's tool-config YAML."""

    model_config = ConfigDict(extra="ignore")  # verl's own keys (type: native) pass through

    base_url: str = Field(description="The orchestrator's URL, e.g. http://HOST:8000.")
    token: str | None = Field(None, description="The API's bearer token.")
    environment: str | None = Field(None, description="Default environment of new rollouts.")
    codebase: str | None = Field(None, description="Default codebase of new rollouts.")
    retry_attempts: int = Field(5, ge=1)
    session_ttl_s: float = Field(
        14400,
        gt=0,
        description="Forget (and close) a trajectory's rollout this long after it started "
        "when no reward step ended it here; the default is the sandbox lifetime's default.",
    )


class ToolText(BaseModel):
    """What ``execute`` returns as the tool's response: shaped like verl's
    ``ToolResponse`` (``text``; no image or video)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


@dataclass
class _Session:
    """One rollout: of a trajectory (verl's agent loop) or of an instance id."""

    row: dict[str, Any]
    started: float = field(default_factory=time.monotonic)
    rollout_id: str | None = None
    infra_error: str | None = None
    score: float | None = None
    holders: int = 0
    tool_calls: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class OrchestratorTool(_BaseTool):
    """One orchestrator tool (its name from the schema) as a verl ``BaseTool``."""

    # Class-wide: the tools of one trajectory share its rollout, one HTTP client serves
    # every tool and compute_score of the process.
    _instances: ClassVar[dict[str, _Session]] = {}
    _trajectories: ClassVar[dict[str, _Session]] = {}
    _clients: ClassVar[dict[tuple[str, str | None], AsyncRolloutClient]] = {}

    def __init__(self, config: dict[str, Any], tool_schema: Any = None) -> None:
        # BaseTool.__init__ is not called: it only prints the schema and needs verl's model.
        self.config = config
        self.settings = ToolConfig.model_validate(config)
        self.tool_schema = tool_schema
        self.name: str = _schema_name(tool_schema) or str(config.get("name", ""))
        if not self.name:
            raise ValueError("the tool needs a name: give a tool_schema (function.name)")

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolText]:
        """Register an instance (no rollout yet: it starts at the first ``execute``).

        The row comes as ``create_kwargs={...}`` (verl) or as keyword arguments.
        """
        await self._prune()
        instance_id = instance_id or uuid.uuid4().hex
        row = _row(kwargs)
        session = self._instances.setdefault(instance_id, _Session(row=row))
        if row and not session.row:
            session.row = row
        session.holders += 1
        return instance_id, ToolText()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolText, float, dict[str, Any]]:
        """Run this tool in the rollout (the trajectory's when ``agent_data`` is given):
        (response, step reward 0, metrics). Raises :class:`InfraFailure` when the rollout
        failed for infrastructure reasons (flagged in ``agent_data.extra_fields``)."""
        agent_data = kwargs.get("agent_data")
        session = (
            self._instance(instance_id)
            if agent_data is None
            else self._trajectory(instance_id, agent_data)
        )
        try:
            rollout_id = await self._ensure_rollout(session)
            session.tool_calls += 1
            reply = await self._client().call(rollout_id, self.name, parameters)
        except InfraFailure as exc:
            session.infra_error = session.infra_error or str(exc)
            log.warning("verl.infra_failure", rollout_id=session.rollout_id, error=str(exc))
            raise
        finally:
            _record(agent_data, session)
        metrics = {"agent_error": float(reply.outcome == Outcome.AGENT_ERROR)}
        metrics["duration_ms"] = float(reply.duration_ms)
        return ToolText(text=reply.output), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's rollout graded on ``answer=`` (or ``sample=``); the first score
        stands. Raises :class:`InfraFailure` for a failed rollout: drop the sample."""
        answer, sample = kwargs.get("answer"), kwargs.get("sample")
        session = self._instance(instance_id)
        if session.score is not None:
            return session.score
        if answer is None and sample is None:
            raise InvalidRequest("calc_reward needs answer= (the model's final answer)")
        rollout_id = await self._ensure_rollout(session)
        try:
            score = await self._client().grade(rollout_id, answer=answer, sample=sample)
        except InfraFailure as exc:
            session.infra_error = session.infra_error or str(exc)
            raise
        session.score = score.score
        return score.score

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Leave the instance; the last tool to leave closes its own rollout (a
        trajectory's rollout stays open: :func:`compute_score` closes it)."""
        session = self._instances.get(instance_id)
        if session is None:
            return
        session.holders -= 1
        if session.holders > 0:
            return
        self._instances.pop(instance_id, None)
        await self._close(session)

    def rollout_id(self, instance_id: str) -> str | None:
        """The instance's rollout, once its first ``execute`` created it."""
        session = self._instances.get(instance_id)
        return session.rollout_id if session else None

    def is_infra_failed(self, instance_id: str) -> bool:
        """True when the instance's rollout failed for infrastructure reasons."""
        session = self._instances.get(instance_id)
        return session is not None and session.infra_error is not None

    # -- private ------------------------------------------------------------------------------

    def _instance(self, instance_id: str) -> _Session:
        session = self._instances.get(instance_id)
        if session is None:
            raise KeyError(f"unknown instance {instance_id}: create() it first")
        return session

    def _trajectory(self, instance_id: str, agent_data: Any) -> _Session:
        key = str(agent_data.request_id)
        session = self._trajectories.get(key)
        if session is None:
            instance = self._instances.get(instance_id)
            row = instance.row if instance is not None and instance.row else {}
            row = row or _row_of_tools_kwargs(getattr(agent_data, "tools_kwargs", None), self.name)
            session = self._trajectories[key] = _Session(row=row)
        return session

    async def _ensure_rollout(self, session: _Session) -> str:
        async with session.lock:  # the tools of a trajectory may run in parallel
            if session.infra_error is not None:
                # Sticky: an infra-failed rollout fails every later call the same way.
                raise InfraFailure(session.infra_error, rollout_id=session.rollout_id)
            if session.rollout_id is None:
                try:
                    created = await self._client().create(
                        **_create_args(
                            session.row, self.settings.environment, self.settings.codebase
                        )
                    )
                except InfraFailure as exc:
                    session.infra_error = str(exc)
                    raise
                session.rollout_id = created.rollout_id
            return session.rollout_id

    async def _close(self, session: _Session) -> None:
        if session.rollout_id is not None:
            await _close_quietly(self._client(), session.rollout_id)

    async def _prune(self) -> None:
        cutoff = time.monotonic() - self.settings.session_ttl_s
        for registry in (self._trajectories, self._instances):
            for key, session in list(registry.items()):
                if session.started < cutoff:
                    registry.pop(key, None)
                    log.warning("verl.session_pruned", rollout_id=session.rollout_id)
                    await self._close(session)

    def _client(self) -> AsyncRolloutClient:
        return _client(self.settings.base_url, self.settings.token, self.settings.retry_attempts)

    @classmethod
    def _forget(cls, rollout_id: str) -> None:
        """Drop the trajectory sessions of a rollout the reward step ended."""
        for key, session in list(cls._trajectories.items()):
            if session.rollout_id == rollout_id:
                cls._trajectories.pop(key, None)

    @classmethod
    async def shutdown(cls) -> None:
        """Close every rollout still open here, then the HTTP clients (at the end of a
        run, or before switching event loops: a client belongs to its loop)."""
        sessions = [*cls._instances.values(), *cls._trajectories.values()]
        cls._instances, cls._trajectories = {}, {}
        if cls._clients:
            client = next(iter(cls._clients.values()))
            for session in sessions:
                if session.rollout_id is not None:
                    await _close_quietly(client, session.rollout_id)
        clients, cls._clients = list(cls._clients.values()), {}
        for each in clients:
            await each.shutdown()


async def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None,
    *,
    base_url: str,
    token: str | None = None,
    on_infra_failure: OnInfraFailure = "raise",
) -> dict[str, Any]:
    """verl's custom reward function: the trajectory's rollout graded by the orchestrator
    on the final answer in ``solution_str``, then closed.

    ``extra_info`` is what verl gives: the dataset row's ``extra_info`` (``tools_kwargs``)
    merged with the trajectory's ``agent_data.extra_fields`` (the rollout id, the infra
    flag). Returns ``{"score": s, "orchestrator_infra_failed": False,
    "orchestrator_rollout_id": id}`` (verl takes ``score``; every sample returns the same
    keys, which verl requires of the reward's extra info). An infrastructure failure
    raises :class:`InfraFailure` (``on_infra_failure="raise"``), or with ``"flag"``
    returns ``{"score": 0.0, "orchestrator_infra_failed": True, ...}``: then remove the
    sample with :func:`drop_infra_failed` before computing the advantage.
    """
    del data_source, ground_truth  # the orchestrator's grader reads the rollout's item
    info = dict(extra_info or {})
    client = _client(base_url, token)
    rollout_id: str | None = info.get(ROLLOUT_ID) or None
    try:
        if info.get(INFRA_FAILED):
            # Sticky on the server: a grade would fail the same way.
            raise InfraFailure(str(info.get(INFRA_ERROR) or "infra failure"), rollout_id=rollout_id)
        if rollout_id is None:  # the model made no tool call: the rollout starts here
            row = _row_of_tools_kwargs(info.get("tools_kwargs"), None)
            if not row:
                raise InvalidRequest("no rollout and no extra_info.tools_kwargs to start one")
            rollout_id = (await client.create(**_create_args(row, None, None))).rollout_id
        score = (await client.grade(rollout_id, answer=final_answer(solution_str))).score
    except InfraFailure as exc:
        log.warning("verl.reward_infra_failure", rollout_id=rollout_id, error=str(exc))
        await _end(client, rollout_id)
        if on_infra_failure == "raise":
            raise
        return {"score": 0.0, INFRA_FAILED: True, ROLLOUT_ID: rollout_id}
    await _end(client, rollout_id)
    return {"score": score, INFRA_FAILED: False, ROLLOUT_ID: rollout_id}


def infra_failed_mask(non_tensor_batch: Mapping[str, Any]) -> list[bool]:
    """Per sample of a verl batch's ``non_tensor_batch``: True when a tool or the reward
    flagged it as failed for infrastructure reasons."""
    columns = [non_tensor_batch.get(INFRA_FAILED), non_tensor_batch.get(REWARD_EXTRA_INFO)]
    size = next((len(column) for column in non_tensor_batch.values()), 0)
    flags = [False] * size
    tool_flags, rewards = columns
    for i in range(size):
        reward = rewards[i] if rewards is not None else None
        flags[i] = bool(tool_flags is not None and tool_flags[i]) or bool(
            isinstance(reward, Mapping) and reward.get(INFRA_FAILED)
        )
    return flags


def drop_infra_failed(batch: Any) -> Any:
    """The verl ``DataProto`` without its infra-flagged samples (call it before the
    advantage: a flagged sample's 0.0 must not reach its group's baseline). A group
    keeps its other samples; one left alone gets verl's single-sample treatment."""
    import numpy as np  # here: the product's venv has no numpy, and only verl calls this

    keep = np.array([not flag for flag in infra_failed_mask(batch.non_tensor_batch)], dtype=bool)
    return batch if keep.all() else batch[keep]


_TOOL_TURN_END = re.compile(r"</tool_response>")
_TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


def final_answer(solution_str: str) -> str:
    """The model's last turn in verl's decoded response (which holds every turn, tool
    results included): the text after the last ``</tool_response>``, without its role
    header and any tool call in it (Qwen/Hermes chat format, verl's ``hermes`` parser)."""
    last = _TOOL_TURN_END.split(solution_str)[-1]
    last = _TOOL_CALL.sub("", last).strip()
    if last.startswith("assistant\n"):  # the header once special tokens are skipped
        last = last[len("assistant\n") :]
    return last.strip()


def _record(agent_data: Any, session: _Session) -> None:
    if agent_data is None:
        return
    extra = agent_data.extra_fields
    extra[ROLLOUT_ID] = session.rollout_id
    extra[TOOL_CALLS] = session.tool_calls
    if session.infra_error is not None:
        extra[INFRA_FAILED] = True
        extra[INFRA_ERROR] = session.infra_error


def _row(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A create()'s row: ``create_kwargs={...}`` (verl) or the keyword arguments."""
    wrapped = kwargs.get("create_kwargs")
    return dict(wrapped if wrapped is not None else kwargs)


def _row_of_tools_kwargs(tools_kwargs: Any, name: str | None) -> dict[str, Any]:
    """A dataset row's ``tools_kwargs``: ``name``'s create_kwargs, else the first tool's."""
    if not isinstance(tools_kwargs, Mapping):
        return {}
    names = [name] if name in tools_kwargs else list(tools_kwargs)
    for each in names:
        entry = tools_kwargs.get(each)
        if isinstance(entry, Mapping) and entry.get("create_kwargs"):
            return dict(entry["create_kwargs"])
    return {}


def _create_args(
    row: Mapping[str, Any], environment: str | None, codebase: str | None
) -> dict[str, Any]:
    item = dict(row.get("item") or {})
    return {
        "environment": row.get("environment") or item.get("environment") or environment,
        "codebase": row.get("codebase") or item.get("codebase") or codebase,
        "item": item,
    }


def _client(base_url: str, token: str | None, attempts: int = 5) -> AsyncRolloutClient:
    key = (base_url, token)
    client = OrchestratorTool._clients.get(key)
    if client is None:
        client = AsyncRolloutClient(base_url, token, retry=RetryPolicy(attempts=attempts))
        OrchestratorTool._clients[key] = client
    return client


async def _end(client: AsyncRolloutClient, rollout_id: str | None) -> None:
    if rollout_id is not None:
        await _close_quietly(client, rollout_id)
        OrchestratorTool._forget(rollout_id)


async def _close_quietly(client: AsyncRolloutClient, rollout_id: str) -> None:
    try:
        await client.close(rollout_id)
    except Exception as exc:  # noqa: BLE001 - the reaper closes it later; closing never fails a step
        log.warning("verl.close_failed", rollout_id=rollout_id, error=repr(exc))


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
