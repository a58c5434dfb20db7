"""The agent-caused table on Docker (runc and gVisor's runsc): each act of
tests/agent_caused.py as a real Agent RFT rollout on a stack of its own, scored, never
discarded. The Kubernetes column is tests/k8s/test_agent_caused.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.agent_caused import ACTS, GOLD, LIMITS, Act, run_act
from tests.conftest import runsc_available
from tests.e2e.conftest import TOKEN, Stack, side_stack

pytestmark = pytest.mark.xdist_group("agent-caused")

RUNTIMES = {"runc": "acts-runc", "runsc": "acts-runsc"}


@pytest.fixture(scope="module")
def acts_stack(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("acts-stack")
    env_file = root / "environments.yaml"
    env_file.write_text(
        yaml.safe_dump(
            {
                "environments": [
                    {
                        "name": name,
                        "runtime": runtime,
                        "tools": ["shell"],
                        "limits": LIMITS,
                        "grader": {"name": "file_f1"},
                    }
                    for runtime, name in RUNTIMES.items()
                ]
            }
        )
    )
    with side_stack(stack, root, name="ac", environments_file=env_file) as started:
        yield started


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
