"""Agent RFT's 10-minute bound as the orchestrator keeps it (orchestrator/rollouts/bounds.py,
docs/agent-rft.md): the arithmetic of the caps, and the refusal of settings that cannot fit.
The end-to-end behaviour is tests/e2e/test_reward_integrity.py's."""

from __future__ import annotations

import time

import pytest

from orchestrator.config import Settings
from orchestrator.rollouts.bounds import (
    Deadline,
    agent_rft_budget_s,
    agent_rft_command_cap_s,
    agent_rft_settings,
    call_bound_s,
    call_overhead_s,
    check_agent_rft_bound,
)
from orchestrator.state.models import RolloutSource


def test_defaults_fit_the_bound_with_the_caps_the_docs_state() -> None:
    settings = Settings()
    assert agent_rft_budget_s(settings) == 570
    assert call_overhead_s(settings) == 105  # queue 30 + agent reply 10 + a probe 65
    assert agent_rft_command_cap_s(settings) == 465
    capped = agent_rft_settings(settings)
    assert (capped.command_timeout_max_s, capped.command_timeout_s) == (465, 30)
    # The longest Agent RFT call fits the budget exactly; the rollout API's may not.
    assert call_bound_s(capped) == agent_rft_budget_s(settings)
    assert call_bound_s(settings) > settings.agent_rft_call_bound_s
    # A first call with the default command keeps 435 s for its sandbox.
    assert agent_rft_budget_s(settings) - call_bound_s(settings, 30) == 435
    check_agent_rft_bound(settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (Settings(queue_wait_s=500), "leave -5 s for a command"),
        (
            Settings(agent_rft_call_bound_s=150, queue_wait_s=5, command_timeout_s=35),
            "leave 5 s to get its sandbox",
        ),
    ],
)
def test_settings_that_cannot_fit_are_refused(settings: Settings, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_agent_rft_bound(settings)


def test_a_deadline_keeps_its_reserve() -> None:
    unbounded = Deadline.for_source(Settings(), RolloutSource.API)
    assert unbounded.left(reserve=1e9) is None and unbounded.cap(5.0) == 5.0
    bounded = Deadline(10.0)
    assert 9 < bounded.cap(60.0) <= 10
    assert bounded.cap(60.0, reserve=4.0) <= 6
    assert bounded.left(reserve=20.0) == 0.0
    time.sleep(0.05)
    assert bounded.remaining() < 10
    rft = Deadline.for_source(Settings(), RolloutSource.AGENT_RFT)
    assert 569 < rft.remaining() <= 570
