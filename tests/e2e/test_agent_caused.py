"""The agent-caused table on Docker (runc and gVisor's runsc): each act of
tests/agent_caused.py as a real Agent RFT rollout on the shared side stack, scored, never
discarded. The Kubernetes column is tests/k8s/test_agent_caused.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.agent_caused import ACTS, GOLD, Act, run_act
from tests.conftest import runsc_available
from tests.e2e.conftest import ACT_ENVIRONMENTS
from tests.stacks import TOKEN, Stack

pytestmark = pytest.mark.xdist_group("agent-caused")

RUNTIMES = ACT_ENVIRONMENTS


@pytest.fixture(scope="module")
def acts_stack(side: Stack) -> Stack:
    """The shared side deployment (tests/e2e/conftest.py): it holds the table's
    environments, one per runtime, with tests/agent_caused.py's limits."""
    return side


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("act", ACTS, ids=[a.name for a in ACTS])
def test_what_the_agent_does_to_its_sandbox_is_scored(
    acts_stack: Stack, act: Act, runtime: str
) -> None:
    if runtime == "runsc" and not runsc_available():
        pytest.skip("gVisor (runsc) is not registered with this Docker daemon")
    item: dict[str, Any] = {
        "environment": RUNTIMES[runtime],
        "codebase": acts_stack.codebase,
        "gold_files": GOLD,
    }
    row = run_act(acts_stack.base_url, TOKEN, item, act, f"docker {runtime}")
    assert not row.problems(), row
