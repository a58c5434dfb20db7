"""How long one request may take, and Agent RFT's bound on it.

Agent RFT waits at most 10 minutes for a tool call or a grade (docs/agent-rft.md); past
that it gives up on its own and never hears our 503. So every path an Agent RFT request can
take must end within that bound, with a margin for the network and the platform:

- a call's command is capped (:func:`agent_rft_settings`) so that the longest command plus
  the wait for a worker, the exec agent's reply allowance and a probe after it fit;
- a rollout's first call waits for capacity and its sandbox only as long as its own
  deadline leaves once its command's time is kept aside (:class:`Deadline`), answering 503
  when it runs out (the rollout is kept: the sandbox being made is there for the retry);
  a call whose command no longer fits in what is left is a 503 that never ran it (its
  retry runs it whole: cutting the command short would score our delay as the agent's
  timeout);
- :func:`check_agent_rft_bound` refuses to start a deployment whose settings cannot fit.

The rollout API has no such bound: its clients choose their own timeouts.
"""

from __future__ import annotations

import math
import time

from orchestrator.config import Settings
from orchestrator.sandbox.agent.client import PROBE_MAX_S, REPLY_SLACK_S
from orchestrator.state.models import RolloutSource

PROBE_ALLOWANCE_S = PROBE_MAX_S + 2.0
"""A failed call is probed before it is answered (queue/handlers.py); a probe takes up to
PROBE_MAX_S (slow is not dead: a silent agent is asked again before it counts as gone)."""

MIN_AGENT_RFT_COMMAND_S = 10.0
"""The shortest command cap an Agent RFT deployment may run with."""
MIN_AGENT_RFT_ACQUIRE_S = 10.0
"""The least time a rollout's first call (with the default command timeout) must have for
its sandbox within the bound."""


def call_overhead_s(settings: Settings) -> float:
    """What a call may take besides its command: the wait for a worker, the exec agent's
    reply allowance, and a probe of the sandbox after a limit or a failure."""
    return settings.queue_wait_s + REPLY_SLACK_S + PROBE_ALLOWANCE_S


def call_bound_s(settings: Settings, command_timeout_max_s: float | None = None) -> float:
    """The longest a dispatched call takes from sending to its result."""
    command = command_timeout_max_s or settings.command_timeout_max_s
    return command + call_overhead_s(settings)


def agent_rft_budget_s(settings: Settings) -> float:
    """How long one Agent RFT request may take: its bound less the margin."""
    return settings.agent_rft_call_bound_s - settings.agent_rft_call_margin_s


def agent_rft_command_cap_s(settings: Settings) -> float:
    """The longest command an Agent RFT call may run, so the call fits its bound."""
    return min(
        settings.command_timeout_max_s, agent_rft_budget_s(settings) - call_overhead_s(settings)
    )


def agent_rft_settings(settings: Settings) -> Settings:
    """``settings`` as Agent RFT's calls see them: the command timeouts capped to fit the
    platform's bound (the tools' schemas and argument checks say so to the model)."""
    return settings.with_command_cap(agent_rft_command_cap_s(settings))


def check_agent_rft_bound(settings: Settings) -> None:
    """Refuse settings with which an Agent RFT call cannot fit the platform's bound.
    Raises ValueError naming the settings to change."""
    cap = agent_rft_command_cap_s(settings)
    parts = (
        f"ORCH_AGENT_RFT_CALL_MARGIN_S ({settings.agent_rft_call_margin_s:g}) + "
        f"ORCH_QUEUE_WAIT_S ({settings.queue_wait_s:g}) + the agent's reply allowance "
        f"({REPLY_SLACK_S:g}) + a probe ({PROBE_ALLOWANCE_S:g})"
    )
    if cap < MIN_AGENT_RFT_COMMAND_S:
        raise ValueError(
            f"an Agent RFT call cannot fit its {settings.agent_rft_call_bound_s:g} s bound: "
            f"{parts} leave {cap:g} s for a command, less than {MIN_AGENT_RFT_COMMAND_S:g} s; "
            "lower ORCH_QUEUE_WAIT_S or ORCH_AGENT_RFT_CALL_MARGIN_S"
        )
    first = agent_rft_budget_s(settings) - call_bound_s(
        settings, min(settings.command_timeout_s, cap)
    )
    if first < MIN_AGENT_RFT_ACQUIRE_S:
        raise ValueError(
            f"an Agent RFT rollout's first call cannot fit its "
            f"{settings.agent_rft_call_bound_s:g} s bound: {parts} and ORCH_COMMAND_TIMEOUT_S "
            f"({settings.command_timeout_s:g}) leave {first:g} s to get its sandbox, less "
            f"than {MIN_AGENT_RFT_ACQUIRE_S:g} s; lower ORCH_COMMAND_TIMEOUT_S or ORCH_QUEUE_WAIT_S"
        )


class Deadline:
    """The time one request has left (``None``: no bound), on the monotonic clock."""

    def __init__(self, seconds: float | None) -> None:
        self.at = None if seconds is None else time.monotonic() + seconds

    @classmethod
    def for_source(cls, settings: Settings, source: RolloutSource) -> Deadline:
        """Agent RFT's requests are bounded (:func:`agent_rft_budget_s`); others are not."""
        return cls(agent_rft_budget_s(settings) if source == RolloutSource.AGENT_RFT else None)

    def remaining(self) -> float:
        return math.inf if self.at is None else max(0.0, self.at - time.monotonic())

    def cap(self, seconds: float, *, reserve: float = 0.0) -> float:
        """``seconds``, or what is left after keeping ``reserve`` for what follows."""
        return max(0.0, min(seconds, self.remaining() - reserve))

    def left(self, *, reserve: float = 0.0) -> float | None:
        """What is left after keeping ``reserve`` (never below 0); None: no bound."""
        return None if self.at is None else self.cap(math.inf, reserve=reserve)
