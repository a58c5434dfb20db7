"""The agent-caused table's Kubernetes column: each act of tests/agent_caused.py as a real
Agent RFT rollout on the whole stack on the Kubernetes backend (conftest.py's
``k8s_stack``: real API, worker and reaper; pods run by the real kubelet of node.py),
scored, never discarded.

What makes it hold here: the agent runs as root with only SETUID, SETGID, SETPCAP and KILL
and runs commands as uid 1000 (pods.py), so no command can kill or stop it; what ends the
sandbox by the agent's own doing (its memory limit: OOMKilled; its disk limit: evicted by
the kubelet) is mapped to agent_error by sandbox/k8s/states.py. The node's kubelet caps each
pod at the acts' pids limit (its ``podPidsLimit``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.agent_caused import ACTS, GOLD, LIMITS, Act, run_act
from tests.k8s.conftest import ACTS as ACTS_ENVIRONMENT
from tests.k8s.conftest import K8sStack
from tests.stacks import TOKEN

pytestmark = pytest.mark.xdist_group("real-node")


@pytest.fixture(scope="module")
def real_node_options() -> dict[str, Any]:
    """This module's node caps every pod at the acts' pids limit."""
    return {"pod_pids_limit": LIMITS["pids"]}


@pytest.mark.parametrize("act", ACTS, ids=[a.name for a in ACTS])
def test_what_the_agent_does_to_its_pod_is_scored(k8s_stack: K8sStack, act: Act) -> None:
    item: dict[str, Any] = {"environment": ACTS_ENVIRONMENT, "gold_files": GOLD}
    row = run_act(k8s_stack.base_url, TOKEN, item, act, "kubernetes")
    assert not row.problems(), row
