"""What more than one part of the rollout lifecycle shares: a tool call's reply (the call
loop's, handed on by the API and the E2B layer), and a new rollout's record (made by a
start, or by the grade of a rollout that never called a tool)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from pydantic import BaseModel

from orchestrator.environments.loader import ResolvedEnvironment
from orchestrator.outcomes import Outcome
from orchestrator.state.models import RolloutSource, RolloutState
from orchestrator.state.records import Rollout


class CallReply(BaseModel):
    """What a tool call returned to the agent (also what a retry of it gets back)."""

    call_id: str
    seq: int
    output: str
    outcome: Outcome
    exit_code: int | None = None
    duration_ms: float
    truncated: bool = False
    error_kind: str | None = None


def new_record(
    rollout_id: str,
    source: RolloutSource,
    resolved: ResolvedEnvironment,
    item: dict[str, Any],
    *,
    state: RolloutState,
    **fields: Any,
) -> Rollout:
    now = time.time()
    return Rollout(
        rollout_id=rollout_id,
        source=source,
        environment=resolved.environment.name,
        codebase=resolved.codebase,
        image=resolved.image,
        workspace=resolved.workspace,
        environment_digest=resolved.environment.digest,
        environment_config=resolved.environment.snapshot,
        state=state,
        item=item,
        created_at=now,
        last_activity=now,
        **fields,
    )


def rollout_group(source: RolloutSource, item: dict[str, Any]) -> str | None:
    """The group a rollout of ``item`` is seated with: the rollouts of one dataset item (a
    GRPO group, sampled n times) have the same one, whatever order its keys came in. An
    E2B sandbox has no dataset item (its "item" is its template): no group."""
    if source == RolloutSource.E2B:
        return None
    canonical = json.dumps(item, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
