"""HTTP request and response bodies. Unknown fields are ignored (docs/agent-rft.md)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from orchestrator.outcomes import Outcome
from orchestrator.state.models import TrajectoryStep

# No ':' — it separates the parts of the store's Redis keys.
ROLLOUT_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$"
CALL_ID = r"^[A-Za-z0-9_.-]{1,200}$"


# Rows, samples and arguments are stored as JSON; deeper nesting than this is no real
# dataset row and would fail to serialise later (pydantic stops at 255 levels).
MAX_JSON_DEPTH = 64


def _bounded_depth(value: Any) -> Any:
    level = [value]
    for _ in range(MAX_JSON_DEPTH):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, dict | list)
        ]
        if not level:
            return value
    raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")


JsonObject = Annotated[dict[str, Any], AfterValidator(_bounded_depth)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    """A Responses-API function call, as Agent RFT posts it to a tool endpoint."""

    type: str = "function_call"
    id: str | None = Field(
        None,
        max_length=200,
        description="Echoed back, never a key (it may be absent or null: the platform's own "
        "preflight sends null); call_id is the call's identity.",
    )
    call_id: str = Field(pattern=CALL_ID)
    name: str | None = Field(None, max_length=64)
    arguments: str | JsonObject | None = None
    trace_id: str = Field(pattern=ROLLOUT_ID, description="The rollout's identity.")
    item: JsonObject = Field(default_factory=dict, description="The dataset row.")


class FunctionCallOutput(BaseModel):
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    id: str | None = Field(description="The request's id, as it came (null when absent).")
    output: str


class GradeRequest(_Lenient):
    """What Agent RFT posts to an endpoint grader."""

    sample: JsonObject = Field(default_factory=dict)
    item: JsonObject = Field(default_factory=dict)
    trace_id: str = Field(pattern=ROLLOUT_ID)


class Score(BaseModel):
    score: float
    details: dict[str, Any] = Field(default_factory=dict)


class CreateRollout(_Lenient):
    environment: str | None = Field(None, max_length=100)
    codebase: str | None = Field(None, max_length=100)
    item: JsonObject = Field(default_factory=dict)
    id: str | None = Field(None, pattern=ROLLOUT_ID)


class RolloutCreated(BaseModel):
    rollout_id: str
    environment: str
    codebase: str | None
    state: str
    host: str | None
    sandbox_id: str | None
    tools: list[dict[str, Any]]


class ToolCallRequest(_Lenient):
    arguments: str | JsonObject | None = None
    call_id: str | None = Field(None, pattern=CALL_ID)


class ToolCallResponse(BaseModel):
    call_id: str
    seq: int
    output: str
    outcome: Outcome
    exit_code: int | None
    duration_ms: float
    truncated: bool
    error_kind: str | None = None


class RolloutGradeRequest(_Lenient):
    answer: str | None = None
    sample: JsonObject | None = None

    @model_validator(mode="after")
    def _one_of(self) -> RolloutGradeRequest:
        if (self.answer is None) == (self.sample is None):
            raise ValueError("give exactly one of `answer` or `sample`")
        return self


class RolloutView(BaseModel):
    rollout_id: str
    source: str
    state: str
    environment: str
    codebase: str | None
    host: str | None
    sandbox_id: str | None
    runtime: str | None
    tool_calls: int
    outcome: Outcome | None
    score: float | None
    timings: dict[str, float | None]
    pool_hit: bool | None = None
    sandbox_reuses: int | None = Field(
        None,
        description="How many rollouts its sandbox served before this one (0: made for it; "
        "recycled sandboxes, docs/architecture.md).",
    )
    sandbox_reset_digest: str | None = Field(
        None, description="The audit digest of its sandbox's last reset ('' if never reset)."
    )
    infra_failure: dict[str, Any] | None
    ended_by: dict[str, Any] | None = Field(
        None,
        description="Set when the orchestrator ended the rollout before its grade (cause: "
        "idle_reaped, lifetime_exceeded, environment_removed): a later call or grade fails it.",
    )


class Trajectory(BaseModel):
    rollout_id: str
    steps: list[TrajectoryStep]
    sandbox_id: str | None = None
    sandbox_reuses: int | None = Field(
        None, description="Rollouts its sandbox served before this one (see RolloutView)."
    )
    sandbox_reset_digest: str | None = None


class ErrorBody(BaseModel):
    type: Outcome
    code: str
    message: str
    rollout_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
