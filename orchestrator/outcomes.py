"""The one outcome taxonomy every tool call and rollout ends in (see docs/architecture.md)."""

from enum import StrEnum


class Outcome(StrEnum):
    """How a tool call or a rollout ended.

    ``ok`` and ``agent_error`` are the agent's business and are scored; ``infra_error`` is
    ours and must never reach the grader as a zero; ``rejected`` never reached a sandbox.
    """

    OK = "ok"
    AGENT_ERROR = "agent_error"
    INFRA_ERROR = "infra_error"
    REJECTED = "rejected"
